"""Streams under DDP: every rank runs the same number of steps, however unevenly its data runs out; and a sharded
stream whose every step trains the same records at any world size and resumes exactly. Copy it next to
distributed.py (optional).

    from sharded_stream import sharded_stream, stop_together

    for x, y in stop_together(loader):                  # training: all ranks stop at the first rank's end
        loss = F.cross_entropy(ddp(x), y); ...           # DDP's all-reduce, reduce(loss), SyncBatchNorm: safe

    for batch in stop_together(val_loader, until="last"):  # evaluation: every rank's every batch, once
        if batch is not None:                            # a rank that ran out gets None until all are done
            totals += metrics(model, batch)              # the plain module: no collective inside the loop
    totals = distributed.reduce(totals)

A rank whose stream (an IterableDataset's shard, a DataLoader over files) holds fewer batches than the others leaves
its loop first; the others then wait in DDP's all-reduce until the collective's timeout. torch's DDP join() shadows
only DDP's own collectives: not a ``reduce`` of the loss in the loop, nor SyncBatchNorm. stop_together asks every
rank how many batches it holds: it reads ``every`` batches ahead (16 by default) and asks once for them all, one
all-gather of one number per rank, since a collective of its own every step costs a visible share of a step
(bench/BENCHMARKS.md). The price: up to ``every`` batches held in memory ahead of the loop.

- ``until="first"`` (training): the loop ends on every rank at the first step some rank has no batch; the
  batches the other ranks still held are dropped, and the primary says once how many (each rank's count where its
  iterable has a length or ended, else at least those read ahead). Zero the gradients as an epoch begins: the last,
  cut accumulation group may have left some behind.
- ``until="last"`` (evaluation): every rank goes on until every rank is done; one that ran out receives None, so
  summed metrics count every sample exactly once. The loop's body must then run no collective of its own (a DDP
  forward can broadcast buffers: evaluate the plain module, as min_ddp does).

After the loop, ``.steps`` is the steps run, ``.dropped`` each rank's dropped batches (a list in rank order; -n
for "at least n", a stream without a length whose end was not reached; in evaluation all 0).

A sharded stream: your shards (paths, URLs, any picklable keys) and a function that reads one into records:

    def read(path, start=0):                             # `start`: optional; records before it are never decoded
        with open(path) as f:
            for line in itertools.islice(f, start, None):
                yield json.loads(line)

    train = sharded_stream(paths, read, streams=12, global_batch=96, transform=augment, num_workers=2)
    ckpt = Checkpointer("run.pt", model, optimizer, loader=train)  # resumes the stream mid-epoch, exactly
    for epoch in ckpt.epochs(10):                        # calls train.set_epoch(epoch): a new deal of the shards
        for batch in train:                              # this rank's global_batch / world records, collated
            ...; optimizer.step(); ckpt.step()

Each epoch deals the shards, by a permutation drawn from (seed, epoch), to ``streams`` canonical streams (shard i
of the permutation to stream i % streams); a stream reads its shards one after another. Step s of an epoch trains
records [s*b, (s+1)*b) of every stream, b = global_batch / streams: the same records whatever the number of ranks
and loader workers. Each rank's loader workers own whole streams (the world size times the workers, at least 1,
must divide ``streams``: another is refused, naming those that work), so no shard is read by two processes and
each record is read once an epoch. The epoch ends on every rank at the first step a stream cannot fill; the
records left out are counted and said (with shards of equal size, only the last, partial step's). ``transform``
runs on each record under torch's, Python's and (where imported) numpy's generators seeded from (seed, epoch, the
record's key: its shard's index in ``shards`` and its position there): an augmentation is then the same at any
world size, in any worker and after a resume. ``collate_fn`` (default_collate) gets one step's records of one
reader; with loader workers a step joins their batches: tensors concatenated, lists chained, any other value a
list of each worker's. A worker sends 4 steps at once (a tensor sent costs a connection of its own), so up to 8
steps a worker are in flight, beside the 16 the ranks' agreement reads ahead. Not a DataLoader: iterate it (a
pass read to its end sets the next epoch); ``set_epoch``, ``state_dict`` (a collective) and ``load_state_dict``
are what the Checkpointer calls. After an epoch, ``.steps`` is its steps and ``.left_out`` the records of the
step no stream could fill (what longer streams hold after it is not read).

It uses only distributed.py's public names and torch; distributed.py does not import it.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import pickle
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

import distributed

__all__ = ["stop_together", "StopTogether", "sharded_stream", "ShardedStream"]


def stop_together(batches: Iterable, until: str = "first", every: int = 16) -> StopTogether:
    """``batches`` stepped in lockstep with every rank's: see the module docstring. Call it on all ranks."""
    if until not in ("first", "last"):
        raise ValueError(f"stop_together: until must be 'first' (training: stop at the first rank's end) or 'last' "
                         f"(evaluation: go on, with None, until every rank is done), got: {until!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"stop_together: every must be an integer >= 1 (batches read ahead per question), got: "
                         f"{every!r}")
    return StopTogether(batches, until, every)


