"""Exact resume and clean stops for a loop of your own: copy it next to distributed.py (optional).

    from checkpointer import Checkpointer

    ckpt = Checkpointer("run.pt", model, optimizer, loader=loader, settings={"lr": lr})
    for epoch in ckpt.epochs(10):           # from the snapshot's epoch, mid-epoch where it stopped
        for x, y in loader:
            ...; optimizer.step()
            ckpt.step()                     # a snapshot when due; on a stop signal, save and exit

A job stopped by SIGTERM, SIGUSR1 or SIGUSR2 (SLURM's time limit, scancel, preemption, torchrun's agent) saves
on every rank at the same step and exits 128 + the signal; the same command then resumes it as if never stopped.
distributed.py's launcher forwards those signals and takes that exit as a stop, not a failure; without this file
the signals simply end the job. It uses only distributed.py's public names and torch.

An iteration loop (nanoGPT's shape) passes ``batch_size`` and keeps its own counters in ``state``:

    state = {"best_val_loss": 1e9, "scheduler": scheduler}  # restored in place; no epochs, no sampler
    ckpt = Checkpointer("ckpt.pt", model, optimizer, batch_size=batch_size, state=state)
    for iter_num in ckpt.iterations(max_iters):  # from the snapshot's step; saves after the last
        ...; optimizer.step(); scheduler.step()
        ckpt.step()                     # the iteration's last statement

What is exact. Bitwise as if never stopped, at the same number of processes: every generator the loop draws
from in the ranks (torch's CPU and CUDA generators: dropout, augmentation with num_workers=0; Python's random and
numpy's global generator, where the process imported numpy: a mixup's np.random.beta; a torch.Generator in
``state``), with accumulation; with loader workers, when the dataset is seeded_dataset's (seeded_dataset.py). On
GPUs also only with deterministic kernels. From 3 processes on, also only where the gradient sum does not depend
on DDP's bucket layout, which a resumed DDP's first step changes (shared_memory_allreduce, or
find_unused_parameters=True); on plain gloo or NCCL that step rounds differently and the run goes on within
rounding. At another number of processes: the same samples in every step, within float rounding; a rank the
snapshot had keeps its generators, a new rank gets its own, so dropout cannot match, nor plain BatchNorm's
statistics (sync_batchnorm.py keeps them). Training meters restart at a mid-epoch resume unless their sums live in
``state`` (as min_ddp keeps them). A mid-epoch resume starts the loader's sampler after the samples done:
data_sampler's, or any sampler whose order depends only on set_epoch (torch's DistributedSampler, a
repeated-augmentation sampler); a sampler that draws a new order at every pass is refused at construction. A loader
with ``set_epoch``, ``state_dict`` and ``load_state_dict`` keeps its own position: sharded_stream.py's stream is
saved at every snapshot (each rank's state; at another world size rank 0's) and starts where it stood.

While the primary writes, the other ranks wait in a collective: a save longer than init_process_group's
``timeout`` (5 minutes by default) ends them; pass a ``timeout=`` above your longest save. A resume maps the
snapshot (load_checkpoint), so the ranks of a node share its pages. Messages give the position as counts of work
done: "stopped by SIGUSR1 after 1 epoch and 3 steps" is ``epoch == 1`` and ``epoch_steps == 3``.

On a cluster, ask for the time limit's warning and a requeue, and signal the launcher, not a rank (torchrun's
agent forwards USR1/USR2 only with --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2, which
came in torch 2.10: with older torch, start the ranks with srun itself, as below):

    #!/bin/bash
    #SBATCH --ntasks=2 --time=04:00:00
    #SBATCH --signal=USR1@90      # to the srun step (not B:, the batch shell), up to 60 s early: keep --time above
    #SBATCH --requeue             # the primary asks for a requeue after saving; the rerun resumes
    srun --kill-on-bad-exit=1 python train.py --snapshot run.pt
"""
from __future__ import annotations

import hashlib
import inspect
import io
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Any
from collections.abc import Iterator

import torch
import torch.distributed as dist

import distributed
from distributed import REQUEUE_EXIT, STOP_SIGNALS

__all__ = ["Checkpointer", "Stopped", "handle_stop_signals", "stop_requested", "requeue"]


