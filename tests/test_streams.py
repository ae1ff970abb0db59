"""sharded_stream.py: ranks whose data runs out unevenly run the same steps and none is left waiting (real gloo
worker pools of 3 ranks; a hang fails the pool's call after ddp_check.TIMEOUT_S)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

import distributed
from checkpointer import Checkpointer
from sharded_stream import stop_together
from sync_batchnorm import sync_batchnorm

LENGTHS = (5, 7, 6)  # batches per rank at world 3


class Stream(IterableDataset):
    """A rank's stream of 4-sample batches with no length: values rank*100 + 4*batch + position."""

    def __init__(self, rank: int, batches: int):
        self.rank, self.batches = rank, batches

    def __iter__(self):
        for b in range(self.batches):
            yield torch.arange(4, dtype=torch.float64) + self.rank * 100 + 4 * b


def task_uneven_training(spec: dict) -> dict:
    rank = distributed.get_rank()
    source = Stream(rank, LENGTHS[rank])
    if spec["sized"]:
        source = list(source)
    batches = source if spec["sized"] else DataLoader(source, batch_size=None)
    loop, losses = stop_together(batches, every=spec["every"]), []
    for batch in loop:
        losses.append(float(distributed.reduce(batch.sum(), "mean")))  # a collective of the user's every step
    return {"steps": loop.steps, "dropped": loop.dropped, "losses": losses}


@pytest.mark.parametrize("sized, every, dropped",
                         [(False, 16, [0, 2, 1]), (False, 2, [0, -1, -1]), (True, 2, [0, 2, 1])],
                         ids=["stream-read-to-its-end", "stream-read-2-ahead", "list-read-2-ahead"])
def test_uneven_ranks_stop_together_at_the_shortest_with_a_reduce_each_step(pools, sized, every, dropped):
    """Lengths 5, 7 and 6 batches at world 3, a reduce() of the loss every step: every rank runs 5 steps, the same
    reduced values, and returns at once (before, ranks 1 and 2 waited in the 6th reduce until the timeout). What
    the others dropped is counted: exactly where the data has a length or its end was read ahead, as "at least 1"
    (-1) for a stream whose end was not reached."""
    results = pools.run(3, task_uneven_training, {"sized": sized, "every": every}, timeout=60)
    assert [r["steps"] for r in results] == [5, 5, 5]
    assert results[0]["losses"] == results[1]["losses"] == results[2]["losses"] and len(results[0]["losses"]) == 5
    assert all(r["dropped"] == dropped for r in results), results


def task_uneven_evaluation(spec: dict) -> dict:
    rank = distributed.get_rank()
    totals, seen, steps = torch.zeros(2, dtype=torch.float64), [], 0
    loop = stop_together(DataLoader(Stream(rank, LENGTHS[rank]), batch_size=None), until="last", every=spec["every"])
    for batch in loop:
        steps += 1
        if batch is not None:
            totals += torch.stack([batch.sum(), torch.tensor(float(len(batch)))])
            seen += batch.tolist()
    return {"totals": distributed.reduce(totals), "seen": seen, "steps": steps}


@pytest.mark.parametrize("every", [16, 3])
def test_evaluation_goes_on_with_none_until_every_rank_is_done(pools, every):
    """until="last": every rank steps 7 times (the longest), a rank that ran out receiving None; the summed metric
    counts every sample of every rank exactly once."""
    results = pools.run(3, task_uneven_evaluation, {"every": every}, timeout=60)
    every = [float(r * 100 + i) for r, n in enumerate(LENGTHS) for i in range(4 * n)]
    assert [r["steps"] for r in results] == [7, 7, 7]
    assert sorted(sum((r["seen"] for r in results), [])) == sorted(every)
    for r in results:
        assert r["totals"].tolist() == [sum(every), float(len(every))]


def task_with_ddp_accumulation_syncbn_checkpointer(spec: dict) -> dict:
    rank = distributed.get_rank()
    torch.manual_seed(0)
    model = sync_batchnorm(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 1)))
    model = model.double()
    torch.manual_seed(100 + rank)  # dropout masks of each rank's own, as a real loop draws them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(None, model, optimizer, check_every=1)  # its own all-reduce after every optimizer step
    ddp, accum = DDP(model), 2
    for epoch in range(2):
        optimizer.zero_grad()  # the last, cut group of an epoch may have left gradients behind
        batches = DataLoader(Stream(rank, LENGTHS[rank] + epoch), batch_size=None)
        for i, batch in enumerate(stop_together(batches, every=2)):
            x = batch.reshape(1, 4).repeat(3, 1) / 100
            last_of_group = i % accum == accum - 1
            with ddp.no_sync() if not last_of_group else contextlib.nullcontext():
                loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True)) / accum
                loss.backward()
            distributed.reduce(loss.detach(), "mean")
            if last_of_group:
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step()
    return {"steps": ckpt.steps, "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}


def test_stop_together_composes_with_no_sync_sync_batchnorm_and_a_checkpointer(pools):
    """DDP with accumulation under no_sync (the stop can cut a group), synchronized BatchNorm (a collective in every
    forward), dropout drawn per rank, a reduce of the loss and a Checkpointer's stop check after each optimizer
    step, over 2 epochs of uneven streams: no rank waits, every rank ran the same optimizer steps and the replicas
    are bitwise equal."""
    results = pools.run(3, task_with_ddp_accumulation_syncbn_checkpointer, {}, timeout=60)
    assert [r["steps"] for r in results] == [2 + 3] * 3  # 5 batches: 2 steps; 6: 3
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    assert torch.equal(results[0]["weights"], results[2]["weights"])


def test_a_mode_that_is_not_first_or_last_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"until must be 'first' \(training.*'last' \(evaluation.*got: 'longest'"):
        stop_together([], until="longest")
    with pytest.raises(ValueError, match=r"every must be an integer >= 1 \(batches read ahead per question\), got: 0"):
        stop_together([], every=0)


def test_data_sampler_names_stop_together_for_a_stream():
    """An IterableDataset has no indices to shard: data_sampler says so and names what makes the ranks' steps
    agree."""
    with pytest.raises(TypeError, match=r"data_sampler: got an IterableDataset \(Stream\).*stop_together"):
        distributed.data_sampler(Stream(0, 1))
