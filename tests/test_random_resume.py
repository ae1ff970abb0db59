"""Exact resume with real training's randomness (checkpointer.Checkpointer, seeded_dataset.py, sharded_stream.py).

rank_scripts/random_loop.py trains 2 epochs over data_sampler with a random augmentation in __getitem__ (torch's
global generator, as torchvision's transforms draw), optionally dropout, DataLoader workers and gradient
accumulation; rank 1 signals itself mid-epoch, and the same command resumes. Each run's rank 0 logs what every
global step trained on (every rank's (index, input) rows, sorted by index), so a resumed run is compared with an
uninterrupted one step by step, at the same or at another world size, and by its final weights.
rank_scripts/stream_loop.py does the same over sharded_stream with its augmentation in 2 loader workers per rank.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpointer
import distributed
from harness import SCRIPTS, assert_bitwise_equal, at_once, start, warm_ranks



def start_random_loop(tmp_path: Path, snapshot: str, out: str, nprocs: int, batch: int, stop: int,
                      *flags: str) -> subprocess.Popen:
    command = [sys.executable, str(SCRIPTS / "random_loop.py"), str(tmp_path / snapshot), str(tmp_path / out),
               str(nprocs), str(batch), str(stop), *flags]
    return start(command, tmp_path, env=warm_ranks())


def random_loop(*args: object) -> subprocess.CompletedProcess:
    return at_once([start_random_loop(*args)])[0]


def trained(directory: Path, out: str) -> tuple[dict, dict]:
    """(what each global step trained on, the final weights) of a run that wrote ``out``."""
    return torch.load(directory / f"{out}.steps"), distributed.load_checkpoint(directory / out)["model"]


def stop_and_resume(tmp_path: Path, flags: list[str], stop: int = 5, batch: int = 16, world: int = 2
                    ) -> tuple[dict, dict]:
    """The loop at ``world`` processes stopped by SIGUSR1 after step ``stop`` of epoch 1, then resumed to the end;
    beside the stopped run, the uninterrupted one (straight.pt)."""
    straight, stopped = at_once([start_random_loop(tmp_path, "never.pt", "straight.pt", world, batch, 0, *flags),
                                 start_random_loop(tmp_path, "snap.pt", "resumed.pt", world, batch, stop, *flags)])
    assert straight.returncode == 0, straight.stderr
    assert stopped.returncode == 138, stopped.stderr
    assert f"stopped by SIGUSR1 after 0 epochs and {stop} steps; saved to" in stopped.stdout, stopped.stdout
    resumed = random_loop(tmp_path, "snap.pt", "resumed.pt", world, batch, 0, *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert f"after 0 epochs and {stop} steps (saved at world size {world})" in resumed.stdout, resumed.stdout
    return trained(tmp_path, "resumed.pt")


@pytest.mark.slow
@pytest.mark.parametrize("augment, more", [("global", ["--loop-draws"]), ("seeded", ["--amp"])],
                         ids=["global-python-numpy-in-the-loop", "seeded-float16-autocast-gradscaler-clipping"])
def test_resume_with_dropout_and_augmentation_in_the_rank_is_bitwise(tmp_path, augment, more):
    """Dropout 0.2 and an augmentation drawing from the rank's global generator (num_workers=0), plain or through
    seeded_dataset (a batch read in the rank, its items seeded by index, not by read order: a seed from the read
    count fails here). The plain case also draws in the loop from Python's random (a sign flip, as RandomChoice or
    a cutmix draws) and, where numpy is installed, numpy's global generator (a mixup's np.random.beta), each seeded
    per rank at the start: before, the Checkpointer saved only torch's generators and the resumed run drew other
    flips (and mixes) from the seed the script set again (tried: it fails at step 6, and with numpy's left out).
    Before, the resumed epoch's new DataLoader iterator drew its workers' base seed from the
    restored generator, shifting every later mask and augmentation by one draw: the data and the weights differed.
    That a batch read gives the loop's generators back is test_ddp.py's (a resume cannot see it: a generator left
    at the last item's seed is as repeatable).
    The seeded run also trains as mixed precision does (float16 autocast, gradients unscaled and clipped, a
    GradScaler in the Checkpointer's state, its scale backing off and growing during the run): every step runs with
    the uninterrupted run's scale and growth count (tried: without the scaler in state the weights differ)."""
    flags = ["--dropout", "0.2", "--augment", augment, *more]
    steps, model = stop_and_resume(tmp_path, flags)
    expected_steps, expected_model = trained(tmp_path, "straight.pt")
    assert sorted(steps) == sorted(expected_steps) == list(range(1, 17))
    assert_bitwise_equal(steps, expected_steps, "what each step trained on")
    assert_bitwise_equal(model, expected_model, "final model")
    if "--amp" in more:
        scales, expected_scales = (torch.load(tmp_path / f"{out}.scales") for out in ("resumed.pt", "straight.pt"))
        assert sorted(scales) == list(range(1, 17)) and len({float(s[0]) for s in scales.values()}) > 1, scales
        assert_bitwise_equal(scales, expected_scales, "the GradScaler's (scale, growth tracker) at each step")


@pytest.mark.slow
def test_numpy_and_an_owned_generator_in_workers_resume_bitwise(tmp_path):
    """Augmentation from numpy's global generator and from a generator the dataset owns (seeded per item from
    torch.initial_seed(), as seeded_dataset's docstring shows), in 2 loader workers, stopped mid-epoch at world 2:
    every step trains on the uninterrupted run's samples and the weights are bitwise its. Before, numpy was not
    seeded: 2 of 2 runs differed."""
    pytest.importorskip("numpy")
    steps, model = stop_and_resume(tmp_path, ["--augment", "numpy-and-owned", "--workers", "2"])
    expected_steps, expected_model = trained(tmp_path, "straight.pt")
    assert_bitwise_equal(steps, expected_steps, "what each step trained on")
    assert_bitwise_equal(model, expected_model, "final model")


@pytest.mark.slow
def test_a_sampler_of_the_users_own_resumes_mid_epoch_bitwise(tmp_path):
    """A repeated-augmentation sampler of the script's own (each index 3 times an epoch, its order a function of
    set_epoch, no skip of its own), dropout 0.2 and seeded augmentation in 2 loader workers, stopped mid-epoch
    (one process: the sampler's skip is the rank's own; world 2's sharded skip is data_sampler's, proven above):
    the resumed run starts the sampler's order after the samples done, every step trains on the uninterrupted run's
    samples and the weights are bitwise its. Before, the Checkpointer saved the mid-epoch snapshot and then refused
    to start from it."""
    flags = ["--dropout", "0.2", "--augment", "seeded", "--workers", "2", "--sampler", "repeated"]
    steps, model = stop_and_resume(tmp_path, flags, batch=96, world=1)
    expected_steps, expected_model = trained(tmp_path, "straight.pt")
    assert sorted(steps) == sorted(expected_steps) == list(range(1, 17))  # 768 of 256 x 3 samples, 96 a step
    assert_bitwise_equal(steps, expected_steps, "what each step trained on")
    assert_bitwise_equal(model, expected_model, "final model")


# 3 micro-batches of 8 per step at world 2 (global batch 48): 16 batches a rank an epoch, so 5 steps and a
# short last one of 1 micro-batch; the stop signal comes during step 3's group, the stop after it.
SEEDED = ["--augment", "seeded", "--workers", "2", "--accum", "3"]


@pytest.fixture(scope="module")
def seeded_runs(tmp_path_factory) -> Path:
    """The augmentation through seeded_dataset in 2 DataLoader workers per rank, no dropout, 3 micro-batches a
    step: an uninterrupted run at world 2 (straight.pt) and a snapshot stopped after 0 epochs and 3 steps, the
    signal sent between two micro-batches of that step (snap.pt, its steps logged)."""
    tmp = tmp_path_factory.mktemp("seeded")
    straight, stopped = at_once([start_random_loop(tmp, "never.pt", "straight.pt", 2, 8, 0, *SEEDED),
                                 start_random_loop(tmp, "snap.pt", "resumed.pt", 2, 8, 3, *SEEDED, "--stop-mid-group")])
    assert straight.returncode == 0, straight.stderr
    assert stopped.returncode == 138 and "after 0 epochs and 3 steps" in stopped.stdout, stopped.stderr
    return tmp


RESUMES = {"world-2-persistent-workers": (2, 8, ["--persistent"]), "world-1": (1, 16, []), "world-4": (4, 4, [])}


@pytest.fixture(scope="module")
def seeded_resumes(seeded_runs) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each of RESUMES from a copy of the stopped snapshot, all at once; (its result, its directory)."""
    started = {}
    for name, (nprocs, batch, flags) in RESUMES.items():
        directory = seeded_runs / name
        directory.mkdir()
        shutil.copy(seeded_runs / "snap.pt", directory / "snap.pt")
        shutil.copy(seeded_runs / "resumed.pt.steps", directory / "resumed.pt.steps")  # the steps before the stop
        started[name] = (start_random_loop(directory, "snap.pt", "resumed.pt", nprocs, batch, 0, *SEEDED, *flags),
                         directory)
    results = at_once([proc for proc, _ in started.values()])
    return {name: (result, directory) for (name, (_, directory)), result in zip(started.items(), results, strict=False)}


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMES)
def test_seeded_augmentation_in_workers_resumes_to_the_same_data(seeded_runs, seeded_resumes, name):
    """Resumed from the world-2 snapshot (stopped with 2 workers per rank, not persistent) at the same global
    batch (48 = batch x 3 micro-batches x processes): every step, the epoch's short last one included, trains on
    exactly the uninterrupted run's samples and augmentations, whichever rank and worker reads them (persistent
    workers keep their dataset across the epoch boundary: the epoch still reaches them). A resume that skipped
    only 1/3 of what it had trained (the accumulation forgotten) would train on other samples. At world 2 the
    weights are bitwise the uninterrupted run's; at 1 and 4 equal up to the order of the gradient sums (float64:
    1e-9)."""
    resumed, directory = seeded_resumes[name]
    assert resumed.returncode == 0, resumed.stderr
    steps, model = trained(directory, "resumed.pt")
    expected_steps, expected_model = trained(seeded_runs, "straight.pt")
    assert sorted(steps) == sorted(expected_steps) == list(range(1, 13))
    assert_bitwise_equal(steps, expected_steps, "what each step trained on")
    if RESUMES[name][0] == 2:
        assert_bitwise_equal(model, expected_model, "final model")
    for key, value in expected_model.items():
        torch.testing.assert_close(model[key], value, rtol=1e-9, atol=1e-9)


def start_stream_loop(tmp_path: Path, snapshot: str, out: str, nprocs: int, stop: int, *flags: str
                      ) -> subprocess.Popen:
    command = [sys.executable, str(SCRIPTS / "stream_loop.py"), str(tmp_path / snapshot), str(tmp_path / out),
               str(nprocs), str(stop), "--workers", "2", *flags]
    return start(command, tmp_path, env=warm_ranks())


@pytest.fixture(scope="module")
def stream_runs(tmp_path_factory) -> Path:
    """rank_scripts/stream_loop.py at world 2, 2 loader workers per rank, no dropout: an uninterrupted run
    (straight.pt) and one stopped by SIGUSR1 after 0 epochs and 7 steps (snap.pt; its reads in stopped.reads)."""
    tmp = tmp_path_factory.mktemp("stream")
    straight, stopped = at_once([start_stream_loop(tmp, "never.pt", "straight.pt", 2, 0),
                                 start_stream_loop(tmp, "snap.pt", "resumed.pt", 2, 7)])
    assert straight.returncode == 0, straight.stderr
    assert stopped.returncode == 138 and "after 0 epochs and 7 steps" in stopped.stdout, stopped.stderr
    return tmp


def read_calls(path: Path) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_sharded_stream_stopped_mid_epoch_resumes_bitwise_in_workers(tmp_path):
    """A sharded stream (12 streams, 30 shards of unequal size) read by 2 loader workers per rank at world 2, a
    random augmentation per record in the workers, dropout 0.2 in the ranks, stopped by SIGUSR1 mid-epoch and
    resumed after 12 steps: every step trains the uninterrupted run's records, augmented alike, and the weights are
    bitwise its. The resumed stream opens no shard the stopped run had trained whole, and starts each stream's
    shard at the first record not trained, through read(shard, start) (tried: a state without the positions
    restarts the epoch and fails)."""
    flags = ["--dropout", "0.2"]
    straight, stopped = at_once([start_stream_loop(tmp_path, "never.pt", "straight.pt", 2, 0, *flags),
                                 start_stream_loop(tmp_path, "snap.pt", "resumed.pt", 2, 12, *flags)])
    assert straight.returncode == 0, straight.stderr
    assert stopped.returncode == 138 and "stopped by SIGUSR1 after 0 epochs and 12 steps" in stopped.stdout
    before = torch.load(tmp_path / "resumed.pt.steps")
    (tmp_path / "resumed.pt.reads").unlink()
    resumed = at_once([start_stream_loop(tmp_path, "snap.pt", "resumed.pt", 2, 0, *flags)])[0]
    assert resumed.returncode == 0, resumed.stderr
    assert "after 0 epochs and 12 steps (saved at world size 2)" in resumed.stdout, resumed.stdout
    steps, model = trained(tmp_path, "resumed.pt")
    expected_steps, expected_model = trained(tmp_path, "straight.pt")
    assert sorted(steps) == sorted(expected_steps) and len(steps) > 30
    assert_bitwise_equal(steps, expected_steps, "what each step trained on")
    assert_bitwise_equal(model, expected_model, "final model")
    done = torch.cat([rows[:, 0] for rows in before.values()]).long().tolist()
    whole = {shard for shard in range(30) if sum(1 for i in done if i // 1000 == shard) == 20 + shard % 8}
    first = read_calls(tmp_path / "resumed.pt.reads")[:12]  # each stream's first read after the resume
    assert whole and not whole & {shard for shard, _ in first}, (whole, first)  # 24 records a stream: the first
    assert [start for _, start in first] == [sum(1 for i in done if i // 1000 == shard) for shard, _ in first]


@pytest.mark.slow
def test_a_sharded_stream_resumes_at_another_world_on_the_same_records(stream_runs):
    """Stopped at world 2 (2 loader workers each), resumed at world 3 (2 each: 6 readers of the 12 streams) with
    the same global batch: every remaining step trains the same records, augmented bitwise alike, as the
    uninterrupted world-2 run, and the weights end within float64 rounding of it (the gradient sums add in
    another order: 1e-12)."""
    directory = stream_runs / "world-3"
    directory.mkdir()
    shutil.copy(stream_runs / "snap.pt", directory / "snap.pt")
    shutil.copy(stream_runs / "resumed.pt.steps", directory / "resumed.pt.steps")
    resumed = at_once([start_stream_loop(directory, "snap.pt", "resumed.pt", 3, 0)])[0]
    assert resumed.returncode == 0, resumed.stderr
    assert "after 0 epochs and 7 steps (saved at world size 2)" in resumed.stdout, resumed.stdout
    steps, model = trained(directory, "resumed.pt")
    expected_steps, expected_model = trained(stream_runs, "straight.pt")
    assert_bitwise_equal(steps, expected_steps, "what each step trained on")
    for key, value in expected_model.items():
        torch.testing.assert_close(model[key], value, rtol=1e-12, atol=1e-12)


def test_a_resumed_optimizer_keeps_its_state_where_a_fresh_one_does(tmp_path, stop_signals_restored):
    """A snapshot is loaded onto the CPU and each object's load_state_dict places its tensors: Adam's step
    counters stay where a fresh Adam keeps them (the CPU; on a GPU, moved there, foreach Adam would sync with the
    host for every parameter at every step, pytorch/pytorch#128208; test_gpu.py checks that case)."""
    def adam_after_one_step() -> torch.optim.Adam:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = adam_after_one_step()
    checkpointer.Checkpointer(tmp_path / "snap.pt", model, optimizer, batch_size=1).save()
    fresh_model, fresh = adam_after_one_step()
    resumed_model = torch.nn.Linear(3, 2)
    resumed = torch.optim.Adam(resumed_model.parameters())
    checkpointer.Checkpointer(tmp_path / "snap.pt", resumed_model, resumed, batch_size=1)
    where = lambda opt: [(k, v.device, v.dtype) for s in opt.state.values() for k, v in s.items()]  # noqa: E731
    assert where(resumed) == where(fresh) and where(fresh)