class Checkpointer:
    """Exact resume and clean stops for your own loop (the module docstring gives both loop shapes and the rules).

    Construct it on every rank after init_process_group, once the model is on its device and the optimizer and any
    LR scheduler exist, and before DDP wraps the model (DDP broadcasts rank 0's weights: the restored ones). If
    ``path`` exists every rank loads it (weights_only), and all must find the same snapshot; one whose ``settings``
    (what defines the run: seed, learning rate...) differ is refused, naming each difference. It restores the
    model, the optimizer, every rank's generators, the position and ``state`` (numbers, tensors, dicts and lists
    of them, objects with ``state_dict()``/``load_state_dict()``: an LR scheduler, a GradScaler; each rank its own,
    at another world size rank 0's), gives a loader without a ``generator`` one of its own, and calls
    ``handle_stop_signals()``.

    ``epochs(n)`` and ``iterations(n)`` snapshot at every epoch's end and after the last step. ``step()``, after
    every optimizer step on every rank: a snapshot every ``save_every`` steps of the run and every
    ``save_interval`` seconds (0: none), so that a hard kill loses at most that much work; about once a second (or
    every ``check_every`` steps) one all-reduce asks whether any rank got a stop signal: then every rank saves this
    step, the primary requeues the job (under SLURM, for USR1/USR2, after progress, at most ``max_requeues``
    times) and every rank raises Stopped. ``batch_size`` (the loader's for an epoch loop) x ``grad_accum`` x
    processes, the global batch, is in the snapshot: a resume mid-epoch keeps it.

    Attributes: ``epoch`` (the epoch in progress, from 0), ``steps`` (optimizer steps in the whole run) and
    ``epoch_steps`` (in this epoch so far). A per-step cadence of your own (an EMA every k steps) counts ``steps``,
    not ``enumerate(loader)``, which restarts at 0 after a mid-epoch resume. A number in ``state`` is restored into
    the dict, not into your variable: read it back after construction and write it before each save.
    """

    def __init__(self, path: str | os.PathLike | None, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, loader: Any = None, batch_size: int | None = None,
                 grad_accum: int = 1, settings: dict | None = None, state: dict | None = None, save_every: int = 0,
                 save_interval: float = 1800.0, check_every: int | None = None, max_requeues: int = 20):
        self.path = os.fspath(path) if path else None
        self.model = distributed.unwrap(model)
        self.optimizer = optimizer
        self.loader = loader
        self.settings = dict(settings or {})
        self.state = {} if state is None else state
        self.save_every = save_every
        self.save_interval = save_interval
        self.check_every = check_every
        self.max_requeues = max_requeues
        self.epoch = 0
        self.steps = 0
        self.epoch_steps = 0
        batch_size = _checked_arguments(path, loader, batch_size, grad_accum, save_every, save_interval,
                                        check_every, max_requeues)
        self._per_step = (batch_size or 0) * grad_accum  # samples a rank reads per optimizer step
        # A snapshot holds both: refuse what it could not read back now, not at the first save hours later.
        distributed.check_weights_only(self.settings, "Checkpointer: settings")
        distributed.check_weights_only(_state_dicts(self.state), "Checkpointer: state")
        sampler = _loader_sampler(loader)  # a mid-epoch snapshot must be one the same command resumes
        self._skips = bool(self._per_step) and sampler is not None and _resumable(sampler, bool(self.path))
        # iter(loader) draws the workers' base seed from loader.generator, else from the global generator: a
        # resume that starts an epoch's iterator mid-epoch would shift every later draw (dropout, augmentation).
        if loader is not None and getattr(loader, "generator", False) is None:
            loader.generator = torch.Generator()
            loader.generator.manual_seed(int(torch.randint(2**62, ())))
        self._loader_rng = self._loader_generator_state()  # as the epoch in progress began
        saved = _agreed_snapshot(self.path)
        if saved is not None:
            self._restore(saved)
        self._resumed_at = self.steps
        self._next_check = self.steps + (check_every or 1)  # unless given, the first check times one step
        self._checked_step = self.steps
        self._checked_at = self._saved_at = time.monotonic()
        handle_stop_signals()

    def epochs(self, epochs: int) -> Iterator[int]:
        """The epochs left to train. For each, it calls the loader's ``sampler.set_epoch`` (a new shuffle) and, when
        the snapshot stopped mid-epoch, starts the sampler's order after the samples already done (their indices
        are skipped, nothing is loaded); then, at its end, saves."""
        sampler = _loader_sampler(self.loader)
        for epoch in range(self.epoch, epochs):
            self.epoch = epoch
            done = self.epoch_steps * self._per_step
            if self._skips:  # data_sampler's refuses a skip past this rank's share: an epoch's short last step
                sampler.set_epoch(self.epoch, skip=min(done, getattr(sampler, "num_samples", done)))
            elif _stateful(self.loader):  # it restored its own position (a sharded stream's)
                self.loader.set_epoch(self.epoch)
            elif self.epoch_steps:  # else the rest of the epoch would silently start over
                raise ValueError("Checkpointer: the snapshot stopped mid-epoch, and only a loader with a sampler and "
                                 "a batch size can start there, e.g. loader=DataLoader(data, batch_size=..., "
                                 "sampler=distributed.data_sampler(...)) (got: "
                                 f"loader={type(self.loader).__name__}, sampler={type(sampler).__name__}, "
                                 f"batch_size={getattr(self.loader, 'batch_size', None)})")
            elif hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            if hasattr(getattr(self.loader, "dataset", None), "set_epoch"):  # seeded_dataset's, whatever sampler
                self.loader.dataset.set_epoch(self.epoch)
            if self.epoch_steps and self._loader_rng is not None:  # its iterator draws as when the epoch began
                self.loader.generator.set_state(self._loader_rng)
            self._loader_rng = self._loader_generator_state()
            yield self.epoch
            self.epoch += 1
            self.epoch_steps = 0
            if self.path:
                self.save()

    def iterations(self, iterations: int) -> Iterator[int]:
        """The optimizer steps left to train, ``steps`` for each; after the last, a snapshot, so that the same
        command run again finds the run finished. Call ``step()`` at the end of every iteration."""
        while self.steps < iterations:
            before = self.steps
            yield self.steps
            if self.steps != before + 1:
                raise RuntimeError(f"Checkpointer.iterations: call ckpt.step() once at the end of every iteration "
                                   f"(after the optimizer step); steps went from {before} to {self.steps}")
        if self.path:
            self.save()

    def step(self) -> None:
        """After every optimizer step, on all ranks: snapshots, and a stop when any rank got a signal."""
        self.steps += 1
        self.epoch_steps += 1
        if self.path and self.save_every and self.steps % self.save_every == 0:
            self.save()
        if self.steps < self._next_check:
            return
        signum, save_due = self._check()
        if signum:
            self._stop(signum)
        elif save_due:
            self.save()

    def _check(self) -> tuple[signal.Signals | None, bool]:
        """One all-reduce, on all ranks: the stop signal any rank got, whether a timed save is due, and the
        slowest rank's time since the last check, from which every rank computes the same next check."""
        now = time.monotonic()
        due = bool(self.path and self.save_interval and now - self._saved_at >= self.save_interval)
        signum, (save_due, slowest) = _agree(due, now - self._checked_at)
        if self.check_every:
            self._next_check = self.steps + self.check_every
        else:  # about _CHECK_S apart, whether a step takes a millisecond or a minute
            per_step = max(slowest, 1e-9) / (self.steps - self._checked_step)
            self._next_check = self.steps + max(1, min(int(_CHECK_S / per_step), 100_000))
        self._checked_at = now
        self._checked_step = self.steps
        return signum, bool(save_due)

    def save(self) -> None:
        """Write the snapshot now (atomically); must be called on all ranks."""
        if not self.path:
            raise ValueError("Checkpointer.save: this Checkpointer has no snapshot path (path=None); give it one")
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state()
        loader_state = self.loader.state_dict() if _stateful(self.loader) else None  # a collective, maybe
        ranks = _gather_to_primary({"rng": torch.get_rng_state(), "cuda_rng": cuda, "loader_rng": self._loader_rng,
                                    **_host_generators(), "state": _state_dicts(self.state),
                                    "loader_state": loader_state})
        self._saved_at = time.monotonic()
        distributed.save_checkpoint({"model": self.model.state_dict(),
                                     "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                                     "steps": self.steps, "epoch": self.epoch, "epoch_steps": self.epoch_steps,
                                     "global_batch": self._per_step * distributed.get_world_size(),
                                     "settings": self.settings, "ranks": ranks}, self.path)
        distributed.report_progress(f"its last snapshot: step {self.steps}, {self.path}")

    def _restore(self, saved: dict) -> None:
        _check_resumable(self.path, saved, self.settings, self._per_step * distributed.get_world_size())
        try:
            self.model.load_state_dict(saved["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(saved["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the snapshot {self.path} holds another model or optimizer than this script builds "
                             f"({e}); use another path to start a new run") from e
        # The snapshot is memory-mapped (load_checkpoint): a tensor of it kept past the restore (an optimizer's
        # state on the CPU, which load_state_dict keeps as given) would keep the file mapped, its disk space held
        # after the next save replaces it (on NFS a hidden .nfs file of its size).
        for per_parameter in (self.optimizer.state.values() if self.optimizer is not None else ()):
            per_parameter.update(_unmapped(dict(per_parameter)))
        ranks, rank = saved["ranks"], distributed.get_rank()
        _restore_rngs(ranks, rank)  # set_rng_state and friends copy what they are given
        if ranks[rank % len(ranks)].get("loader_rng") is not None and self._loader_rng is not None:
            self._loader_rng = ranks[rank % len(ranks)]["loader_rng"].clone()
        # The user's state: each rank its own; at another world size rank 0's (a per-rank sum cannot be split).
        mine = ranks[rank] if len(ranks) == distributed.get_world_size() else ranks[0]
        for key, value in _unmapped(mine["state"]).items():
            _check_scaler(self.path, key, self.state.get(key), value)
            self.state[key] = _restored(self.state.get(key), value)
        if mine.get("loader_state") is not None and _stateful(self.loader):
            self.loader.load_state_dict(_unmapped(mine["loader_state"]))
        self.epoch = saved["epoch"]
        self.steps = saved["steps"]
        self.epoch_steps = saved["epoch_steps"]
        where = _position(self.epoch, self.epoch_steps, self.steps, self.loader is not None)
        distributed.print_primary(f"resumed from {self.path} after {where} (saved at world size {len(ranks)})")

    def _loader_generator_state(self) -> torch.Tensor | None:
        generator = getattr(self.loader, "generator", None)
        return generator.get_state() if isinstance(generator, torch.Generator) else None

    def _stop(self, signum: signal.Signals) -> None:
        """Every rank saves this step, the primary requeues if due, every rank raises Stopped."""
        if self.path:
            self.save()
        # Requeue for the time limit's early warning only (SIGTERM is also scancel), after progress, not forever.
        wanted = bool(self.path and signum != signal.SIGTERM and self.steps > self._resumed_at
                      and "SLURM_JOB_ID" in os.environ
                      and int(os.environ.get("SLURM_RESTART_COUNT", 0)) < self.max_requeues)
        requeued = bool(distributed.reduce(requeue() if wanted else False, "max"))  # only the primary asks
        where = _position(self.epoch, self.epoch_steps, self.steps, self.loader is not None)
        saved = f"saved to {self.path}" if self.path else "not saved (no snapshot path)"
        if requeued:
            saved += "; requeued"
        elif wanted:
            saved += "; could not requeue"
        distributed.print_primary(f"stopped by {signum.name} after {where}; {saved}")
        raise Stopped(REQUEUE_EXIT if wanted and not requeued else 128 + signum)


class Stopped(SystemExit):
    """Raised on every rank by Checkpointer.step() after a stop signal, once the snapshot is saved: exits with
    ``code`` (128 + the signal; 75 when a due requeue failed, for slurm.conf's RequeueExit=75), no traceback.
    distributed.cleanup() and launch() take it as a normal end."""


def handle_stop_signals() -> None:
    """From now on, STOP_SIGNALS (SIGTERM, SIGUSR1, SIGUSR2) are recorded for stop_requested() instead of
    ending this process. Call it on every rank before training; a Checkpointer calls it. Idempotent.

    DataLoader workers forked from this process inherit the handler. Where they come from a forkserver
    (Python 3.14's default on Linux), it is started now with the signals blocked, so that a signal to the whole
    process group kills neither it nor them (its death would end every worker) before this rank saves."""
    if isinstance(signal.getsignal(signal.SIGTERM), _StopRecorder):
        return
    recorder = _StopRecorder()
    for signum in STOP_SIGNALS:
        signal.signal(signum, recorder)
    # The first of get_all_start_methods() is the default (forkserver from Python 3.14 on Linux).
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if method == "forkserver":
        with distributed.stop_signals_blocked():
            multiprocessing.forkserver.ensure_running()


def stop_requested() -> signal.Signals | None:
    """The stop signal (one of STOP_SIGNALS) any rank has received, or None; the same on every rank, from
    one all-reduce. Call it on all ranks at the same step boundary, so that all save the same step and exit
    alike (Checkpointer.step() does). The first call installs the handlers (handle_stop_signals(), in the main
    thread); until then a stop signal keeps its default effect, so a script that never asks is not changed.
    Call handle_stop_signals() earlier to record signals from the start. Of different signals SIGTERM wins
    (scancel sends it)."""
    return _agree()[0]


def requeue() -> bool:
    """Ask SLURM to requeue this job (under a job array, this task only); True if it accepted. Not a
    collective: only the primary asks, other ranks and runs outside SLURM get False. SLURM ends the job
    at once: call it once the snapshot is saved. Where scontrol is missing (a container) or refuses, it
    says so on stderr and returns False: slurm.conf's RequeueExit=<code> can requeue on your exit code."""
    job = os.environ.get("SLURM_JOB_ID")
    if not distributed.is_primary() or job is None:
        return False
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job:  # the job's own id would requeue every task
        job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        print(f"requeue: scontrol is not on PATH here, so job {job} is not requeued", file=sys.stderr, flush=True)
        return False
    # SLURM ends every process of the job once it requeues it, scontrol too: on a busy node before scontrol
    # has exited, and a requeue done would read as failed. The signals blocked, it exits with its answer.
    with distributed.stop_signals_blocked():
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        print(f"requeue: `scontrol requeue {job}` failed (exit code {done.returncode}): {done.stderr.strip()}",
              file=sys.stderr, flush=True)
    return done.returncode == 0


# ============ Internals (not the API) =======================================================
_CHECK_S = 1.0  # seconds between stop checks when check_every is not given: well within SLURM's 30-s KillWait
_CHUNK = 16 << 20  # bytes of each rank's state per gather when a save collects them
_SNAPSHOT_KEYS = {"model", "optimizer", "steps", "epoch", "epoch_steps", "global_batch", "settings", "ranks"}


class _StopRecorder:
    """handle_stop_signals()'s handler; it lives in the process's signal table, not in a module global. It only
    records: it runs between two bytecodes of whatever the main thread was doing, maybe a collective,
    so I/O or a collective here could deadlock (Lightning #20806, #21406). A repeat is harmless."""
    received = 0  # the highest signal number so far (an instance's own once set)

    def __call__(self, signum: int, frame: Any) -> None:
        self.received = max(self.received, signum)


def _checked_arguments(path: str | os.PathLike | None, loader: Any, batch_size: int | None, grad_accum: int,
                       save_every: int, save_interval: float, check_every: int | None, max_requeues: int) -> int | None:
    """The Checkpointer's arguments checked, each error naming the value and the fix; returns the batch size
    (the loader's when not given)."""
    if batch_size is None:  # DataLoader(batch_sampler=BatchSampler(sampler, batch_size, ...)) keeps it there
        batch_size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None),
                                                                    "batch_size", None)
    limits = {"grad_accum": (grad_accum, 1), "save_every": (save_every, 0), "check_every": (check_every, 1),
              "max_requeues": (max_requeues, 0), "batch_size": (batch_size, 1)}
    for name, (value, low) in limits.items():
        if value is None and name in ("check_every", "batch_size"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"Checkpointer: {name} must be an integer >= {low}, got: {value!r}")
    if isinstance(save_interval, bool) or not isinstance(save_interval, (int, float)) or not save_interval >= 0:
        raise ValueError(f"Checkpointer: save_interval must be a number of seconds >= 0, got: {save_interval!r}")
    if path and loader is None and batch_size is None:
        raise ValueError("Checkpointer: an iteration loop (no loader=) needs batch_size=, the samples each rank "
                         "trains on per micro-batch, so that a resume at another global batch is refused (an "
                         "epoch loop passes loader=)")
    loader_batch = getattr(loader, "batch_size", None)
    if loader_batch is not None and batch_size != loader_batch:
        raise ValueError(f"Checkpointer: batch_size={batch_size} but loader.batch_size={loader_batch}; leave "
                         "batch_size out when you pass a loader")
    if distributed.launch_mode() != "single" and not dist.is_initialized():
        # Without a group every rank would restore as a world of one: rank 0's RNG, a wrong global batch.
        raise RuntimeError("Checkpointer: no process group yet; construct it after "
                           "distributed.init_process_group()")
    return batch_size


