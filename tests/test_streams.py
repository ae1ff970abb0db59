"""sharded_stream.py: ranks whose data runs out unevenly run the same steps and none is left waiting; a sharded
stream trains the same records in every step at any world size and number of loader workers (real gloo worker
pools; a hang fails the pool's call after its timeout). Its exact resume: test_random_resume.py."""
from __future__ import annotations

import contextlib
import itertools
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

import distributed
from checkpointer import Checkpointer
from sharded_stream import sharded_stream, stop_together
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


SHARDS = 30  # of 5 to 8 records: the streams run out unevenly


def read_shard(shard: int, start: int = 0):
    """Shard ``shard``'s records from ``start``: (id, features), id = shard * 1000 + position."""
    for position in range(start, 5 + shard % 4):
        yield torch.tensor(shard * 1000 + position), torch.full((2,), float(shard), dtype=torch.float64)


def jitter(record):
    """A random augmentation: its draws come from the generators seeded by the record's key."""
    ident, x = record
    return ident, x + torch.rand(2, dtype=torch.float64)


def steps_of(stream, epochs: int = 2) -> list:
    """Per epoch, per step, the step's (id, augmented features) rows of every rank, sorted by id."""
    out = []
    for _ in range(epochs):
        steps = []
        for ident, x in stream:
            rows = distributed.all_gather(torch.cat([ident.double()[:, None], x], 1)).flatten(0, 1)
            steps.append(rows[rows[:, 0].argsort()])
        out.append((steps, stream.left_out))
    return out


def task_stream_steps(spec: dict) -> dict:
    torch.manual_seed(distributed.get_rank())  # the ranks' own generators differ, as in training
    runs = {}
    for workers in spec["workers"]:
        stream = sharded_stream(list(range(SHARDS)), read_shard, streams=12, global_batch=24, transform=jitter,
                                num_workers=workers, seed=3)
        runs[workers] = steps_of(stream)
    return runs


@pytest.fixture(scope="module")
def one_process_stream() -> list:
    """The reference: one process reading every stream itself."""
    stream = sharded_stream(list(range(SHARDS)), read_shard, streams=12, global_batch=24, transform=jitter, seed=3)
    return steps_of(stream)


@pytest.mark.parametrize("world, workers", [(1, [2]), (2, [0, 2]), (3, [0, 2]), (4, [0]), (6, [0, 2])])
def test_every_step_trains_the_same_records_at_any_world_and_workers(pools, one_process_stream, world, workers):
    """12 streams over 30 shards of 5 to 8 records, 24 records a step, a random augmentation per record: at worlds
    1, 2, 3, 4 and 6 with 0 or 2 loader workers per rank (where 12 streams split whole), every step of 2 epochs
    trains the same records, augmented bitwise alike, as one process does; every epoch ends at the same step, a new
    deal of the shards each epoch, and the records left out are counted alike."""
    results = [task_stream_steps({"workers": workers})] if world == 1 else pools.run(
        world, task_stream_steps, {"workers": workers}, timeout=90)
    reference = one_process_stream
    assert len(reference[0][0]) == len(reference[1][0]) == 5  # a stream of two 5-record shards runs out first
    assert not torch.equal(reference[0][0][0], reference[1][0][0])  # another deal of the shards
    for k in workers:
        for (steps, left), (want, want_left) in zip(results[0][k], reference, strict=True):
            assert len(steps) == len(want) and left == want_left
            for got, expected in zip(steps, want, strict=True):
                assert torch.equal(got, expected)
    ids = torch.cat([rows[:, 0] for rows in reference[0][0]])
    assert len(ids.unique()) == len(ids)  # each record trained at most once an epoch


def test_a_world_the_streams_do_not_split_into_is_refused_naming_those_that_work():
    with pytest.raises(ValueError, match=r"streams=12 cannot be owned whole by 1 rank\(s\) x 5 reader\(s\).*world "
                                         r"sizes that work are none; at world size 1, num_workers in \[0, 1, 2, 3, 4, "
                                         r"6, 12\]"):
        sharded_stream(list(range(SHARDS)), read_shard, streams=12, global_batch=24, num_workers=5)
    with pytest.raises(ValueError, match=r"global_batch=25 does not split into streams=12.*of 12 \(24 or 36\)"):
        sharded_stream(list(range(SHARDS)), read_shard, streams=12, global_batch=25)
    with pytest.raises(ValueError, match=r"5 shard\(s\) for streams=12, and every stream needs one: use streams <= 5"):
        sharded_stream(list(range(5)), read_shard, streams=12, global_batch=24)


