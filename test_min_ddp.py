"""Proof of the example: every DDP line of min_ddp.py, against a plain 1-process loop written here.

min_ddp's own train() runs in the session's real gloo pools (harness.py) with --dtype float64;
the reference below shares no code with it but make_model and make_dataset. It reads the data as
DistributedSampler promises: a new permutation from seed + epoch every epoch, rank r taking every
world-th index, each global step the union of every rank's next batch (and, with --grad-accum k,
of k micro-batches per rank). Tolerances as in test_ddp.py: float64, rtol = atol = 1e-9 (the
all-reduce sums in another order than one big batch; a wiring bug is >= 1e-3).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import distributed
import min_ddp
from harness import one_thread, task_min_ddp

RTOL = ATOL = 1e-9
EPOCHS, SEED, LR = 2, 7, 0.05


def dataset_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """min_ddp's (input, label) pairs in float64, as one input tensor and one label tensor."""
    inputs, labels = zip(*min_ddp.make_dataset(split, torch.float64))
    return torch.stack(inputs), torch.tensor(labels)


def reference_training(world: int, batch: int, accum: int) -> torch.nn.Module:
    """min_ddp's training written as one process: global batches of world x batch x accum samples."""
    with one_thread():
        torch.manual_seed(SEED)
        model = min_ddp.make_model().double()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        x, y = dataset_tensors("train")
        per_step = batch * accum
        for epoch in range(EPOCHS):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch))
            shards = [order[rank::world] for rank in range(world)]
            for start in range(0, len(shards[0]), per_step):
                idx = torch.cat([shard[start:start + per_step] for shard in shards])
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                optimizer.step()
                optimizer.zero_grad()
        return model


def run_min_ddp(pools, world: int, tmp_path, *flags: str) -> tuple[dict, str]:
    path = tmp_path / f"model-{world}.pt"
    argv = ["--dtype", "float64", "--seed", str(SEED), "--lr", str(LR), "--log-every", "100000",
            "--save-model", str(path), *flags]
    printed = pools.run(world, task_min_ddp, {"argv": argv}, timeout=240)[0]
    return distributed.load_checkpoint(path), printed


@pytest.mark.parametrize("world, batch, accum", [(1, 128, 1), (2, 64, 1), (4, 32, 1), (2, 32, 2), (1, 64, 2)])
def test_min_ddp_training_equals_a_one_process_loop_over_the_same_global_batches(pools, tmp_path, world,
                                                                                 batch, accum):
    """Fails if min_ddp stops reshuffling each epoch, mis-scales the --grad-accum loss, skips
    no_sync's last all-reduce, or feeds ranks overlapping shards. 16384 samples divide evenly
    into every global batch here, so no step mixes batch sizes."""
    assert min_ddp.TRAIN_SIZE % (world * batch * accum) == 0
    state, _ = run_min_ddp(pools, world, tmp_path, "--epochs", str(EPOCHS), "--batch-size", str(batch),
                           "--grad-accum", str(accum))
    reference = reference_training(world, batch, accum).state_dict()
    initial = min_ddp.make_model().state_dict()
    for key, expected in reference.items():
        assert (expected - initial[key].double()).abs().max() > 1e-3, "training must move the model"
        torch.testing.assert_close(state[key], expected, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{key}: min_ddp at world {world} != the 1-process loop\n{m}")


def test_reference_loop_sees_a_missing_reshuffle(pools, tmp_path):
    """The control: the same epochs in one fixed order land far from min_ddp's model, so the test
    above would catch an epoch loop that forgot set_epoch."""
    state, _ = run_min_ddp(pools, 1, tmp_path, "--epochs", str(EPOCHS), "--batch-size", "128")
    with one_thread():
        torch.manual_seed(SEED)
        model = min_ddp.make_model().double()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        x, y = dataset_tensors("train")
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
        for _ in range(EPOCHS):
            for idx in order.split(128):
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                optimizer.step()
                optimizer.zero_grad()
    gap = max((state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert gap > 1e-3, f"one fixed order should differ from a reshuffle each epoch (max gap {gap})"


@pytest.mark.parametrize("world", [1, 3])
def test_min_ddp_prints_the_validation_of_a_one_process_evaluation_exactly(pools, tmp_path, world):
    """4096 validation samples over 3 ranks do not divide: padded duplicates would count 4098."""
    state, printed = run_min_ddp(pools, world, tmp_path, "--epochs", "1", "--batch-size", "100")
    line = re.search(r"epoch 1/1 \| val_loss (\S+) \| val_acc (\S+) \((\d+)/(\d+)\)", printed)
    assert line, printed
    with one_thread(), torch.no_grad():
        model = min_ddp.make_model().double()
        model.load_state_dict(state)
        x, y = dataset_tensors("val")
        logits = model(x)
        loss, correct = F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item()
    assert line.groups() == (f"{loss:.4f}", f"{correct / len(y):.4f}", str(correct), str(len(y)))


def test_min_ddp_global_lines_sum_every_ranks_samples(pools, tmp_path):
    """Each log step's [global] counts add every rank's samples: the epoch's intervals tile the data."""
    _, printed = run_min_ddp(pools, 2, tmp_path, "--epochs", "1", "--batch-size", "64", "--log-every", "50")
    counts = [int(n) for n in re.findall(r"^\[global\] epoch 1 step \d+/128 .*/(\d+)\)$", printed, re.M)]
    assert counts == [50 * 128, 50 * 128, 28 * 128]
    assert len(re.findall(r"^\[rank [01]\] epoch 1 step 50/128", printed, re.M)) == 2
