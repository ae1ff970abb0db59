"""Which rank holds the others back, and whether by its data or its compute: copy it next to distributed.py
(optional; it uses only distributed.py's public names and torch).

    from slow_rank import SlowRank

    ddp = DDP(model)
    watch = SlowRank(ddp)                  # every rank, right after DDP(), before any comm hook is registered
    for x, y in watch.batches(loader):     # instead of `for x, y in loader:`
        ...                                # forward, backward, step: unchanged

Every window of steps the primary prints one line (a dict of the same is ``watch.last``, the last 100 of them
``watch.verdicts``):

    [slow rank] steps 2-11, step 41.3 ms: rank 2 (node03) is late by 30.4 ms a step (74%), its compute +30.1 ms
    [slow rank] steps 12-1461, step 41.0 ms: balanced (the latest rank is 0.3 ms behind, 1% of a step)

What each rank measures, per step (durations on its own clock; no clock is compared across hosts):
- data: the time it waited for the next batch (the loader's ``next()``);
- wait: from its gradients ready to the all-reduce done (DDP's hook called for the last bucket, to the last
  bucket reduced), plus any wait inside DDP's forward (its buffer broadcast): the time it waits for the others;
- rest: from the all-reduce done to asking for the next batch (the optimizer, logging, evaluation, snapshots);
- compute: what is left of the step: from the batch in hand to its gradients ready (the forward, the backward, what
  the loop does to the batch before them: augmentation, mixup, the copy to the device).
On GPUs the wait is the device's time (CUDA events, read once a window: no synchronization per step), and compute
what the step's time leaves of it. The dict: ``steps`` (first, last), ``step_s`` (the median step), ``late_rank``
(None: balanced), ``host``, ``late_by_s``, ``cause`` ("data", "compute" or "rest"), ``excess_s`` (per phase, the
late rank's mean minus the others' median), ``persistent``, ``per_rank`` (each rank's means per step), ``line``.

How the late rank is found: every rank's step takes as long as the slowest's, because each waits for the others
in the all-reduce, so no step time and no backward time can tell (the all-reduce evens them out). The rank that
arrives last waits least. Per window, each rank's mean wait per step is gathered (one small all_gather); the rank
that waited least is late by the others' median wait minus its own. It is named when that is at least
``threshold`` (10%) of the median step, 1 ms, and 3 standard errors of the mean waits (a rank late at a single
step, by a hiccup of the scheduler, is not a straggler; one late at one step in four is), with the phase
(data, compute or rest) in which it spent the most more than the others' median; a rank named in more than half
of the last 10 windows (3 at least) is "persistent". Means, not medians: the steps in which it was late count.

The comm hook: SlowRank registers one that wraps what runs in the all-reduce: DDP's default, or any hook
registered after it (``shared_memory_allreduce(ddp)``, ``ddp.register_comm_hook(state, hook)``), which it calls
unchanged. Gradients, hence training, are bitwise what they are without it. With accumulation under
``no_sync()``, a step is the backward that all-reduces (its micro-batches' time is data and compute). A window is
``every`` steps if given, else about ``seconds`` (60) of steps, the first 10 steps after the first (which DDP
spends setting up). Under launch(), a collective that times out shows the last window's line in its report.
"""
from __future__ import annotations

import collections
import socket
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

import distributed

__all__ = ["SlowRank"]

_PHASES = ("data", "compute", "wait", "rest")
_FIRST_WINDOW = 10  # steps: a first line soon; the later windows last about `seconds`
_RECENT = 10  # windows: "persistent" is late in most of them (a straggler of an hour ago is not one now)
_KEPT = 100  # verdicts kept for a logger: a week-long job keeps no week of them
# Below a millisecond a rank's lateness is the size of a busy host's jitter (a thread's wake-up, a page fault), and
# no straggler worth chasing: not named, however short the step.
_FLOOR_S = 0.001
# In standard errors of the mean waits: a rank late by one hiccup in a window is 1; 3 ranks' jitter on 2 busy cores
# reached 2.4; a rank late at 1 step in 4 is 0.58 x sqrt(steps): 4.6 over 64 steps, tens over a minute's.
_SIGNIFICANT = 3.0


class _Mark(NamedTuple):
    """A moment on this rank: the host's clock, and on a GPU the device's (an event in the current stream)."""
    host: float
    device: torch.cuda.Event | None

    def until(self, later: _Mark) -> float:
        """Seconds from this mark to ``later``: the device's time where both have an event (read at a window's
        end, once the last event completed), else the host's."""
        if self.device is not None and later.device is not None:
            return self.device.elapsed_time(later.device) / 1000
        return later.host - self.host


