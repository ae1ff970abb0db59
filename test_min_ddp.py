"""Proof of the example: every DDP line of min_ddp.py, against a plain 1-process loop written here.

min_ddp.py runs as a command (harness.MIN_DDP_DRIVER: float64 as torch's default dtype, 2048 training
samples) through launch(), and the reference below shares no code with it but the dataset. It reads the
data as DistributedSampler promises: a new permutation from seed + epoch every epoch, padded to a multiple
of the world size, rank r taking every world-th index, each global step the union of every rank's next
batch (and, with --grad-accum k, of k micro-batches per rank). The reference also computes what every
metric line must say: each rank's loss and accuracy over each logged interval, and their global sums.
Tolerances as in test_ddp.py: float64, rtol = atol = 1e-9 (the all-reduce sums in another order than one
big batch; a wiring bug is >= 1e-3); printed metrics within their 4 printed decimals.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distributed
import min_ddp
from harness import one_thread, run_min_ddp

RTOL = ATOL = 1e-9
EPOCHS, SEED, LR, TRAIN_SIZE = 2, 7, 0.05, 2048
# (world, --batch-size, --grad-accum, --log-every): world 3 pads 2048 samples to 2049 and ends each epoch
# with a short batch; the log intervals do not divide the epochs.
RUNS = [(1, 128, 1, 7), (2, 64, 1, 5), (4, 32, 1, 100), (2, 32, 2, 3), (3, 50, 1, 4)]


def dataset_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """min_ddp's (input, label) pairs in float64, as one input tensor and one label tensor."""
    with float64():
        inputs, labels = zip(*min_ddp.make_dataset(split, TRAIN_SIZE if split == "train" else min_ddp.VAL_SIZE))
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
        return nn.Sequential(nn.Linear(min_ddp.FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, min_ddp.CLASSES))


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
                with torch.no_grad():
                    for rank, idx in enumerate(group):
                        logits = model(x[idx])
                        sums[rank] += torch.tensor([F.cross_entropy(logits, y[idx]).item() * len(idx),
                                                    (logits.argmax(1) == y[idx]).sum().item(), len(idx)])
                if (i + 1) % log_every == 0 or i + 1 == batches:
                    total = sums.sum(0)
                    lines.append((epoch + 1, i + 1, [(s[0] / s[2], s[1] / s[2]) for s in sums.tolist()],
                                  (total[0] / total[2], total[1] / total[2], total[1], total[2])))
                    sums.zero_()
                if (i + 1) % accum == 0 or i + 1 == batches:  # one optimizer step over the group's batches
                    first = i // accum * accum
                    idx = torch.cat([shard[first * batch:(i + 1) * batch] for shard in shards])
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
                    optimizer.step()
                    optimizer.zero_grad()
    return model, lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of RUNS once: (its final model, its stdout)."""
    out = {}
    for world, batch, accum, log_every in RUNS:
        tmp = tmp_path_factory.mktemp(f"world{world}")
        done = run_min_ddp(tmp, "--nprocs", str(world), "--epochs", str(EPOCHS), "--batch-size", str(batch),
                           "--grad-accum", str(accum), "--log-every", str(log_every), "--seed", str(SEED),
                           "--lr", str(LR), "--save-model", str(tmp / "model.pt"), FLOAT64="1",
                           TRAIN_SIZE=str(TRAIN_SIZE))
        assert done.returncode == 0, done.stderr
        out[world, batch, accum, log_every] = distributed.load_checkpoint(tmp / "model.pt"), done.stdout
    return out


@pytest.mark.parametrize("world, batch, accum, log_every", RUNS)
def test_min_ddp_training_equals_a_one_process_loop_over_the_same_global_batches(runs, world, batch, accum,
                                                                                 log_every):
    """Fails if min_ddp stops reshuffling each epoch, mis-scales the --grad-accum loss, skips no_sync's
    last all-reduce, feeds ranks overlapping shards, or drops the padding of an uneven world."""
    state, _ = runs[world, batch, accum, log_every]
    expected, _ = reference(world, batch, accum, log_every)
    initial = initial_model().state_dict()
    for key, value in expected.state_dict().items():
        assert (value - initial[key]).abs().max() > 1e-3, "training must move the model"
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{key}: min_ddp at world {world} != the 1-process loop\n{m}")


@pytest.mark.parametrize("world, batch, accum, log_every", RUNS)
def test_min_ddp_prints_every_ranks_and_the_global_metrics_of_each_interval(runs, world, batch, accum, log_every):
    """Each [rank k] line is that rank's loss and accuracy over its batches since the last line; each
    [global] line sums every rank's: the intervals tile the epoch (a padded sample counts as trained)."""
    _, printed = runs[world, batch, accum, log_every]
    _, lines = reference(world, batch, accum, log_every)
    got = re.findall(r"^\[(rank \d+|global)\] epoch (\d+) step (\d+)/\d+ \| loss (\S+) \| acc (\S+)(?: \((\d+)/(\d+)\))?$",
                     printed, re.M)
    assert len(got) == len(lines) * (world + 1), printed
    for n, (epoch, batch_no, ranks, (loss, acc, correct, samples)) in enumerate(lines):
        block = got[n * (world + 1):(n + 1) * (world + 1)]
        assert [(int(e), int(b)) for _, e, b, *_ in block] == [(epoch, batch_no)] * (world + 1)
        for (who, _, _, got_loss, got_acc, *_), (want_loss, want_acc) in zip(block, [*ranks, (loss, acc)]):
            assert abs(float(got_loss) - want_loss) <= 6e-5 and abs(float(got_acc) - want_acc) <= 6e-5, (who, block)
        assert (int(block[-1][5]), int(block[-1][6])) == (correct, samples)


@pytest.mark.parametrize("world, batch, accum, log_every", [RUNS[0], RUNS[-1]])
def test_min_ddp_prints_the_validation_of_a_one_process_evaluation_exactly(runs, world, batch, accum, log_every):
    """4096 validation samples over 3 ranks do not divide: padded duplicates would count 4098."""
    state, printed = runs[world, batch, accum, log_every]
    line = re.search(rf"epoch {EPOCHS}/{EPOCHS} \| val_loss (\S+) \| val_acc (\S+) \((\d+)/(\d+)\)", printed)
    assert line, printed
    model = initial_model()
    model.load_state_dict(state)
    x, y = dataset_tensors("val")
    with one_thread(), torch.no_grad():
        logits = model(x)
    loss, correct = F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item()
    assert line.groups() == (f"{loss:.4f}", f"{correct / len(y):.4f}", str(correct), str(len(y)))


def test_reference_loop_sees_a_missing_reshuffle(runs):
    """The control: the same epochs in one fixed order land far from min_ddp's model, so the test
    above would catch an epoch loop that forgot set_epoch."""
    state, _ = runs[RUNS[0]]
    model, _ = reference(*RUNS[0], reshuffle=False)
    gap = max((state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert gap > 1e-3, f"one fixed order should differ from a reshuffle each epoch (max gap {gap})"