def _stateful(loader: Any) -> bool:
    """A loader that saves and restores its own position (sharded_stream's): set_epoch, state_dict, load_state_dict."""
    return all(callable(getattr(loader, name, None)) for name in ("set_epoch", "state_dict", "load_state_dict"))


def _loader_sampler(loader: Any) -> Any:
    """The sampler whose indices a loader batches: its ``sampler``, or the one inside its ``batch_sampler``."""
    sampler = getattr(loader, "sampler", None)
    if not hasattr(sampler, "set_epoch"):  # DataLoader(batch_sampler=...): the sampler it batches
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", sampler)
    return sampler


def _resumable(sampler: Any, refuse_random: bool) -> bool:
    """Whether a Checkpointer can start ``sampler`` mid-epoch through ``set_epoch(epoch, skip=k)``, as
    distributed.data_sampler's starts: the first k indices of the epoch's order skipped, never loaded. A sampler of
    the user's own whose order depends only on set_epoch (torch's DistributedSampler, a repeated-augmentation
    sampler) is given that skip: its class is swapped, on this one object, for a subclass. One that draws a new
    order at every pass is refused where there are snapshots to resume."""
    set_epoch = getattr(sampler, "set_epoch", None)
    if set_epoch is not None and "skip" in inspect.signature(set_epoch).parameters:
        return True
    if not _deterministic(sampler):
        if not refuse_random:  # no snapshot path: nothing to resume
            return False
        raise ValueError(f"Checkpointer: the loader's sampler ({type(sampler).__name__}) draws a new order at every "
                         "pass, so a snapshot saved mid-epoch (at a stop signal) could not resume where it stopped. "
                         "Use sampler=distributed.data_sampler(data, shuffle=True), or give your sampler an order "
                         "that depends only on set_epoch(epoch) (a generator seeded from seed + epoch in __iter__)")
    cls = type(sampler)

    def set_epoch_skipping(self: Any, epoch: int, skip: int = 0) -> None:
        if hasattr(cls, "set_epoch"):
            cls.set_epoch(self, epoch)
        self.skip = min(skip, cls.__len__(self))

    def __iter__(self: Any) -> Iterator[int]:
        return itertools.islice(cls.__iter__(self), self.skip, None)

    def __len__(self: Any) -> int:
        return cls.__len__(self) - self.skip

    def __reduce_ex__(self: Any, protocol: int) -> tuple:  # pickled and copied as the user's own class, no skip
        return _bare, (cls,), {key: value for key, value in vars(self).items() if key != "skip"}

    body = {"__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__, "skip": 0,
            "set_epoch": set_epoch_skipping, "__iter__": __iter__, "__len__": __len__, "__reduce_ex__": __reduce_ex__}
    sampler.__class__ = type(cls.__name__, (cls,), body)
    return True


