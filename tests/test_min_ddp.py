"""Proof of the example: every DDP line of min_ddp.py, against a plain 1-process loop written here.

min_ddp.py runs as a command (rank_scripts/min_ddp_driver.py: float64 as torch's default dtype, 2048 training
samples) through launch(), and the reference below shares no code with it but the dataset. It reads the
data as DistributedSampler promises: a new permutation from seed + epoch every epoch, padded to a multiple
of the world size, rank r taking every world-th index, each global step the union of every rank's next
batch (and, with --grad-accum k, of k micro-batches per rank). The reference also computes what every
metric line must say: each rank's loss and accuracy over each logged interval, and their global sums.
Tolerances as in test_ddp.py: float64, rtol = atol = 1e-9 (the all-reduce sums in another order than one
big batch; a wiring bug is >= 1e-3); printed metrics within their 4 printed decimals.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import uuid

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import distributed
import min_ddp
from ddp_check import assert_step_equivalent
import min_ddp_cli
from harness import (CLASSES, FEATURES, HERE, assert_bitwise_equal, at_once, leftover_processes, one_thread, run,
                     run_min_ddp, signal_once_printed, start_min_ddp, without_numpy)

RTOL = ATOL = 1e-9
EPOCHS, SEED, LR, TRAIN_SIZE = 2, 7, 0.05, 2048
# (world, --batch-size, --grad-accum, --log-every): world 3 pads 2048 samples to 2049 and ends each epoch
# with a short batch; the log intervals do not divide the epochs.
RUNS = [(1, 128, 1, 7), (2, 64, 1, 5), (4, 32, 1, 100), (2, 32, 3, 3), (3, 50, 1, 4)]


def dataset_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """min_ddp's (input, label) pairs in float64, as one input tensor and one label tensor."""
    with float64():
        size = TRAIN_SIZE if split == "train" else min_ddp.VAL_SIZE
        inputs, labels = zip(*min_ddp.make_dataset(split, size), strict=True)
    return torch.stack(inputs), torch.tensor(labels)


class float64:
    """torch's default dtype float64 inside the block, as the driver sets it for min_ddp."""

    def __enter__(self):
        self.before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.before)


def initial_model() -> nn.Module:
    """min_ddp's model, built after the same seed."""
    with float64():
        torch.manual_seed(SEED)
        return nn.Sequential(nn.Linear(min_ddp.FEATURES, 256, bias=False), nn.BatchNorm1d(256), nn.ReLU(),
                             nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, min_ddp.CLASSES))


