"""Streams under DDP: every rank runs the same number of steps, however unevenly its data runs out. Copy it next to
distributed.py (optional).

    from sharded_stream import stop_together

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
for "at least n", a stream without a length whose end was not reached; in evaluation all 0). It uses only
distributed.py's public names and torch; distributed.py does not import it.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import distributed

__all__ = ["stop_together", "StopTogether"]


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
        if self.until == "first" and any(self.dropped):
            counts = ", ".join(f"rank {rank}: {f'at least {-n}' if n < 0 else n}" for rank, n in enumerate(self.dropped)
                               if n)
            distributed.print_primary(f"stop_together: a rank's data ran out after {self.steps} steps; every rank "
                                      f"stopped there, dropping the batches it still had ({counts})")