def _bare(cls: type) -> Any:
    """An instance of ``cls`` not yet initialized, for unpickling: its attributes follow."""
    return cls.__new__(cls)


def _deterministic(sampler: Any) -> bool:
    """Whether two passes over the sampler's epoch-0 order agree (the first indices, enough to tell a fresh draw).
    The process's generators are left as they were: a sampler drawing from the global one must not shift it."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        passes = []
        for _ in range(2):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(0)
            passes.append(list(itertools.islice(iter(sampler), 4096)))
        return passes[0] == passes[1]
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _agree(*values: float) -> tuple[signal.Signals | None, list[float]]:
    """The one stop poll, for stop_requested() and Checkpointer.step(): one all-reduce (max) on all ranks of the
    stop signal any rank received and of ``values``. Installs the handlers first (handle_stop_signals())."""
    handle_stop_signals()
    recorder = signal.getsignal(signal.SIGTERM)
    agreed = distributed.reduce(torch.tensor([recorder.received, *values], dtype=torch.float64), "max").tolist()
    return (signal.Signals(int(agreed[0])) if agreed[0] else None), agreed[1:]


def _position(epoch: int, epoch_steps: int, steps: int, epochs: bool) -> str:
    """Where a run is, as counts of work done (what ckpt.epoch, ckpt.epoch_steps and ckpt.steps hold): "1 epoch
    and 5 steps" (an epoch loop), "40 steps" (an iteration loop). Counts need no convention for the first one."""
    def count(n: int, what: str) -> str:
        return f"{n} {what}" if n == 1 else f"{n} {what}s"
    if not epochs:
        return count(steps, "step")
    if epoch_steps:
        return f"{count(epoch, 'epoch')} and {count(epoch_steps, 'step')}"
    return count(epoch, "epoch")