def reference(world: int, batch: int, accum: int, log_every: int, reshuffle: bool = True) -> tuple[nn.Module, list]:
    """min_ddp's training written as one process; the model, and the metric lines it must print as
    (epoch, batch, [(rank loss, rank acc)...], (global loss, global acc, correct, samples))."""
    model, (x, y) = initial_model(), dataset_tensors("train")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    lines = []
    with one_thread():
        for epoch in range(EPOCHS):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch * reshuffle))
            order = torch.cat([order, order[:-len(order) % world]])  # DistributedSampler pads with the first
            shards = [order[rank::world] for rank in range(world)]
            batches = -(-len(shards[0]) // batch)
            sums = torch.zeros(world, 3, dtype=torch.float64)  # per rank: loss sum, correct, samples
            for i in range(batches):
                group = [shard[i * batch:(i + 1) * batch] for shard in shards]
                # One forward over every rank's micro-batch: synchronized BatchNorm normalizes over them all.
                logits, idx = model(x[torch.cat(group)]), torch.cat(group)
                size = min(accum, batches - i // accum * accum)  # micro-batches in this optimizer step
                (F.cross_entropy(logits, y[idx]) / size).backward()
                with torch.no_grad():
                    for rank, part in enumerate(logits.split([len(g) for g in group])):
                        sums[rank] += torch.tensor([F.cross_entropy(part, y[group[rank]]).item() * len(part),
                                                    (part.argmax(1) == y[group[rank]]).sum().item(), len(part)])
                if (i + 1) % log_every == 0 or i + 1 == batches:
                    total = sums.sum(0)
                    lines.append((epoch + 1, i + 1, [(s[0] / s[2], s[1] / s[2]) for s in sums.tolist()],
                                  (total[0] / total[2], total[1] / total[2], total[1], total[2])))
                    sums.zero_()
                if (i + 1) % accum == 0 or i + 1 == batches:  # the group's last micro-batch: a step
                    optimizer.step()
                    optimizer.zero_grad()
    return model, lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of RUNS once, all at once (each with its own threads, so the same sums): (its final model, its
    stdout)."""
    started = {}
    for world, batch, accum, log_every in RUNS:
        tmp = tmp_path_factory.mktemp(f"world{world}")
        started[world, batch, accum, log_every] = tmp, start_min_ddp(
            tmp, "--nprocs", str(world), "--epochs", str(EPOCHS), "--batch-size", str(batch), "--grad-accum",
            str(accum), "--log-every", str(log_every), "--seed", str(SEED), "--lr", str(LR), "--save-model",
            str(tmp / "model.pt"), "--slow-rank", FLOAT64="1", TRAIN_SIZE=str(TRAIN_SIZE))
    tmp = tmp_path_factory.mktemp("no-sync-bn")
    started["no sync bn"] = tmp, start_min_ddp(
        tmp, "--nprocs", "2", "--epochs", str(EPOCHS), "--batch-size", "64", "--log-every", "5", "--seed", str(SEED),
        "--lr", str(LR), "--save-model", str(tmp / "model.pt"), "--no-sync-bn", FLOAT64="1", TRAIN_SIZE=str(TRAIN_SIZE))
    results = at_once([proc for _, proc in started.values()], timeout=300)
    out = {}
    for (key, (tmp, _)), done in zip(started.items(), results, strict=False):
        assert done.returncode == 0, done.stderr
        out[key] = distributed.load_checkpoint(tmp / "model.pt"), done.stdout
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, batch, accum, log_every", RUNS)
def test_min_ddp_training_equals_a_one_process_loop_on_same_batches(runs, world, batch, accum,
                                                                                 log_every):
    """Fails if min_ddp stops reshuffling each epoch, mis-scales the --grad-accum loss, skips no_sync's
    last all-reduce, feeds ranks overlapping shards, or drops the padding of an uneven world."""
    state, _ = runs[world, batch, accum, log_every]
    expected, _ = reference(world, batch, accum, log_every)
    initial = initial_model().state_dict()
    for key, value in expected.state_dict().items():
        assert (value - initial[key]).abs().max() > 1e-3, "training must move the model"
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, key=key: f"{key}: min_ddp at world {world} != the 1-process loop\n{m}")


@pytest.mark.slow
@pytest.mark.parametrize("world, batch, accum, log_every", RUNS)
def test_min_ddp_slow_rank_prints_its_first_window_after_ten_steps(runs, world, batch, accum, log_every):
    """--slow-rank (on in every run of RUNS, which the test above finds training as one process does): beyond one
    process the primary prints the first window's verdict, steps 2-11, once; alone, nothing."""
    _, printed = runs[world, batch, accum, log_every]
    lines = re.findall(r"^\[slow rank\] steps 2-11, step [\d.]+ ms: (?:balanced|rank \d \(.+\) is late by).*$", printed,
                       re.M)
    assert len(lines) == (world > 1), printed


@pytest.mark.slow
@pytest.mark.parametrize("world, batch, accum, log_every", RUNS)
def test_min_ddp_prints_every_ranks_and_the_global_metrics_of_each_interval(runs, world, batch, accum, log_every):
    """Each [rank k] line is that rank's loss and accuracy over its batches since the last line; each
    [global] line sums every rank's: the intervals tile the epoch (a padded sample counts as trained)."""
    _, printed = runs[world, batch, accum, log_every]
    _, lines = reference(world, batch, accum, log_every)
    got = re.findall(r"^\[(rank \d+|global)\] epoch (\d+) step (\d+)/\d+ \| loss (\S+) \| acc (\S+)"
                     r"(?: \((\d+)/(\d+)\))?$",
                     printed, re.M)
    assert len(got) == len(lines) * (world + 1), printed
    for n, (epoch, batch_no, ranks, (loss, acc, correct, samples)) in enumerate(lines):
        block = got[n * (world + 1):(n + 1) * (world + 1)]
        assert [(int(e), int(b)) for _, e, b, *_ in block] == [(epoch, batch_no)] * (world + 1)
        for (who, _, _, got_loss, got_acc, *_), (want_loss, want_acc) in zip(block, [*ranks, (loss, acc)],
                                                                              strict=True):
            assert abs(float(got_loss) - want_loss) <= 6e-5 and abs(float(got_acc) - want_acc) <= 6e-5, (who, block)
        assert (int(block[-1][5]), int(block[-1][6])) == (correct, samples)


@pytest.mark.slow
@pytest.mark.parametrize("world, batch, accum, log_every", [RUNS[0], RUNS[-1]])
def test_min_ddp_prints_the_validation_of_a_one_process_evaluation_exactly(runs, world, batch, accum, log_every):
    """4096 validation samples over 3 ranks do not divide: padded duplicates would count 4098."""
    state, printed = runs[world, batch, accum, log_every]
    line = re.search(rf"epoch {EPOCHS}/{EPOCHS} \| val_loss (\S+) \| val_acc (\S+) \((\d+)/(\d+)\)", printed)
    assert line, printed
    model = initial_model()
    model.load_state_dict(state)
    model.eval()
    x, y = dataset_tensors("val")
    with one_thread(), torch.no_grad():
        logits = model(x)
    loss, correct = F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item()
    assert line.groups() == (f"{loss:.4f}", f"{correct / len(y):.4f}", str(correct), str(len(y)))


@pytest.mark.slow
def test_min_ddp_without_sync_bn_does_not_train_as_one_process(runs):
    """The control for BatchNorm: with --no-sync-bn each rank normalizes its own 64 samples, and the model lands
    far (> 1e-4) from the one-process loop on the global batch of 128, where the synchronized one is within 1e-9."""
    state, _ = runs["no sync bn"]
    expected, _ = reference(2, 64, 1, 5)
    far = max((state[key] - value).abs().max().item() for key, value in expected.state_dict().items())
    assert far > 1e-4, f"only {far:.1e} from the one-process loop: the control cannot tell"


@pytest.mark.slow
def test_reference_loop_sees_a_missing_reshuffle(runs):
    """The control: the same epochs in one fixed order land far from min_ddp's model, so the test
    above would catch an epoch loop that forgot set_epoch."""
    state, _ = runs[RUNS[0]]
    model, _ = reference(*RUNS[0], reshuffle=False)
    gap = max((state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert gap > 1e-3, f"one fixed order should differ from a reshuffle each epoch (max gap {gap})"


@pytest.mark.slow
def test_min_ddp_two_processes_through_launch_reaches_90_percent(tmp_path):
    marker = f"DDP_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    out = run([sys.executable, "min_ddp.py", "--nprocs", "2", "--epochs", "2", "--log-every", "64"], env={key: value})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("mode=spawn world=2 backend=gloo allreduce=shared-memory device=cpu")
    assert any(line.startswith("[rank 0] epoch 1 step 64/128") for line in lines)
    assert any(line.startswith("[rank 1] epoch 1 step 64/128") for line in lines)
    assert any(line.startswith("[global] epoch 1 step 64/128") for line in lines)
    done = dict(kv.split("=") for kv in lines[-1].removeprefix("done: ").split())
    assert lines[-1].startswith("done: ") and done["world"] == "2" and done["epochs"] == "2"
    # Both count every rank's training samples: the run's rate, a little later than the last epoch's line.
    last_epoch_rate = float(re.findall(r"\| (\d+) samples/s", out.stdout)[-1])
    assert float(done["val_acc"]) >= 0.90 and 0.5 * last_epoch_rate <= float(done["samples_per_s"]) <= last_epoch_rate
    assert {"train_loss", "val_loss"} <= done.keys()
    assert "NumPy" not in out.stderr, out.stderr  # torch's notice that numpy is missing, in any process
    assert leftover_processes(marker) == []



@pytest.mark.slow
def test_min_ddp_saves_and_resumes_on_two_processes_without_numpy(tmp_path):
    """The quick start with --snapshot, in interpreters where numpy cannot be imported: every
    collective (the shared-memory set-up, save_checkpoint, the metrics) must travel as tensors."""
    env = without_numpy(tmp_path)
    check = run([sys.executable, "-c", "import numpy"], env=env)
    assert check.returncode != 0, "the sitecustomize must hide numpy"
    snapshot = tmp_path / "s.pt"
    flags = ["--nprocs", "2", "--snapshot", str(snapshot), "--log-every", "8"]
    first = run_min_ddp(tmp_path, *flags, "--epochs", "1", TRAIN_SIZE="2048", **env)
    assert first.returncode == 0, first.stderr
    assert "allreduce=shared-memory" in first.stdout and "done: world=2 epochs=1" in first.stdout
    second = run_min_ddp(tmp_path, *flags, "--epochs", "2", TRAIN_SIZE="2048", **env)
    assert second.returncode == 0, second.stderr
    assert f"resumed from {snapshot} after 1 epoch" in second.stdout
    assert "epoch 2/2" in second.stdout and "done: world=2 epochs=2" in second.stdout



@pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--epochs", "-1"), ("--nprocs", "0"),
                                         ("--lr", "0"), ("--timeout", "0"), ("--train-size", "0")])
def test_min_ddp_rejects_non_positive_settings(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args([flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"got: {value}" in err and flag in err, err



@pytest.mark.parametrize("nprocs, gpus, refused", [(2, 1, True), (4, 2, True), (2, 2, False), (None, 1, False),
                                                   (2, 0, False)])
def test_min_ddp_more_processes_than_gpus_is_one_line_naming_both_ways_out(nprocs, gpus, refused):
    """On a 1-GPU machine `--nprocs 2` was a ValueError traceback from launch(); parse_args says it in one line."""
    problem = min_ddp_cli.too_many_processes(nprocs, gpus)
    assert (problem is not None) == refused
    assert not refused or (f"--nprocs {nprocs} but {gpus} GPU(s) are visible" in problem and "`python min_ddp.py`"
                           in problem and f"`CUDA_VISIBLE_DEVICES= python min_ddp.py --nprocs {nprocs}`" in problem)



def test_min_ddp_config_file_and_flags_override(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text('{"epochs": 3, "lr": 0.5, "batch_size": 16}')
    args = min_ddp_cli.parse_args(["--config", str(config), "--lr", "0.25"])
    assert (args.epochs, args.lr, args.batch_size) == (3, 0.25, 16)



@pytest.mark.parametrize("content, message", [
    ('{"epoch": 3}', "--config {}: expected a JSON object whose keys are among: nprocs, epochs, batch_size,"),
    ('[3]', "--config {}: expected a JSON object whose keys are among: nprocs, epochs, batch_size,"),
    ('{"lr": ', "--config {}: Expecting value: line 1 column 8"),
    ('{"lr": "fast"}', "argument --lr: invalid float value: 'fast'"),
    ('{"epochs": 0}', "--epochs must be > 0, got: 0"),
])
def test_min_ddp_config_errors_name_the_file_or_the_flag(tmp_path, capsys, content, message):
    config = tmp_path / "cfg.json"
    config.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args(["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(config) in err.strip().splitlines()[-1], err  # one line



def test_min_ddp_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        min_ddp_cli.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "per process (default: 64)" in help_text and "(default: 0.01)" in help_text



@pytest.mark.slow
def test_min_ddp_settings_it_cannot_use_are_one_line_without_a_traceback(tmp_path):
    """A batch larger than a rank's share: the launcher re-raises the rank's SettingsError as itself (a class
    from the script), and min_ddp prints it in one line (a refused resume: test_snapshot.py). A snapshot that
    has every epoch already reports its model and no speed."""
    too_big = run_min_ddp(tmp_path, "--nprocs", "2", "--batch-size", "1025", TRAIN_SIZE="2048")
    assert too_big.returncode == 1 and "Traceback" not in too_big.stderr, too_big.stderr
    assert too_big.stderr.strip().splitlines()[-1].startswith("min_ddp: --batch-size 1025 is more than each "
                                                               "process's share of the training data (1024 samples")
    snapshot = str(tmp_path / "s.pt")
    assert run_min_ddp(tmp_path, "--epochs", "1", "--snapshot", snapshot, TRAIN_SIZE="2048").returncode == 0
    nothing_left = run_min_ddp(tmp_path, "--epochs", "1", "--snapshot", snapshot, TRAIN_SIZE="2048")
    done = nothing_left.stdout.splitlines()[-1]
    assert done.startswith("done: world=1 epochs=1") and "samples_per_s" not in done, nothing_left.stdout



@pytest.mark.slow
def test_min_ddp_ctrl_c_is_one_line_and_exit_code_130():
    code, _, err, _ = signal_once_printed([sys.executable, "min_ddp.py", "--nprocs", "2", "--epochs", "100"], HERE,
                                          "mode=spawn",  # the workers are training
                                          lambda pid: os.killpg(pid, signal.SIGINT))  # Ctrl-C: the foreground group
    assert code == 130 and err == "min_ddp: interrupted\n", err



def test_min_ddp_print_config_reads_back_as_the_same_settings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args(["--print-config", "--epochs", "3", "--lr", "0.5", "--snapshot", str(tmp_path / "s.pt")])
    assert exit_.value.code == 0
    config = tmp_path / "cfg.json"
    config.write_text(capsys.readouterr().out)
    assert min_ddp_cli.parse_args(["--config", str(config)]) == min_ddp_cli.parse_args(
        ["--config", str(config), "--epochs", "3", "--lr", "0.5", "--snapshot", str(tmp_path / "s.pt")])
    assert json.loads(config.read_text())["epochs"] == 3



def test_min_ddp_checks_a_config_files_values_as_flags(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text('{"lr": -1}')
    with pytest.raises(SystemExit):
        min_ddp_cli.parse_args(["--config", str(config)])
    assert "--lr must be > 0, got: -1.0" in capsys.readouterr().err  # checked as the flag would be



@pytest.mark.parametrize("source", ["flag", "config"])
@pytest.mark.parametrize("flag", ["--snapshot", "--save-model"])
def test_min_ddp_refuses_an_unwritable_output_path_before_training(tmp_path, capsys, flag, source):
    path = str(tmp_path / "no" / "such" / "out.pt")
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({flag[2:].replace("-", "_"): path}))
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args([flag, path] if source == "flag" else ["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument {flag}: {path} is a directory, or {os.path.dirname(path)} is missing or read-only" in err, err



@pytest.mark.parametrize("flag", ["--snapshot", "--save-model"])
def test_min_ddp_refuses_a_directory_as_an_output_file_before_training(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args([flag, str(tmp_path)])
    assert exit_.value.code == 2
    assert f"argument {flag}: {tmp_path} is a directory, or" in capsys.readouterr().err



@pytest.mark.slow
def test_min_ddp_with_accumulation_resumes_bitwise_and_at_world_1(runs, tmp_path):
    """--grad-accum 3 at world 2, 32 batches a rank an epoch (10 steps, then a short one of 2 batches): stopped
    after step 4 (a signal at a group's end), resumed and stopped again by a signal that lands between
    micro-batches (rank 1's, 0.3 s after this run's step 2, while it waits in step 7's group), then finished:
    bitwise the uninterrupted run of RUNS. The first snapshot resumed at world 1 x 64 (the same global batch,
    192) ends within float rounding. A skip that forgot the accumulation would train other samples."""
    model, _ = runs[2, 32, 3, 3]
    flags = ["--epochs", str(EPOCHS), "--grad-accum", "3", "--seed", str(SEED), "--lr", str(LR), "--check-every",
             "1", "--log-every", "1000", "--snapshot", str(tmp_path / "snap.pt")]
    run = lambda *more, stop="": run_min_ddp(tmp_path, *flags, *more, FLOAT64="1", TRAIN_SIZE=str(TRAIN_SIZE),  # noqa
                                             STOP_AT=stop)
    first = run("--nprocs", "2", "--batch-size", "32", stop="0:4:SIGUSR1")
    assert first.returncode == 138 and "stopped by SIGUSR1 after 0 epochs and 4 steps" in first.stdout, first.stderr
    shutil.copy(tmp_path / "snap.pt", tmp_path / "at-step-4.pt")
    start = lambda *more, stop="": start_min_ddp(tmp_path, *flags, *more, FLOAT64="1",  # noqa: E731
                                                 TRAIN_SIZE=str(TRAIN_SIZE), STOP_AT=stop)
    second, alone = at_once([start("--nprocs", "2", "--batch-size", "32", stop="1:2:SIGUSR1:late"),
                             start("--nprocs", "1", "--batch-size", "64", "--save-model", str(tmp_path / "alone.pt"),
                                   "--snapshot", str(tmp_path / "at-step-4.pt"))])  # the last --snapshot wins
    assert second.returncode == 138 and "stopped by SIGUSR1 after 0 epochs and 7 steps" in second.stdout, second.stdout
    done = run("--nprocs", "2", "--batch-size", "32", "--save-model", str(tmp_path / "model.pt"))
    assert done.returncode == 0, done.stderr
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")
    assert alone.returncode == 0 and "after 0 epochs and 4 steps (saved at world size 2)" in alone.stdout, alone.stderr
    for key, value in model.items():
        torch.testing.assert_close(distributed.load_checkpoint(tmp_path / "alone.pt")[key], value, rtol=1e-9,
                                   atol=1e-9)

def min_ddp_model() -> nn.Module:
    return nn.Sequential(nn.Linear(min_ddp.FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, min_ddp.CLASSES))


def min_ddp_data() -> list:
    return min_ddp.make_dataset("train", 64)


def min_ddp_momentum(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def min_ddp_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, micro_batches: list, step: int) -> None:
    """min_ddp's step: its own micro_step for each micro-batch (the last syncing, each loss 1/k of the group's mean),
    then the optimizer step as train_epoch takes it."""
    for i, (x, y) in enumerate(micro_batches):
        min_ddp.micro_step(model, x, y, i == len(micro_batches) - 1, len(micro_batches))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_min_ddp_step_passes_the_whole_step_check():
    """ddp_check.assert_step_equivalent on min_ddp's own accumulation and loss scaling (micro_step), at worlds 2
    and 3 with 2 and 3 micro-batches: the same training as one process."""
    assert_step_equivalent(min_ddp_model, min_ddp_data, min_ddp_step, make_optimizer=min_ddp_momentum, accum=2)
    assert_step_equivalent(min_ddp_model, min_ddp_data, min_ddp_step, make_optimizer=min_ddp_momentum,
                           world_sizes=(2,), accum=3)



def task_min_ddp_evaluate(spec: dict) -> tuple[float, float, float]:
    """On every rank of a pool: min_ddp.evaluate on this rank's pad=False share of spec's (input, label) pairs,
    with a float64 linear model."""
    data = list(zip(spec["x"], spec["y"].tolist(), strict=False))
    loader = DataLoader(data, batch_size=spec["batch"], sampler=distributed.data_sampler(data, True, False, pad=False))
    torch.manual_seed(0)
    return min_ddp.evaluate(nn.Linear(spec["x"].shape[1], CLASSES).double(), loader)


@pytest.mark.parametrize("n", [4, 5])
def test_min_ddp_evaluation_sums_unequal_shards_exactly(pools, n):
    """min_ddp's evaluate() at world 3 on 4 or 5 samples (shards 2-1-1, 2-2-1), where a mean of per-rank means,
    scaled by the count or not, is visibly off: the sample and correct counts exact (integers), the float64 loss
    within the reordering of a sum (rtol 1e-12), against one process."""
    gen = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, FEATURES, generator=gen, dtype=torch.float64), torch.randint(CLASSES, (n,), generator=gen)
    torch.manual_seed(0)
    with torch.no_grad():
        logits = nn.Linear(FEATURES, CLASSES).double()(x)
    loss, correct = F.cross_entropy(logits, y).item(), int((logits.argmax(1) == y).sum())
    for got_loss, got_correct, count in pools.run(3, task_min_ddp_evaluate, {"x": x, "y": y, "batch": 1}):
        assert (got_correct, count) == (correct, n)
        assert got_loss == pytest.approx(loss, rel=1e-12, abs=0)