class StopTogether:
    """stop_together's loop: iterate it once, on every rank."""

    def __init__(self, batches: Iterable, until: str, every: int):
        self.batches, self.until, self.every = batches, until, every
        self.steps = 0
        self.dropped: list[int] = []
        self.quiet = False  # a sharded stream says what it left out itself

    def __iter__(self) -> Iterator[Any]:
        batches, window, pulled = iter(self.batches), [], 0
        while True:
            more = list(itertools.islice(batches, self.every - len(window)))
            window, pulled = window + more, pulled + len(more)
            held = distributed.all_gather(len(window)).tolist()  # the one collective of a window, on every rank
            run = min(held) if self.until == "first" else max(held)
            for i in range(run):
                self.steps += 1
                yield window[i] if i < len(window) else None
            ended = min(held) < self.every  # a rank's data ended within this window
            if ended and (self.until == "first" or max(held) < self.every):
                self._say_dropped(len(window) - min(run, len(window)), pulled, len(window) == self.every)
                return
            window = window[run:]

    def _say_dropped(self, unread: int, pulled: int, maybe_more: bool) -> None:
        """Every rank's count of batches left behind (a collective at the end only), said once by the primary."""
        if maybe_more:  # this rank's data had not ended: the rest, where it has a length
            try:
                unread += len(self.batches) - pulled
            except TypeError:  # a stream without a length: at least what was read ahead
                unread = -max(unread, 1)
        self.dropped = [int(n) for n in distributed.all_gather(unread).tolist()]
        if self.until == "first" and any(self.dropped) and not self.quiet:
            counts = ", ".join(f"rank {rank}: {f'at least {-n}' if n < 0 else n}" for rank, n in enumerate(self.dropped)
                               if n)
            distributed.print_primary(f"stop_together: a rank's data ran out after {self.steps} steps; every rank "
                                      f"stopped there, dropping the batches it still had ({counts})")