def _agreed_snapshot(path: str | None) -> dict | None:
    """The snapshot at ``path`` (None if there is none), the same on every rank, or an error on every
    rank: one host resuming while another starts fresh would drift silently and hang at the end."""
    saved, error = None, None
    try:
        if path and distributed.is_primary() and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise ValueError(f"cannot write snapshots to {path}: its directory is missing or read-only; create it "
                             "or choose another path (now, not after the first epoch)")
        # On the CPU: each load_state_dict places its tensors where this run keeps them (Adam's step counters on
        # the CPU: on the GPU, foreach Adam would sync with the host for every parameter at every step).
        saved = distributed.load_checkpoint(path, map_location="cpu") if path else None
        missing = _SNAPSHOT_KEYS - saved.keys() if saved is not None else set()
        if missing:
            raise ValueError(f"{path} is not a Checkpointer snapshot (missing: {sorted(missing)}); use another path")
    except Exception as e:  # every rank must still take part in the agreement below
        error = e
    if error is not None:
        found = 2
    else:
        found = 0 if saved is None else 1
    mine = [found, *(saved[k] if saved else 0 for k in ("steps", "epoch"))]
    views = [tuple(view) for view in distributed.all_gather(torch.tensor(mine)).tolist()]
    if error is not None:
        raise error
    if len(set(views)) > 1:
        kinds = ("no file", "the snapshot of step {}", "an error (see its message)")
        seen = "; ".join(f"rank {r}: " + kinds[kind].format(step) for r, (kind, step, _) in enumerate(views))
        raise RuntimeError(f"the ranks found different snapshots at {path} ({seen}): every rank must resume the "
                           "same one. Put the snapshot on a file system every node sees (a shared directory), "
                           "not on a node's local disk")
    return saved