class SlowRank:
    """Time each step's phases on every rank; every window, name the rank the others wait for (on the primary:
    a printed line, ``last`` and ``verdicts``). Create it on every rank right after ``DDP(model)``, before any
    comm hook; iterate ``batches(loader)``. In a world of one, or with ``enabled=False``, it does nothing."""

    def __init__(self, model: torch.nn.Module, *, every: int | None = None, seconds: float = 60.0,
                 threshold: float = 0.1, enabled: bool = True, quiet: bool = False):
        for name, value in (("seconds", seconds), ("threshold", threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SlowRank: {name} must be a positive number, got: {value!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"SlowRank: every must be a number of steps >= 1 (or None: about `seconds` of steps), "
                             f"got: {every!r}")
        self.enabled = enabled and distributed.get_world_size() > 1
        if self.enabled and not isinstance(model, DistributedDataParallel):
            raise TypeError(f"SlowRank: expected the DistributedDataParallel model, got: {type(model).__name__}; "
                            "pass the DDP(model) the loop trains")
        self.every, self.seconds, self.threshold, self.quiet = every, float(seconds), float(threshold), quiet
        self.verdicts: collections.deque[dict[str, Any]] = collections.deque(maxlen=_KEPT)
        self._window = every or _FIRST_WINDOW
        self._steps = 0  # all-reducing steps seen, the first (DDP's setup) included
        self._first_step = 2  # the first step of the current window
        self._hosts: list[str] = []
        self._named: collections.deque[int | None] = collections.deque(maxlen=_RECENT)  # the late rank of each
        self._clear_window()
        self._clear_step()
        if not self.enabled:
            return
        self._cuda = next(model.parameters()).is_cuda
        self._inner = (model.process_group, _ddp_mean)
        try:
            model.register_comm_hook(self, _timed_hook)
        except RuntimeError as e:
            raise RuntimeError("SlowRank: this DDP model already has a comm hook, and DDP takes one; create "
                               "SlowRank(ddp) right after DDP(model), before registering one (shared_memory_"
                               "allreduce(ddp), ddp.register_comm_hook): it runs the hook registered after it") from e
        model.register_comm_hook = self._register_inner  # a later registration becomes the hook it wraps
        model.register_forward_pre_hook(self._ddp_forward)
        model.module.register_forward_pre_hook(self._module_forward)

    @property
    def last(self) -> dict[str, Any] | None:
        """The last window's verdict (the same dict on every rank), or None before the first."""
        return self.verdicts[-1] if self.verdicts else None

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """The loader's batches, each timed; a window's end gathers every rank's times (a collective: every rank
        iterates, as it does the loader itself)."""
        if not self.enabled:
            yield from loader
            return
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            if self._ready is not None:  # an all-reducing step ended here
                self._end_step(asked)
                if self._steps >= self._first_step - 1 + self._window:
                    self._end_window()
                    asked = self._step_started = time.perf_counter()  # the gather is no step's
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._window_times["data"] += time.perf_counter() - asked
            yield batch

    # ---- what the hooks record
    def _mark(self) -> _Mark:
        event = None
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return _Mark(time.perf_counter(), event)

    def _register_inner(self, state: Any, hook: Any) -> None:
        """``ddp.register_comm_hook`` once SlowRank holds DDP's one hook: the hook it runs from now on."""
        if self._inner[1] is not _ddp_mean:
            raise RuntimeError("register_comm_hook can only be called once (DDP takes one comm hook; SlowRank "
                               f"runs {self._inner[1].__name__})")
        self._inner = (state, hook)

    def _ddp_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._forward_started = self._mark()

    def _module_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The module's forward inside DDP's: DDP's own wait (its buffer broadcast) lay between the two."""
        if self._forward_started is not None:  # not a call of the module alone (an evaluation)
            self._step_spans.append((self._forward_started, self._mark()))
            self._forward_started = None

    def _ready_then_done(self, bucket: torch_dist.GradBucket) -> torch.futures.Future:
        self._ready = self._mark()  # the last bucket's call is the one that counts
        state, hook = self._inner
        return hook(state, bucket).then(self._done)

    def _done(self, reduced: torch.futures.Future) -> Any:
        self._dones.append(self._mark())  # on communication threads, maybe several: list.append is atomic
        return reduced.value()

    # ---- a step, a window
    def _clear_step(self) -> None:
        self._ready: _Mark | None = None  # DDP's hook called for the step's last bucket so far
        self._dones: list[_Mark] = []  # each bucket reduced, in the order they completed
        self._forward_started: _Mark | None = None
        self._step_spans: list[tuple[_Mark, _Mark]] = []  # spans of waiting inside DDP's forward

    def _clear_window(self) -> None:
        self._window_times = dict.fromkeys(_PHASES, 0.0)  # seconds, on the host's clock
        self._waits: list[list[tuple[_Mark, _Mark]]] = []  # per step, its spans of waiting: read at the window's end
        self._step_times: list[float] = []
        self._step_started: float | None = None

    def _end_step(self, now: float) -> None:
        """An all-reducing step ended at ``now`` (the next batch asked for)."""
        self._steps += 1
        if self._steps < self._first_step:  # DDP's setup: not measured
            self._window_times = dict.fromkeys(_PHASES, 0.0)
        else:
            self._step_times.append(now - self._step_started)
            self._waits.append([*self._step_spans, (self._ready, self._dones[-1])])
            self._window_times["rest"] += now - self._dones[-1].host
        self._step_started = now
        self._clear_step()

    def _end_window(self) -> None:
        """Gather every rank's means per step (one all_gather) and decide: the same verdict on every rank."""
        if self._cuda:
            torch.cuda.synchronize()  # once a window: every event recorded in it has completed
        times = self._window_times
        waits = [sum(start.until(end) for start, end in spans) for spans in self._waits]
        times["wait"] = sum(waits)
        times["compute"] = sum(self._step_times) - times["data"] - times["wait"] - times["rest"]
        steps = len(self._step_times)
        step = statistics.median(self._step_times)
        spread = statistics.stdev(waits) / steps ** 0.5 if steps > 1 else 0.0  # the standard error of the mean wait
        mine = torch.tensor([steps, step, *(times[phase] / steps for phase in _PHASES), spread], dtype=torch.float64)
        if not self._hosts:
            self._hosts = _host_names()
        verdict = self._verdict(distributed.all_gather(mine).tolist())
        self.verdicts.append(verdict)
        # For launch()'s hang report, on every rank: work on the primary alone would make it late at the next step.
        distributed.report_progress(verdict["line"], kind="window")
        if distributed.is_primary() and not self.quiet:
            print(verdict["line"], flush=True)
        if self.every is None:
            self._window = max(round(self.seconds / max(verdict["step_s"], 1e-6)), 1)
        self._first_step = self._steps + 1
        self._clear_window()

    def _verdict(self, ranks: list[list[float]]) -> dict[str, Any]:
        """The window's verdict from every rank's [steps, median step, mean data, compute, wait, rest, the mean
        wait's standard error]."""
        step = statistics.median(rank[1] for rank in ranks)
        per_rank = [dict(zip(_PHASES, rank[2:6], strict=True)) for rank in ranks]
        waits = [times["wait"] for times in per_rank]
        late = min(range(len(ranks)), key=waits.__getitem__)
        others = [r for r in range(len(ranks)) if r != late]
        late_by = statistics.median(waits[r] for r in others) - waits[late]
        excess = {phase: per_rank[late][phase] - statistics.median(per_rank[r][phase] for r in others)
                  for phase in ("data", "compute", "rest")}
        cause = max(excess, key=excess.__getitem__)
        # A rank late at one step of the window (a hiccup: the scheduler, a page fault) is as late, on average, as
        # one late at every step by a little: named only when the steps' spread cannot explain it.
        noise = (ranks[late][6] ** 2 + statistics.median(ranks[r][6] for r in others) ** 2) ** 0.5
        named = late_by >= max(self.threshold * step, _FLOOR_S, _SIGNIFICANT * noise)
        self._named.append(late if named else None)
        times_named, windows = self._named.count(late), len(self._named)
        persistent = named and windows >= 3 and times_named > windows / 2
        first, last = self._first_step, self._steps
        head = f"[slow rank] steps {first}-{last}, step {step * 1000:.1f} ms: "
        if named:
            line = (f"{head}rank {late} ({self._hosts[late]}) is late by {late_by * 1000:.1f} ms a step "
                    f"({late_by / step:.0%}), its {cause} +{excess[cause] * 1000:.1f} ms")
            if persistent:
                line += f"; persistent: late in {times_named} of the last {windows} windows"
        else:
            line = (f"{head}balanced (the latest rank is {max(late_by, 0) * 1000:.1f} ms behind, "
                    f"{max(late_by, 0) / max(step, 1e-9):.0%} of a step)")
        return {"steps": (first, last), "step_s": step, "late_rank": late if named else None,
                "host": self._hosts[late] if named else None, "late_by_s": late_by, "cause": cause if named else None,
                "excess_s": excess, "noise_s": noise, "persistent": persistent, "per_rank": per_rank, "line": line}


def _timed_hook(state, bucket):  # no annotations: DDP checks them, and ours would be strings
    return state._ready_then_done(bucket)


def _host_names() -> list[str]:
    """Every rank's host name, from one all_gather of 256 bytes a rank (torch's all_gather_object needs numpy)."""
    name = socket.gethostname().encode()[:255].ljust(256, b"\0")
    gathered = distributed.all_gather(torch.tensor(list(name), dtype=torch.uint8))
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in gathered]


def _ddp_mean(group, bucket):
    """DDP's built-in all-reduce, bitwise: each rank's gradients times 1/world (as its reducer scales them: a
    division differs in the last bit), summed over the ranks."""
    reduced = torch_dist.all_reduce(bucket.buffer().mul_(1 / group.size()), group=group, async_op=True)
    return reduced.get_future().then(lambda fut: fut.value()[0])