def read_nothing(shard: int):
    return iter(())


def test_a_reader_that_yields_nothing_is_an_error_naming_the_shard():
    stream = sharded_stream(["a.jsonl", "b.jsonl"], read_nothing, streams=2, global_batch=2)
    with pytest.raises(ValueError, match=r"read\('(a|b).jsonl'\) yielded no records: drop empty shards"):
        list(stream)


def read_unpicklable(shard: int):
    for _ in range(4):
        yield (lambda: shard), torch.zeros(1)


def test_an_unpicklable_record_fails_in_the_worker_instead_of_hanging():
    """A record a loader worker cannot send (a lambda in it) would be lost in the worker's queue, the loader
    waiting for it forever; it is an error naming the record and the fix."""
    stream = sharded_stream(list(range(4)), read_unpicklable, streams=2, global_batch=2, num_workers=2, collate_fn=list)
    with pytest.raises(TypeError, match=r"a batch of records cannot be pickled to the main process.*or use "
                                        r"num_workers=0"):
        list(stream)
    with pytest.raises(TypeError, match=r"read cannot be pickled to a loader worker.*top level of a module"):
        sharded_stream(list(range(4)), lambda shard: iter(()), streams=2, global_batch=2, num_workers=2)


def collate_counting(records: list) -> dict:
    """A collate_fn of the user's own, with a value per batch (a mixing weight, a count) beside the records'."""
    return {"id": torch.stack([ident for ident, _ in records]), "records": len(records)}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_of_the_users_own_gets_one_step_of_records_at_a_time(workers):
    """Loader workers send several steps at once; a collate_fn is still called on one step's records, and its
    batch reaches the loop as it made it: 6 records a step from each of 2 workers, joined, here 12."""
    stream = sharded_stream(list(range(SHARDS)), read_shard, streams=6, global_batch=12, num_workers=workers,
                            collate_fn=collate_counting)
    batches = list(stream)
    reference = [ident for ident, _ in sharded_stream(list(range(SHARDS)), read_shard, streams=6, global_batch=12)]
    assert len(batches) == len(reference) > 4
    for batch, ids in zip(batches, reference, strict=True):
        assert sorted(batch["id"].tolist()) == sorted(ids.tolist())
        assert batch["records"] == (12 if workers == 0 else [6, 6])


def read_jsonl(path: str, start: int = 0):
    """A JSON-lines shard's records from ``start``; each open is logged beside the shards (one line a call)."""
    with open(os.path.join(os.path.dirname(path), "opens.log"), "a") as log:
        log.write(f"{os.path.basename(path)} {start}\n")
    with open(path) as f:
        for line in itertools.islice(f, start, None):
            record = json.loads(line)
            yield torch.tensor(record["id"]), torch.tensor(record["x"], dtype=torch.float64)


def task_jsonl_epoch(spec: dict) -> dict:
    stream = sharded_stream(spec["paths"], read_jsonl, streams=12, global_batch=24, num_workers=2)
    ids = [distributed.all_gather(ident).flatten() for ident, _ in stream]
    return {"ids": ids, "left_out": stream.left_out, "steps": stream.steps}


def test_jsonl_files_on_disk_are_each_opened_once_and_every_record_trained_once(pools, tmp_path):
    """24 JSON-lines shards of 10 records written to disk, read at world 3 with 2 loader workers per rank: one epoch
    opens each file exactly once (in one process), trains each of the 240 records exactly once in 10 steps of 24,
    and leaves nothing out (equal shards)."""
    paths = []
    for shard in range(24):
        path = tmp_path / f"part-{shard:03}.jsonl"
        path.write_text("".join(json.dumps({"id": shard * 100 + i, "x": [shard, i]}) + "\n" for i in range(10)))
        paths.append(str(path))
    results = pools.run(3, task_jsonl_epoch, {"paths": paths}, timeout=90)
    opens = (tmp_path / "opens.log").read_text().split("\n")[:-1]
    assert sorted(opens) == sorted(f"part-{shard:03}.jsonl 0" for shard in range(24))
    ids = torch.cat(results[0]["ids"]).tolist()
    assert sorted(ids) == [shard * 100 + i for shard in range(24) for i in range(10)]
    assert all(r["steps"] == 10 and r["left_out"] == 0 for r in results)