def _gather_to_primary(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` (what torch.load(weights_only=True) reads) on the primary, in rank order; None
    elsewhere; must be called on all ranks. To the writer only, in chunks written straight into each rank's
    buffer: the primary holds world x the state once, the others nothing more, and under nccl (which moves
    CUDA tensors only) the GPUs hold (world + 1) x _CHUNK at most, whatever the state's size."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    if distributed.get_world_size() == 1:
        return [torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)]
    lengths = distributed.all_gather(len(data)).tolist()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    primary = distributed.is_primary()
    gathered = [bytearray(n) for n in lengths] if primary else []
    for start in range(0, max(lengths), _CHUNK):
        size = min(_CHUNK, max(lengths) - start)
        piece = torch.zeros(size, dtype=torch.uint8)
        if start < len(data):
            mine = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=min(size, len(data) - start))
            piece[:len(mine)] = mine
            del mine  # a view of the buffer: the buffer is freed below only once none is left
        piece = piece.to(device)
        rows = [torch.empty_like(piece) for _ in lengths] if primary else None
        dist.gather(piece, rows, dst=0)
        for out, row, n in zip(gathered, rows or [], lengths, strict=False):
            if n > start:
                end = min(n, start + size)
                torch.frombuffer(out, dtype=torch.uint8)[start:end].copy_(row[:end - start])
    if not primary:
        return None
    del data, buffer  # decoded one rank at a time, each buffer freed once it is
    return [torch.load(io.BytesIO(gathered.pop(0)), map_location="cpu", weights_only=True) for _ in lengths]


def _unmapped(obj: Any) -> Any:
    """``obj`` with each CPU tensor in it (in dicts, lists and tuples) copied out of the snapshot's mapping."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.device.type == "cpu" else obj
    if isinstance(obj, dict):
        return {key: _unmapped(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unmapped(value) for value in obj)
    return obj


def _state_dicts(state: dict) -> dict:
    """The user's state as a snapshot holds it: an object with load_state_dict() (an LR scheduler) as its
    state_dict(), a torch.Generator as its state."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Generator):
            out[key] = value.get_state()
        elif hasattr(value, "load_state_dict"):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def _check_scaler(path: str, key: str, current: Any, saved: Any) -> None:
    """A GradScaler resumes only into one enabled as the snapshot's was: a disabled one saves {}, which an enabled
    one refuses with torch's bare "The source state dict is empty", and a disabled one ignores an enabled one's."""
    if not isinstance(current, torch.amp.GradScaler):
        return
    was, now = ("enabled" if saved else "disabled"), ("enabled" if current.is_enabled() else "disabled")
    if was != now:
        raise ValueError(f"the snapshot {path} holds state[{key!r}] of a GradScaler that was {was}, and this run's is "
                         f"{now}: resume with the same mixed-precision setting, or use another path to start anew")


def _restored(current: Any, saved: Any) -> Any:
    """``saved`` put into ``current`` in place where its type allows (so that a name the loop holds sees it): a
    tensor's values (on its own device), a dict's and a list's items, an LR scheduler's or a Generator's state.
    What cannot change in place (a number, a string, a tuple) comes back as a new object."""
    if isinstance(current, torch.Generator):
        current.set_state(saved)
    elif hasattr(current, "load_state_dict"):
        current.load_state_dict(saved)
    elif isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        if current.shape != saved.shape or current.dtype != saved.dtype:
            return saved.to(current.device)
        with torch.no_grad():
            current.copy_(saved)
    elif isinstance(current, dict) and isinstance(saved, dict):
        for key, value in saved.items():
            current[key] = _restored(current.get(key), value)
    elif isinstance(current, list) and isinstance(saved, list) and len(current) == len(saved):
        current[:] = [_restored(now, value) for now, value in zip(current, saved, strict=True)]
    elif isinstance(current, tuple) and isinstance(saved, (list, tuple)) and len(current) == len(saved):
        return type(current)(_restored(now, value) for now, value in zip(current, saved, strict=True))
    else:
        return saved
    return current


def _restore_rngs(ranks: list[dict], rank: int) -> None:
    """This rank's generators (torch's CPU and CUDA, Python's, numpy's) as the snapshot holds them. At another
    world size a rank the snapshot had keeps its own; a new rank gets states of its own, derived from the snapshot
    and its rank (rank 0's for every rank would give them all the same random batches)."""
    saved = ranks[rank] if rank < len(ranks) else None
    numpy = sys.modules.get("numpy")  # restored where the process has it, never imported: numpy stays optional
    if saved is not None:
        torch.set_rng_state(saved["rng"])
        if saved["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda_rng"])
        if saved.get("python_rng") is not None:  # snapshots before these were saved have neither
            random.setstate((3, tuple(saved["python_rng"].tolist()), saved["python_gauss"]))
        if saved.get("numpy_rng") is not None and numpy is not None:
            keys, position, has_gauss, gauss = saved["numpy_rng"]
            numpy.random.set_state(("MT19937", numpy.array(keys.tolist(), dtype=numpy.uint32), position, has_gauss,
                                    gauss))
        return
    base = ranks[rank % len(ranks)]["rng"]
    seed = int.from_bytes(hashlib.blake2b(bytes(base.tolist()) + rank.to_bytes(8, "little"),
                                          digest_size=8).digest(), "little") >> 1
    torch.manual_seed(seed)  # the CUDA generators too
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed & 0xFFFFFFFF)


def _host_generators() -> dict[str, Any]:
    """This rank's Python ``random`` and (where the process has imported it) numpy's global generator, as a
    snapshot holds them: a loop's mixup (np.random.beta) or RandomChoice draws from them in the rank."""
    version, keys, gauss = random.getstate()
    state = {"python_rng": torch.tensor(keys, dtype=torch.int64), "python_gauss": gauss, "numpy_rng": None}
    numpy = sys.modules.get("numpy")
    legacy = numpy.random.get_state() if numpy is not None else None
    if isinstance(legacy, tuple) and legacy[0] == "MT19937":  # not another bit generator seated in its place
        _, keys, position, has_gauss, gauss = legacy
        state["numpy_rng"] = (torch.tensor(keys.tolist(), dtype=torch.int64), int(position), int(has_gauss),
                              float(gauss))
    return state


def _check_resumable(path: str, saved: dict, settings: dict, global_batch: int) -> None:
    """Refuse a snapshot of another run, naming every setting that differs and what may change."""
    theirs = saved["settings"]
    differ = [f"{key}: {theirs.get(key)!r} there, {value!r} here" for key, value in settings.items()
              if theirs.get(key) != value]
    differ += [f"{key}: {value!r} there, not given here" for key, value in theirs.items() if key not in settings]
    if differ:
        raise ValueError(f"the snapshot {path} belongs to another run: {'; '.join(differ)}. Continue it with its "
                         "settings, or use another path. May change on resume: anything else (epochs, logging, "
                         "loader workers...), and the processes and batch size per process (mid-epoch keeping the "
                         "global batch)")
    if saved["epoch_steps"] and global_batch != saved["global_batch"]:
        world, before = distributed.get_world_size(), saved["global_batch"]
        if before % world == 0:
            fix = f"at {world} process(es), batch size x grad_accum = {before // world} per process"
        else:
            fix = f"a number of processes that divides {before}"
        where = _position(saved["epoch"], saved["epoch_steps"], saved["steps"], True)
        raise ValueError(f"the snapshot {path} stopped after {where} with a global batch (batch size x grad_accum x "
                         f"processes) of "
                         f"{before} samples, and this run's is {global_batch}: the rest of the epoch continues only "
                         f"with the same global batch: use {fix} (at an epoch's end any global batch may resume)")