def sharded_stream(shards: Sequence, read: Callable[..., Iterable], *, streams: int, global_batch: int,
                   transform: Callable[[Any], Any] | None = None, num_workers: int = 0, seed: int = 0,
                   collate_fn: Callable[[list], Any] | None = None, every: int = 16) -> ShardedStream:
    """This rank's batches of a stream of ``shards``, each read by ``read(shard)`` (or ``read(shard, start=k)``,
    which skips k records without decoding them) into records: see the module docstring. Construct it on every
    rank, after init_process_group; every rank then iterates it, ``global_batch / world`` records a step."""
    for name, value, low in (("streams", streams, 1), ("global_batch", global_batch, 1),
                             ("num_workers", num_workers, 0), ("every", every, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"sharded_stream: {name} must be an integer >= {low}, got: {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"sharded_stream: seed must be an integer, got: {seed!r}")
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise TypeError(f"sharded_stream: shards must be a list of shards (paths or keys), got: {shards!r:.80}")
    if len(shards) < streams:
        raise ValueError(f"sharded_stream: {len(shards)} shard(s) for streams={streams}, and every stream needs one: "
                         f"use streams <= {len(shards)}, or split the data into at least {streams} shards")
    if global_batch % streams:
        below, above = global_batch // streams * streams, (global_batch // streams + 1) * streams
        raise ValueError(f"sharded_stream: global_batch={global_batch} does not split into streams={streams} "
                         f"streams' equal shares; use a multiple of {streams} ({below or above} or {above})")
    world, processes = distributed.get_world_size(), distributed.get_world_size() * max(num_workers, 1)
    if streams % processes:
        worlds = [w for w in range(1, streams + 1) if streams % (w * max(num_workers, 1)) == 0]
        workers = [k for k in range(1, streams + 1) if streams % (world * k) == 0]
        raise ValueError(f"sharded_stream: streams={streams} cannot be owned whole by {world} rank(s) x "
                         f"{max(num_workers, 1)} reader(s) each (num_workers={num_workers}): the product must divide "
                         f"{streams}. With num_workers={num_workers} the world sizes that work are "
                         f"{worlds or 'none'}; at world size {world}, num_workers in {[0, *workers]}")
    if num_workers:  # a worker receives them pickled (spawn, forkserver); a failure there would end the loader
        for name, value in (("shards", shards), ("read", read), ("transform", transform), ("collate_fn", collate_fn)):
            try:
                pickle.dumps(value)
            except Exception as e:
                raise TypeError(f"sharded_stream: {name} cannot be pickled to a loader worker ({e}); define "
                                "functions at the top level of a module (not a lambda or a nested function), or "
                                "use num_workers=0") from e
    source = _Source(list(shards), read, transform, collate_fn or default_collate, streams, global_batch // streams,
                     seed, "start" in _parameters(read))
    return ShardedStream(source, num_workers, every)


class ShardedStream:
    """sharded_stream's loader of this rank's batches (the module docstring says what it promises)."""

    def __init__(self, source: _Source, num_workers: int, every: int):
        self.source, self.num_workers, self.every = source, num_workers, every
        self.world, self.rank = distributed.get_world_size(), distributed.get_rank()
        self.batch_size = source.per_stream * source.streams // self.world  # what the Checkpointer reads
        self.epoch = 0
        self.steps = 0
        self.left_out = 0
        self.dropped: list[int] = []
        self._positions = [(0, 0)] * source.streams  # per stream: the (shard, record) its next step starts at
        self._resume: tuple[int, int] | None = None  # (epoch, steps) a loaded state starts at
        self._in_pass = False
        self._partial: tuple[int, int] | None = None  # (step, records read for it) where this rank's streams ended

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass reads (its deal of the shards). A pass read to its end sets the next itself."""
        if epoch != self.epoch:
            self._positions = [(0, 0)] * self.source.streams
            self._resume = None
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        source, epoch = self.source, self.epoch
        self.steps = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        if not self.steps:
            self._positions = [(0, 0)] * source.streams
        self._resume, self._in_pass = None, True
        reader = _Reader(source, epoch, list(self._positions), self.rank, self.world, self.num_workers)
        loader = DataLoader(reader, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                            generator=torch.Generator().manual_seed(source.seed))  # not the rank's generator
        loop = StopTogether(self._this_rank(loader), "first", self.every)
        loop.quiet = True
        for where, batch in loop:
            for stream, shard, record in where:
                self._positions[stream] = (shard, record)
            self.steps += 1
            yield batch
        self.dropped = loop.dropped  # full steps other ranks had read when one rank's streams ended
        # The records of the step no stream could fill: this rank's, whichever steps it had read ahead.
        ended_here = self._partial is not None and self._partial[0] == self.steps
        self.left_out = int(distributed.reduce(self._partial[1] if ended_here else self.batch_size))
        if self.left_out:
            distributed.print_primary(f"sharded_stream: epoch {epoch} ended after {self.steps} steps, when a stream "
                                      f"ran out: {self.left_out} records of the next, partial step were left out, "
                                      "and those the longer streams hold after it (none where the shards are equal)")
        self.epoch, self._in_pass = epoch + 1, False
        self._positions = [(0, 0)] * source.streams

    def _this_rank(self, loader: DataLoader) -> Iterator[tuple[list, Any]]:
        """This rank's steps: a piece of several steps from each loader worker (the DataLoader yields them in turn),
        joined step by step."""
        self._partial = None
        pieces, step = iter(loader), self.steps  # a resumed pass counts on from where it starts
        while True:
            try:
                got = [next(pieces) for _ in range(max(self.num_workers, 1))]
            except Exception as error:  # the worker's traceback is in its message; the loader's frames would keep
                del pieces  # the workers alive for as long as the error is kept: they stop now
                raise error.with_traceback(None)  # noqa: B904 (the same error, not another)
            full = min(len(piece.where) for piece in got)
            for i in range(full):
                yield [row for piece in got for row in piece.where[i]], _joined([piece.step(i) for piece in got])
            step += full
            if any(piece.end is not None for piece in got):
                self._partial = (step, sum(piece.size if len(piece.where) > full else piece.end for piece in got))
                return

    def state_dict(self) -> dict[str, Any]:
        """Where every stream is, after the last batch the loop took: a collective (every rank's streams)."""
        mine = torch.full((self.source.streams, 2), -1, dtype=torch.int64)  # -1: another rank's stream
        owned = _owned(self.source.streams, self.rank, self.world, self.num_workers)
        mine[owned] = torch.tensor([self._positions[j] for j in owned], dtype=torch.int64)
        positions = distributed.all_gather(mine).amax(0)
        return {"epoch": self.epoch, "steps": self.steps if self._in_pass else 0, "positions": positions,
                **self._defining()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass of ``state["epoch"]`` (set_epoch keeps it) starts where the saved stream stood."""
        for key, value in self._defining().items():
            if state[key] != value:
                raise ValueError(f"sharded_stream: the saved stream has {key}={state[key]} and this one {key}={value}:"
                                 f" the same steps need the same {key}; pass {key}={state[key]}")
        self.epoch, self._resume = int(state["epoch"]), (int(state["epoch"]), int(state["steps"]))
        self._positions = [tuple(row) for row in state["positions"].tolist()]

    def _defining(self) -> dict[str, int]:
        """What fixes the records of every step: a saved stream resumes only into one with the same."""
        return {"streams": self.source.streams, "global_batch": self.source.per_stream * self.source.streams,
                "shards": len(self.source.shards), "seed": self.source.seed}


class _Source(NamedTuple):
    shards: list
    read: Callable[..., Iterable]
    transform: Callable[[Any], Any] | None
    collate: Callable[[list], Any]
    streams: int
    per_stream: int  # records a stream gives each step
    seed: int
    skips: bool  # read(shard, start=k) skips k records itself


class _Piece(NamedTuple):
    """Up to _STEPS_PER_PIECE steps of one reader's streams, sent at once: a tensor crosses from a loader worker by
    a connection of its own, and one a step per worker would cost more than reading the records."""
    where: list[list[tuple[int, int, int]]]  # per step: (stream, shard, record) next, for each stream
    batch: Any  # the steps' collated batches, joined into one where their shapes allow it, else a list of them
    joined: bool
    size: int  # records a step
    end: int | None  # the records read for the step the streams could not fill; None: not the last piece

    def step(self, i: int) -> Any:
        return _split(self.batch, self.size, i) if self.joined else self.batch[i]


_STEPS_PER_PIECE = 4


class _Reader(IterableDataset):
    """The streams of one loader worker (or of the rank, without workers), a piece of every step at a time."""

    def __init__(self, source: _Source, epoch: int, positions: list, rank: int, world: int, workers: int):
        self.source, self.epoch, self.positions = source, epoch, positions
        self.rank, self.world, self.workers = rank, world, workers

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        owned = _owned(self.source.streams, self.rank, self.world, self.workers, info.id if info else 0)
        deal = torch.randperm(len(self.source.shards), generator=torch.Generator().manual_seed(
            self.source.seed + self.epoch)).tolist()
        records = [self._records(deal[j::self.source.streams], *self.positions[j]) for j in owned]
        checked = info is None  # a worker's first piece is pickled here: a failure in its queue would hang
        size, end = self.source.per_stream * len(owned), None
        while end is None:
            where, batches = [], []
            while len(where) < _STEPS_PER_PIECE:
                with _generators_kept(info is None and self.source.transform is not None):
                    rows = [list(itertools.islice(stream, self.source.per_stream)) for stream in records]
                if any(len(row) < self.source.per_stream for row in rows):
                    end = sum(map(len, rows))
                    break
                where.append([(j, *row[-1][1]) for j, row in zip(owned, rows, strict=True)])
                batches.append(self.source.collate([record for row in rows for record, _ in row]))
            joined = bool(batches) and all(_sized(batch, size) for batch in batches)
            piece = _Piece(where, _joined(batches) if joined else batches, joined, size, end)
            if not checked:
                _check_picklable(piece, records)
                checked = True
            yield piece

    def _records(self, shards: list[int], first: int, start: int) -> Iterator[tuple[Any, tuple[int, int]]]:
        """A stream's records from (shard ``first``, record ``start``), each with the position of the next one."""
        held = None
        for k in range(first, len(shards)):
            at = start if k == first else 0
            index = shards[k]
            if self.source.skips:
                opened = self.source.read(self.source.shards[index], start=at)
            else:
                opened = itertools.islice(self.source.read(self.source.shards[index]), at, None)
            for record in opened:
                if held is not None:
                    yield held, (k, at)
                held = self._transformed(record, index, at)
                at += 1
            if at == 0:
                raise ValueError(f"sharded_stream: read({self.source.shards[index]!r}) yielded no records: drop "
                                 "empty shards from the list (a shard holds at least one record)")
        if held is not None:
            yield held, (len(shards), 0)

    def _transformed(self, record: Any, shard: int, position: int) -> Any:
        if self.source.transform is None:
            return record
        # blake2b: a 63-bit seed from the record's key, the same in every process (unlike hash()).
        key = f"{self.source.seed}/{self.epoch}/{shard}/{position}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if (numpy := sys.modules.get("numpy")) is not None:
            numpy.random.seed(seed & 0xFFFFFFFF)
        return self.source.transform(record)


def _owned(streams: int, rank: int, world: int, workers: int, worker: int | None = None) -> list[int]:
    """The streams a rank (or one of its loader workers) reads: stream j goes to reader j % (world x workers)."""
    readers = max(workers, 1)
    mine = range(rank * readers, (rank + 1) * readers) if worker is None else (rank * readers + worker,)
    return [j for j in range(streams) if j % (world * readers) in mine]


@contextlib.contextmanager
def _generators_kept(keep: bool) -> Iterator[None]:
    """In the rank's own process, its generators as they were once a step's records are read: the loop's draws
    (dropout) go on as if no record had been transformed."""
    if not keep:
        yield
        return
    numpy = sys.modules.get("numpy")
    states = torch.default_generator.get_state(), random.getstate(), numpy.random.get_state() if numpy else None
    try:
        yield
    finally:
        torch.default_generator.set_state(states[0])
        random.setstate(states[1])
        if numpy is not None:
            numpy.random.set_state(states[2])


def _check_picklable(piece: _Piece, records: list) -> None:
    try:
        pickle.dumps(piece)
    except Exception as e:
        raise TypeError(f"sharded_stream: a batch of records cannot be pickled to the main process ({e}): "
                        f"{piece.batch!r:.120}; have read (or transform, collate_fn) return tensors, numbers, "
                        "strings and containers of them, or use num_workers=0") from None


def _joined(parts: list[Any]) -> Any:
    """Collated batches of the loader workers joined into one, as collating all their records at once would."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return type(first)({key: _joined([part[key] for part in parts]) for key in first})
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (torch.Tensor, dict, list, tuple)):
        fields = [_joined(list(field)) for field in zip(*parts, strict=True)]
        return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)
    if isinstance(first, list):  # a collated list of strings or numbers
        return list(itertools.chain.from_iterable(parts))
    return list(parts)  # a value per batch (a count, a mixing weight): each reader's


def _sized(batch: Any, size: int) -> bool:
    """Whether every tensor and list in a collated batch holds one entry per record: steps then join and split."""
    if isinstance(batch, dict):
        return all(_sized(value, size) for value in batch.values())
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, dict, list, tuple)):
        return all(_sized(field, size) for field in batch)
    if isinstance(batch, torch.Tensor):
        return batch.dim() > 0 and len(batch) == size
    return isinstance(batch, list) and len(batch) == size


def _split(batch: Any, size: int, i: int) -> Any:
    """Step ``i`` of steps joined by _joined, each ``size`` records (views: nothing is copied)."""
    if isinstance(batch, dict):
        return type(batch)({key: _split(value, size, i) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, dict, list, tuple)):
        fields = [_split(field, size, i) for field in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    return batch[i * size:(i + 1) * size]


def _parameters(function: Callable) -> Any:
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}


def _as_is(piece: Any) -> Any:
    return piece
