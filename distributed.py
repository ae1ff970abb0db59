"""Data-parallel training in one file: copy it next to your training script.

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    import distributed

    def main_worker(local_rank: int, world_size: int, epochs: int) -> None:
        device = distributed.init_process_group(local_rank, world_size)
        torch.manual_seed(0)                       # the same data and initial weights on every rank
        data = TensorDataset(torch.randn(1024, 8), torch.randn(1024, 1))
        model = torch.nn.Linear(8, 1).to(device)
        ddp = DDP(model) if distributed.get_world_size() > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = distributed.data_sampler(data, shuffle=True)  # this rank's share (alone: all)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)               # a new shuffle every epoch
            for x, y in DataLoader(data, batch_size=32, sampler=sampler):
                loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
                optimizer.zero_grad()
                loss.backward()                    # DDP averages the gradients over the ranks here
                optimizer.step()
            distributed.print_primary(f"epoch {epoch}: last loss {distributed.reduce(loss, 'mean').item():.4f}")
        distributed.cleanup()

    if __name__ == "__main__":
        distributed.launch(main_worker, 2)         # settings as arguments: workers re-import this file

The same script runs unchanged as
    python train.py                                  # one process per visible GPU, else 1 on CPU
    python train.py  (launch(..., nprocs=N))         # N local processes (gloo on CPU)
    torchrun --nproc_per_node=N train.py             # one or many hosts
    srun -n N python train.py                        # SLURM

This file alone launches, joins the group, shards the data and runs the collectives; a stop signal (SIGTERM,
SIGUSR1, SIGUSR2) is forwarded to the ranks and ends them. Standard library and torch (2.8 or newer) only; no
module-level state.

The rule: what runs without being called by name (launcher detection, the start's checks, the supervisor, the
reports) is here; what a script opts into by name lives in a file beside this one that uses only this file's
public names and that this file never imports: checkpointer.py (exact resume, clean stops), seeded_dataset.py,
sync_batchnorm.py, sharded_stream.py, ddp_check.py, shared_memory_allreduce.py. The map of its banners: what a
script calls (Launching ... Models); what the files beside it use; the internals in the same order; last, the
supervisor of launch()'s processes and its reports.
"""
from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import datetime
import errno
import faulthandler
import gc
import io
import itertools
import json
import linecache
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import re
import select
import shutil
import signal
import socket
import sys
import struct
import sysconfig
import tempfile
import threading
import time
import traceback
from typing import Any, NamedTuple
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
# Before any group exists: its functions take group.WORLD as a default argument, so imported later (DDP
# imports it, through torch._dynamo) they would hold the group, and gloo's threads, past cleanup().
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler, Sampler

__all__ = [
    # What a training script calls, in the order it calls them
    "launch", "launch_mode", "WorkerFailed",
    "init_process_group", "DEFAULT_TIMEOUT", "get_rank", "get_world_size", "is_primary", "cleanup",
    "data_sampler", "check_repeatable",
    "reduce", "all_gather", "barrier", "print_primary", "print_ranked",
    "save_checkpoint", "load_checkpoint", "unwrap",
    # For the files beside this one (checkpointer.py, ddp_check.py, ...) and tools of your own
    "start_workers", "STOP_SIGNALS", "REQUEUE_EXIT", "stop_signals_blocked", "report_progress", "check_weights_only",
]

# gloo waits 30 minutes by default before a stuck collective fails, NCCL 10; 5 minutes is long enough
# for a rank-0-only evaluation or save, and short enough that a hung rank does not eat the allocation.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


# ------------------------------ Launching ---------------------------------------------------------
def launch(worker: Callable[..., Any], *args: Any, nprocs: int | None = None, grace: float = 25.0) -> None:
    """Run ``worker(local_rank, world_size, *args)`` once in every process of the job.

    Under a launcher (torchrun, srun) the worker runs once, here. Otherwise ``nprocs`` processes
    run on this machine (default: one per visible GPU, else 1; one runs in-process).
    A failing rank stops the whole job: the others are terminated and the root cause's exception
    is re-raised here, its remote traceback attached as a note (``WorkerFailed`` if it died of a
    signal). Ctrl-C stops every worker at once. SIGTERM, SIGUSR1 and SIGUSR2 are forwarded to the
    workers, which get ``grace`` seconds (below SLURM's default KillWait, 30 s) to save and exit
    before SIGKILL; then this process dies of the same signal. Workers that exit with 128 + a stop
    signal's number (or REQUEUE_EXIT) did stop, not fail: this process exits with that code. Each worker
    has a session of its own (as under torchrun): one killed by a signal takes what it started (its
    DataLoader workers) with it.
    """
    env = _launcher_env()
    if env is not None:
        if env.mode == "torchrun" and "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import record
            worker = record(worker)  # writes the error file torchrun's agent reads to name the root cause
        worker(env.local_rank, env.world_size, *args)
        return
    nprocs = _resolve_nprocs(nprocs, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if nprocs == 1:
        worker(0, 1, *args)
        return
    _check_spawnable(worker, args)
    with contextlib.ExitStack() as job:
        with stop_signals_blocked():  # a stop signal during the start is forwarded once the handlers are in
            workers = job.enter_context(contextlib.closing(start_workers(worker, nprocs, *args)))
            stopping = job.enter_context(_forwarding_stop_signals(workers, grace))
        workers.join(stopping)
    _end_as_stopped(workers, stopping)  # the ranks stopped at a signal, saved and exited: so does the launcher


def launch_mode() -> str:
    """How this process was started: "torchrun", "slurm", "spawn" (by launch) or "single"."""
    return getattr(_launcher_env(), "mode", "single")


class WorkerFailed(RuntimeError):
    """A launched process died without a Python exception (a signal, os._exit, a crash in C++)."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


# ------------------------------ The process group -------------------------------------------------
def init_process_group(local_rank: int, world_size: int, backend: str | None = None,
                       timeout: datetime.timedelta | float | None = None) -> torch.device:
    """Join the job's process group and return this rank's device. Safe to call twice.

    nccl (after ``torch.cuda.set_device``) when this rank has a GPU, else gloo; the global rank comes
    from the launcher. A world of one outside any launcher creates no group: every helper here then
    behaves as one process. ``timeout`` (seconds or a timedelta; default ``DEFAULT_TIMEOUT``) bounds
    every collective, so a hung rank makes the others fail instead of waiting 30 minutes.
    Over TCP the ranks meet on their own store first: a wait says what it waits for (rank 0 not listening,
    no answer, ranks missing) and one that cannot end fails in seconds, naming the cause and the fix; ranks
    with different torch (or NCCL) versions fail, and a job across hosts never lets gloo listen on loopback.
    """
    if backend == "nccl" and not torch.cuda.is_available():  # torch would fail at world size 2, naming device_id
        raise ValueError("init_process_group: backend='nccl' needs a GPU and this process sees none "
                         "(torch.cuda.is_available() is False); pass backend=None (nccl on GPUs, else gloo) or 'gloo'")
    # Both are checked in every world, a world of one included: a bad value fails on a laptop, not on a cluster.
    device = _device_for(local_rank, backend in (None, "nccl"))
    timeout = _as_timedelta(timeout)
    if _has_group():
        return device
    env = _launcher_env()
    if env is None:
        if world_size == 1:
            return device
        raise ValueError(f"init_process_group: world_size={world_size} but no launcher environment was found "
                         "(RANK/WORLD_SIZE/LOCAL_RANK or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID); start the "
                         "processes with distributed.launch(), torchrun or srun")
    if world_size != env.world_size:
        raise ValueError(f"init_process_group: world_size={world_size} disagrees with the launcher's "
                         f"{env.world_size} ({env.mode}); pass the world_size that launch() gave the worker")
    if env.mode != "spawn":  # launch()'s ranks prepared as they started
        _prepare_rank(env)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=device if backend == "nccl" else None, **_rendezvous(env, backend, timeout))
    if files := _RankFiles.of_this_job():  # for launch()'s report of a hang
        files.write(env.rank, "backend", backend)
    elif backend == "nccl" and env.rank == 0 and _env_int_or("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        print(f"distributed.py: on a collective's timeout NCCL's flight recorder writes each rank's last collectives "
              f"to {_flight_recorder_prefix()}<rank> on its host", file=sys.stderr, flush=True)  # torchrun, srun
    return device


def get_rank() -> int:
    """This process's global rank; 0 before init_process_group or in one process."""
    return dist.get_rank() if _has_group() else 0


def get_world_size() -> int:
    """The number of processes in the job; 1 before init_process_group or in one process."""
    return dist.get_world_size() if _has_group() else 1


def is_primary() -> bool:
    """True on global rank 0 only (one process in the whole job, across nodes), and in one process."""
    return get_rank() == 0


def cleanup() -> None:
    """Destroy the process group if there is one. Safe to call twice, and without a group."""
    if _has_group():
        error = sys.exception()
        stopped = isinstance(error, SystemExit) and error.code in _STOP_EXITS  # every rank saved and stops
        if error is not None and not stopped and dist.get_backend() == "nccl":
            # In a `finally:` while an error propagates, destroying would wait for NCCL work the peers never
            # finish, and the error would surface, if ever, as the watchdog's SIGABRT.
            return  # the process is exiting anyway. https://github.com/pytorch/pytorch/issues/122358
        group = [dist.group.WORLD]
        dist.destroy_process_group()
        # gloo's threads take the GIL to free finished work's tensors, and freeing the group joins them: freed by a
        # DDP reducer, which holds the GIL, that deadlocks; at interpreter shutdown it aborts a finished job
        # ("terminate called without an active exception"). So its Python object keeps it until exit, when the
        # DDP models (in reference cycles) are collected, and then frees it, the GIL released, Python still whole.
        atexit.register(lambda: (gc.collect(), group.clear()))


# ------------------------------ Data --------------------------------------------------------------
def data_sampler(dataset: Dataset, distributed: bool = True, shuffle: bool = True, *, pad: bool = True,
                 seed: int = 0) -> Sampler:
    """This rank's share of ``dataset``: ``DataLoader(dataset, batch_size, sampler=data_sampler(dataset))``.

    Every rank draws the same permutation for an epoch (``seed + epoch``): call ``sampler.set_epoch(epoch)`` every
    epoch, or every epoch repeats the same order. ``set_epoch(epoch, skip=k)`` resumes mid-epoch: the same order
    without the first k samples of this rank's share, which are never loaded; len() is what remains; the next
    set_epoch is whole again. ``set_epoch`` passes the epoch on to a dataset that has one (seeded_dataset's).
    pad=True (training): ceil(N / world) samples per rank, padded with repeats so every rank runs the same number
    of steps. pad=False (exact evaluation): every sample exactly once across the ranks, which may differ by one
    sample (or get none when N < world). ``distributed=False`` (a port's ``args.distributed`` at one process):
    this rank gets every sample, in the same order a world of one gets, through the same sampler.
    """
    _refuse_iterable(dataset, "data_sampler")
    world, rank, size = get_world_size(), get_rank(), len(dataset)
    if not distributed:
        world, rank = 1, 0
    if size == 0:
        raise ValueError("data_sampler: the dataset is empty (got len(dataset)=0)")
    if pad and size < world:
        raise ValueError(f"data_sampler: the dataset has {size} samples but the world size is {world}; "
                         f"with pad=True {world - size} rank(s) would train only on repeated samples. Use at "
                         f"least {world} samples, fewer processes, or pad=False (for evaluation)")
    return _Sampler(dataset, world, rank, shuffle=shuffle, seed=seed, pad=pad)


def check_repeatable(dataset: Dataset, indices: Iterable[int] = (0,)) -> None:
    """Raise ValueError naming the first of ``indices`` whose item differs between two reads (in one epoch): its
    randomness is not a function of the sample, so the ranks, one process and a resumed run each draw their own.
    For a dataset of seeded_dataset's, that names a generator it does not reseed."""
    for index in indices:
        if not _same_item(dataset[index], dataset[index]):
            raise ValueError(_unrepeatable(index, seeded=getattr(dataset, "seeded_per_item", False)))


# ------------------------------ Collectives: each must be called on all ranks, in the same order --
def reduce(value: torch.Tensor | float | int | bool, op: str = "sum") -> torch.Tensor:
    """A new tensor holding ``value`` all-reduced over every rank; must be called on all ranks.

    op: "sum", "mean", "max" or "min". Shape and dtype are kept, except that a mean of integers or
    booleans is float64 (an integer mean would truncate) and a sum of booleans is an int64 count.
    The input is never modified; the result is detached; in one process it is a copy of the input.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce: unknown op {op!r}; use one of {', '.join(_REDUCE_OPS)}")
    tensor = torch.as_tensor(value)
    if tensor.is_complex() and op in ("max", "min"):  # refused at any world size, not only where ranks meet
        raise ValueError(f"reduce: op {op!r} has no meaning for complex numbers (got {tensor.dtype}); reduce the "
                         "real and imaginary parts or the magnitudes (value.abs()) instead")
    out_dtype = _reduce_dtype(tensor.dtype, op)
    # A copy, contiguous: NCCL refuses a strided tensor (x.T, preds[:, 0]) that gloo takes.
    result = tensor.detach().to(dtype=_wire_dtype(out_dtype), memory_format=torch.contiguous_format, copy=True)
    if get_world_size() > 1:
        wire = result.to(_wire_device(dist.get_backend(), result.device))
        dist.all_reduce(wire, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
        result = wire.to(result.device)
    if op == "mean":
        result = result / get_world_size()
    return result.to(out_dtype)


def all_gather(value: torch.Tensor | float | int) -> torch.Tensor:
    """Every rank's ``value`` stacked in rank order: shape (world_size, *value.shape), on every rank.

    Must be called on all ranks, with the same shape and dtype (gather unequal sizes padded, plus
    their lengths). One collective, however many numbers: cheaper than several reduces.
    """
    tensor = torch.as_tensor(value).detach()
    if get_world_size() == 1:
        return tensor.unsqueeze(0).clone()
    wire = tensor.to(_wire_device(dist.get_backend(), tensor.device), _wire_dtype(tensor.dtype)).contiguous()
    parts = [torch.empty_like(wire) for _ in range(get_world_size())]
    dist.all_gather(parts, wire)
    return torch.stack(parts).to(tensor.device, tensor.dtype)


def barrier() -> None:
    """Wait until every rank gets here; must be called on all ranks."""
    if get_world_size() > 1:
        dist.barrier()


def print_primary(*args: Any, **kwargs: Any) -> None:
    """print() on the primary rank only; the other ranks print nothing."""
    if is_primary():
        print(*args, **{"flush": True, **kwargs})


def print_ranked(*args: Any, sep: str = " ") -> None:
    """One line per rank, prefixed ``[rank k]``, printed in rank order by the primary (gathered
    there: no interleaving); must be called on all ranks."""
    lines = _all_gather_bytes(f"[rank {get_rank()}] {sep.join(map(str, args))}".encode())
    if is_primary():
        print("\n".join(line.decode() for line in lines), flush=True)


# ------------------------------ Checkpoints -------------------------------------------------------
def save_checkpoint(state: dict, path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically; must be called on all ranks.

    The primary writes a temporary file, fsyncs it and renames it over ``path``: a crash leaves the
    previous file or the new one, never a mix. Every rank waits for the primary (nobody reads half a
    file), and a failed write raises the same OSError on every rank. Keys lose DDP's ``module.`` and
    torch.compile's ``_orig_mod.`` prefixes. Only what ``torch.load(weights_only=True)`` reads back
    (tensors, numbers, strings, and containers of them) is accepted: else a TypeError before writing.
    """
    state = _strip_wrapper_prefixes(state)
    check_weights_only(state, "save_checkpoint: state")  # fail now, not at resume time
    error = None
    if is_primary():
        try:
            _atomic_save(state, os.fspath(path))
        except OSError as e:
            error = e
    # The primary's outcome travels as a number (0: saved, else the errno) to every rank.
    code = int(all_gather(0 if error is None else error.errno or -1)[0])
    if code != 0:
        reason = error.strerror or str(error) if error is not None else os.strerror(code)
        raise OSError(code, f"cannot write the snapshot ({reason}); a file at that path, if any, is still "
                            "a whole snapshot: check the directory exists and is writable", os.fspath(path))


def load_checkpoint(path: str | os.PathLike, map_location: Any = None) -> dict | None:
    """The dict saved at ``path`` (on this rank's device by default), or None if there is no file.

    ``weights_only=True``: a pickle that would build arbitrary objects (and could run code) is
    refused. A corrupt or truncated file is an error naming it, never a silent fresh start. Memory-mapped:
    the ranks of a node read the file's shared pages, none holds a private copy of the whole snapshot.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        return None
    if map_location is None:  # this rank's device, not the one the primary saved from
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        map_location = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
    try:
        # mmap: the ranks of a node share the file's pages instead of each holding a private copy of the whole
        # snapshot while it is restored (8 ranks x 48 GB would not fit a node's memory).
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except Exception as e:  # a damaged file fails anywhere in torch's readers, with any exception
        if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):  # torch's message says what to do
            raise pickle.UnpicklingError(f"refusing to load {path}, it holds objects that could run code: {e}") from e
        raise _corrupt(path, e) from e
    if not isinstance(state, dict):
        raise RuntimeError(f"the snapshot {path} holds a {type(state).__name__}, not a dict")
    return _strip_wrapper_prefixes(state)


# ------------------------------ Models ------------------------------------------------------------
def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DDP and/or torch.compile wrappers (whose state_dict keys it owns)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def __getattr__(name: str) -> Any:
    if name in ("seeded_dataset", "sync_batchnorm"):  # opt-in helpers, moved to files of their own beside this one
        raise AttributeError(f"distributed.{name} moved to {name}.py, an optional file beside distributed.py: copy it "
                             f"next to your script, write `from {name} import {name}` and call {name}(...)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ============ For the files beside this one: public, but not what a script calls first ==============
# checkpointer.py, ddp_check.py and shared_memory_allreduce.py use these; so may tools of your own.
# ------------------------------ Starting ranks without launch()'s wait ----------------------------
def start_workers(worker: Callable[..., Any], nprocs: int, *args: Any, env: dict[str, str] | None = None) -> _Workers:
    """Start ``worker(local_rank, nprocs, *args)`` in ``nprocs`` local processes and return at once:
    launch()'s own start, for tools that keep ranks running (ddp_check's pools). ``env`` adds to each
    worker's environment. The handle's ``join()`` waits and raises the root cause of the first failure,
    ``close()`` stops every worker (SIGTERM, then SIGKILL), ``processes`` are theirs."""
    _resolve_nprocs(nprocs, 0)  # an integer >= 1
    return _Workers(worker, nprocs, args, env)


# ------------------------------ Stops: the launcher's side ----------------------------------------
# SLURM sends SIGTERM at the time limit or on scancel (or `#SBATCH --signal`'s USR1/USR2 before the limit),
# then SIGKILL KillWait (30 s) later; torchrun's agent forwards SIGTERM and SIGKILLs after 30 s. launch()
# forwards them to its ranks: a rank that catches them to save its work then exits 128 + the signal's number.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# EX_TEMPFAIL: the exit code of a rank that stopped and whose due SLURM requeue failed (slurm.conf's
# RequeueExit=75 requeues on it). launch() and cleanup() take it, like 128 + a stop signal, as a stop.
REQUEUE_EXIT = 75
# How a rank exits after a stop, which cleanup(), launch() and its supervisor take as a stop, not a failure.
_STOP_EXITS = (*(128 + signum for signum in STOP_SIGNALS), REQUEUE_EXIT)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """STOP_SIGNALS blocked in this thread meanwhile: for starting helper processes (a forkserver,
    multiprocessing's resource tracker), which inherit the mask and so survive a signal sent to the whole
    process group (the forkserver's death would SIGKILL every process it forked). A signal arriving meanwhile
    is delivered when the block ends."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def report_progress(text: str, kind: str = "progress") -> None:
    """Leave ``text`` (one line: the last step saved, say) where launch() reads it should it have to kill this
    rank: after a stop signal's grace, or when it dies; the report then says what was lost. ``kind="window"``: a
    monitor's last verdict (slow_rank.py's), which the report of a collective that timed out shows. Not a
    collective; it does nothing outside a job that launch() started (torchrun and srun print their own reports)."""
    if kind not in ("progress", "window"):
        raise ValueError(f"report_progress: kind must be 'progress' or 'window', got: {kind!r}")
    if files := _RankFiles.of_this_job():
        files.write(get_rank(), kind, text)


# ------------------------------ Checkpoints: what a snapshot may hold -----------------------------
def check_weights_only(obj: Any, where: str) -> None:
    """Raise a TypeError naming ``where`` (and the key inside it) unless torch.load(weights_only=True) can
    read ``obj`` back: tensors, numbers, strings, dtypes, devices, and dicts, lists and tuples of them."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            check_weights_only(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, value in enumerate(obj):
            check_weights_only(value, f"{where}[{i}]")
    elif not isinstance(obj, _WEIGHTS_ONLY_LEAVES):
        raise TypeError(f"{where} is a {type(obj).__qualname__}, which torch.load("
                        "weights_only=True) refuses to read back; store tensors, numbers, strings, or "
                        "dicts/lists of them (e.g. vars(args) instead of an argparse.Namespace)")


# ============ Internals: what the functions above rely on, in the same order (not the API) =====
# ------------------------------ Which launcher started this process --------------------------
# Set by launch() in the processes it spawns: how they rendezvous. Its presence also means "spawn" mode.
_INIT_METHOD_ENV = "DISTRIBUTED_PY_INIT_METHOD"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")

# Steps that are not srun's tasks: the sbatch script (4294967294, or 4294967291 since SLURM 20.11), the
# extern step (4294967292) and salloc's shell under LaunchParameters=use_interactive_step (4294967290).
_NOT_RANK_STEPS = ("batch", "extern", "interactive", "4294967294", "4294967292", "4294967291", "4294967290")


class _Launcher(NamedTuple):
    mode: str  # "torchrun" (or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK), "spawn", "slurm"
    rank: int
    local_rank: int
    world_size: int


def _name_process(suffix: str) -> None:
    """Name this process <script>:<suffix> (Linux: what ps -o comm, top and pgrep show), so that a rank is found by
    `pgrep -o -x train:r1` under any launcher: launch()'s ranks show only the forkserver's command line."""
    if sys.platform != "linux":
        return
    script = os.path.splitext(os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "python"))[0]
    name = f"{script[:14 - len(suffix)]}:{suffix}"
    _prctl(15, name.encode()[:15])  # PR_SET_NAME; loader workers forked later inherit it


def _launcher_env() -> _Launcher | None:
    """The launcher's view of this process, validated; None outside any launcher."""
    env = os.environ
    present = [v for v in _TORCHRUN_VARS if v in env]
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))  # None in sbatch's script or salloc's shell
    if present:
        if missing := [v for v in _TORCHRUN_VARS if v not in env]:
            raise RuntimeError(f"{', '.join(present)} set but {', '.join(missing)} not: a launcher sets "
                               f"all of {', '.join(_TORCHRUN_VARS)}; set the missing ones or unset the others")
        mode = "spawn" if _INIT_METHOD_ENV in env else "torchrun"
        rank, world, local = (_env_int(v) for v in _TORCHRUN_VARS)
    elif all(v in env for v in _SLURM_VARS) and step is not None and step not in _NOT_RANK_STEPS:
        mode, rank, local = "slurm", _env_int("SLURM_PROCID"), _env_int("SLURM_LOCALID")
        world = _env_int("SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        # `srun --pty bash` is a step of one task, the shell: a script typed there is not that task (its pid
        # is not SLURM_TASK_PID) and decides its own processes, as in a plain shell. `srun -n 1 python train.py`
        # is the task itself, and any step of several tasks runs ranks, whatever wraps them.
        if world == 1 and env.get("SLURM_TASK_PID", str(os.getpid())) != str(os.getpid()):
            return None
    else:
        return None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"inconsistent {mode} environment: rank={rank}, local_rank={local}, world_size="
                         f"{world}; need world_size >= 1, 0 <= rank < world_size, local_rank >= 0")
    return _Launcher(mode, rank, local, world)


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got: {os.environ[name]!r}") from None


def _env_int_or(*names: str) -> int:
    """The first of ``names`` set, as an integer (0 if none is)."""
    name = next((name for name in names if os.environ.get(name)), None)
    return _env_int(name) if name else 0


def _resolve_nprocs(nprocs: int | None, gpus: int) -> int:
    """How many processes to start, given the visible GPU count (0 on a CPU machine)."""
    if nprocs is None:
        return max(gpus, 1)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be an integer >= 1, got: {nprocs!r}")
    if gpus and nprocs > gpus:
        raise ValueError(f"launch: nprocs={nprocs} but only {gpus} GPU(s) are visible; use nprocs <= {gpus}, "
                         "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run CPU processes")
    return nprocs


def _check_spawnable(worker: Callable[..., Any], args: tuple) -> None:
    """Fail before any process starts when spawn could not run ``worker`` in a fresh interpreter."""
    try:
        pickle.dumps((worker, args))
    except Exception as e:
        raise TypeError(
            f"launch: the worker {getattr(worker, '__qualname__', worker)!r} or its arguments cannot "
            "be pickled, and spawned processes receive them by pickling; define the worker at the "
            "top level of a module (not a lambda or nested function) and pass picklable arguments"
        ) from e
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is None:
        if getattr(worker, "__module__", None) == "__main__":
            raise RuntimeError("launch: the worker is defined in an interactive session or `python -c`, "
                               "which spawned processes cannot import; define it in a .py file")
    elif not os.path.isfile(main_file):  # `python - < train.py`: "<stdin>", which spawn re-runs by path
        raise RuntimeError(f"launch: the main script is {main_file!r}, not a file, and every spawned process "
                           "runs the main script again from its file; save it as a .py file and run that")
    elif main_file.endswith(".py") and not _has_main_guard(main_file):
        raise RuntimeError(f"launch: {main_file} has no `if __name__ == \"__main__\":` guard; every spawned "
                           "process imports it again and would launch again. Put launch() under the guard")


def _has_main_guard(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: let spawn itself report the problem
    tests = (ast.unparse(node.test) for node in tree.body if isinstance(node, ast.If))
    return any("__name__" in test and "__main__" in test for test in tests)


# ------------------------------ The process group --------------------------------------------
def _has_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device_for(local_rank: int, nccl: bool) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", _gpu_index(local_rank, torch.cuda.device_count(), launch_mode(), nccl))
    torch.cuda.set_device(device)
    return device


def _gpu_index(local_rank: int, gpus: int, mode: str, nccl: bool) -> int:
    """This local rank's GPU; under nccl, which refuses two ranks on one GPU, a GPU of its own."""
    # SLURM 23.11+ reports --gpus-per-task in SLURM_TRES_PER_TASK ("cpu=1,gres/gpu=1", "gres/gpu:a100:2").
    per_task = re.search(r"gres[/:]gpu(?::[\w.-]+)?[:=](\d+)", os.environ.get("SLURM_TRES_PER_TASK", ""))
    gpus_per_task = _slurm_gpu_count(os.environ.get("SLURM_GPUS_PER_TASK", ""))
    gpus_per_task = gpus_per_task or (int(per_task.group(1)) if per_task else 0)
    if mode == "slurm" and gpus_per_task and gpus <= gpus_per_task:
        return 0  # srun --gpus-per-task=k shows each task its own k GPUs: the first is this rank's
    if local_rank < gpus or not nccl:
        return local_rank % gpus  # gloo with CUDA tensors may share a GPU
    # --gres=gpu:1 with 2 tasks shows both the same one (NCCL then dies with "Duplicate GPU detected"); a step with
    # a GPU per task, each bound to its own, shows each task one.
    step_gpus = [gpu for gpu in os.environ.get("SLURM_STEP_GPUS", "").split(",") if gpu]
    if mode == "slurm" and step_gpus and len(step_gpus) <= local_rank and gpus == len(step_gpus):
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: its SLURM step has {len(step_gpus)} "
                           "GPU(s) for more tasks on this node, and NCCL refuses two ranks on one. Ask for a GPU per "
                           "task (--gpus-per-task=1, or --ntasks-per-node at most --gres=gpu:N), or hide the GPUs "
                           "(CUDA_VISIBLE_DEVICES=) to run CPU processes")
    if mode == "slurm" and len(step_gpus) > gpus > 1:
        binding = os.environ.get("SLURM_GPU_BIND", "") or "a --gpu-bind"
        raise RuntimeError(f"local rank {local_rank} sees {gpus} of its step's {len(step_gpus)} GPUs: SLURM's binding "
                           f"({binding}) shows each task a subset, in which local ranks cannot find a GPU of their "
                           "own. Use --gpu-bind=none (every task sees every GPU and local rank k takes GPU k) or "
                           "--gpus-per-task=1")
    if mode == "spawn":  # launch() shows every rank every GPU: a local rank past them shares one
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: this process sees {gpus} GPU(s) and NCCL "
                           f"refuses two ranks on one; use launch(..., nprocs={gpus}) at most")
    # A launcher may show each rank a GPU of its own (CUDA_VISIBLE_DEVICES per rank: mpirun wrappers, Kubernetes'
    # device plugins, SLURM's per-task binding), or several ranks one: the start compares the GPUs' UUIDs.
    return local_rank % gpus


def _slurm_gpu_count(text: str) -> int:
    """A GPU count as SLURM writes it: "2", a typed "h100:1", or a list of them ("a100:1,h100:2"); 0 for none."""
    try:
        return sum(int(item.rsplit(":", 1)[-1]) for item in text.split(",") if item)
    except ValueError:
        raise ValueError(f"SLURM_GPUS_PER_TASK must be a GPU count, [type:]count, got: {text!r}") from None


def _slurm_threads() -> int:
    """A SLURM task's threads: its CPUs (srun -c N), else its share of the CPUs it may use with the
    other tasks of its node (srun without -c lets every task use every allocated core). A task bound
    to its own CPUs keeps them all."""
    if "SLURM_CPUS_PER_TASK" in os.environ:
        return max(_env_int("SLURM_CPUS_PER_TASK"), 1)
    counts = []  # the step's tasks per node, in node order: "2(x3),1" is 2, 2, 2, 1
    for item in os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", "1")).split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    node, cpus = int(os.environ.get("SLURM_NODEID", 0)), _usable_cpus()
    tasks = max(counts[node] if node < len(counts) else 1, 1)
    return max(min(cpus, int(os.environ.get("SLURM_CPUS_ON_NODE", cpus)) // tasks), 1)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _rendezvous(env: _Launcher, backend: str, timeout: datetime.timedelta) -> dict[str, Any]:
    """init_process_group's init_method= or store=: over TCP, a store the ranks meet on first (_meet), so a start
    that cannot complete says why in seconds, on the rank that sees why."""
    if env.mode == "spawn" and os.environ[_INIT_METHOD_ENV] != "env://":
        return {"init_method": os.environ[_INIT_METHOD_ENV]}  # a FileStore in the job's own directory: no port
    if env.mode == "slurm":  # every task derives the same address and port from its job
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        addr = os.environ.get("MASTER_ADDR") or _first_host(nodes)
        port = os.environ.get("MASTER_PORT") or str(20000 + _env_int("SLURM_JOB_ID") % 20000)
    elif missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]:
        raise ValueError(f"init_process_group: RANK and WORLD_SIZE are set but {' and '.join(missing)} not: set "
                         "MASTER_ADDR to rank 0's host and MASTER_PORT to a free port there, on every rank")
    else:
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT must be a port number (1-65535), got: {port!r}")
    start = _Start(env.rank, env.world_size, addr, int(port), timeout)
    # torchrun's agent (and launch() with MASTER_PORT) already holds the store. It keeps it across restarts, so
    # restarted ranks could read a dead attempt's keys: a prefix per attempt.
    # https://github.com/pytorch/pytorch/issues/135712
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = start.store(listen=env.rank == 0 and not agent)
    if agent:
        store = dist.PrefixStore(f"distributed.py/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    start.meet(dist.PrefixStore("distributed.py/start", store), backend)
    return {"store": dist.PrefixStore("distributed.py/group", store)}


def _first_host(hostlist: str) -> str:
    """The first host of a SLURM hostlist, where rank 0 runs: ``"node[01-03,7],gpu-a"`` -> node01."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])*", hostlist).group()  # up to the first comma outside brackets
    host = re.sub(r"\[(\d+)[-,\d]*\]", r"\1", first)  # each bracket's first number, zero padding kept
    if not host or "[" in host:
        raise ValueError(f"cannot read the first host of the SLURM hostlist {hostlist!r}; set MASTER_ADDR")
    return host


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds or timedelta, got: {timeout!r}")
    return datetime.timedelta(seconds=seconds)


# ------------------------------ The start: ranks meet, and say why when they cannot ----------
_FIRST_SAY = 3.0  # ranks of a good start begin seconds apart: a shorter wait says nothing
_SAY_EVERY = 15.0  # seconds between the lines of a wait that goes on
_CONNECT_WAIT = 5.0  # one connection attempt: no answer by then is said at once (a firewall, a wrong address)


class _Start:
    """One rank's start over TCP: reach rank 0's store, meet every rank, and check what must match before the
    backend connects. Every wait says what it waits for, on the rank that sees it; a wait that cannot end fails
    at once. Rank 0 alone reads what every rank wrote, and writes one verdict that every rank reads."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout: datetime.timedelta):
        self.rank, self.world, self.addr, self.port, self.timeout = rank, world, addr, port, timeout
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.host = socket.gethostname()

    def say(self, text: str) -> None:
        print(f"distributed.py: rank {self.rank} on {self.host}: {text}", file=sys.stderr, flush=True)

    def fail(self, text: str) -> RuntimeError:
        return RuntimeError(f"init_process_group: rank {self.rank} on {self.host}: {text}")

    def store(self, listen: bool) -> dist.Store:
        """Rank 0's store: listened on here (rank 0, where no agent holds one), else connected to."""
        try:
            found = socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise self.fail(f"MASTER_ADDR={self.addr!r} does not resolve here ({e.strerror}); set it to rank 0's "
                            f"IP address, or to a name every host resolves (`getent hosts {self.addr}` on each)"
                            ) from None
        ips = sorted({info[4][0] for info in found})
        if not listen:
            self._reach(ips)
            return dist.TCPStore(self.addr, self.port, is_master=False, timeout=self._left())
        if not any(_is_own_address(ip) for ip in ips):
            raise self.fail(f"MASTER_ADDR={self.addr} ({', '.join(ips)}) is another host; this host's addresses are "
                            f"{_listed(_addresses())}: every other rank would wait for it. Set MASTER_ADDR to one "
                            f"of this host's addresses, or start rank 0 on {self.addr}")
        try:
            return dist.TCPStore(self.addr, self.port, is_master=True, wait_for_workers=False, timeout=self.timeout)
        except (RuntimeError, ValueError) as e:
            raise self.fail(f"cannot listen on MASTER_PORT={self.port} ({str(e).splitlines()[0]}): another job or "
                            "a process of an earlier run holds it; choose another port") from None

    def _reach(self, ips: list[str]) -> None:
        """Return once rank 0 listens. A refusal or silence is said (rank 0 may still come); no route fails."""
        started, said, said_at = time.monotonic(), "", 0.0
        while True:
            attempt = max(min(_CONNECT_WAIT, self.deadline - time.monotonic()), 0.1)
            try:
                socket.create_connection((self.addr, self.port), timeout=attempt).close()
                return
            except ConnectionRefusedError:
                why = (f"{self.addr}:{self.port} refuses connections: the host answers but nothing listens on the "
                       "port (rank 0 not started yet, or started with another MASTER_PORT)")
            except TimeoutError:
                why = (f"no answer from {self.addr}:{self.port} in {attempt:.0f} s: packets are dropped (a "
                       f"firewall), or {self.addr} is not rank 0's address")
            except OSError as e:
                if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                    raise self.fail(f"no route to MASTER_ADDR={self.addr} ({', '.join(ips)}): {e.strerror}. This "
                                    f"host's addresses are {_listed(_addresses())}; set MASTER_ADDR to an address of "
                                    "rank 0's host that this host can reach (`ip route get ADDRESS` shows the way)"
                                    ) from None
                why = f"cannot connect to {self.addr}:{self.port}: {e.strerror or e}"
            now = time.monotonic()
            if now >= self.deadline:
                raise self.fail(f"rank 0 was not reached within the timeout ({self.timeout}): {why}")
            if now - started >= _FIRST_SAY and (why != said or now - said_at >= _SAY_EVERY):
                self.say(f"waiting for rank 0: {why}; trying until the timeout ({self.timeout})")
                said, said_at = why, now
            time.sleep(0.1)

    def meet(self, store: dist.Store, backend: str) -> None:
        """Every rank writes who and where it is; rank 0 waits for all, naming the missing, and writes whether
        they can work together; every rank reads that, so they all fail alike, in seconds, or none does."""
        me = _RankFacts.of_this_rank(backend, self.addr, self.port)
        store.set(f"rank{self.rank}", json.dumps(me._asdict()))
        store.add("joined", 1)
        if self.rank == 0:
            store.set("verdict", json.dumps(self._decide(store, backend)._asdict()))
        try:  # rank 0 decides at its own deadline at the latest: a little past this rank's
            store.wait(["verdict"], self._left() + datetime.timedelta(seconds=2 * _CONNECT_WAIT))
            verdict = _Verdict(**json.loads(store.get("verdict")))
        except RuntimeError:
            raise self.fail(f"rank 0 ({self.addr}:{self.port}) decided nothing within the timeout ({self.timeout}): "
                            "it stopped or died while this rank waited (its own output says why)") from None
        store.add("read", 1)
        if verdict.error:
            if self.rank == 0:  # its store ends with it: the others read the verdict first
                give_up = time.monotonic() + _CONNECT_WAIT
                while int(store.add("read", 0)) < int(store.add("joined", 0)) and time.monotonic() < give_up:
                    time.sleep(0.02)
            raise self.fail(verdict.error)
        if verdict.spans_hosts and backend == "gloo" and _is_loopback(me.gloo):
            # Safe: the verdict refused any loopback rank that has no route to offer or whose user chose lo.
            os.environ["GLOO_SOCKET_IFNAME"] = me.route[0]
            self.say(f"this host's name resolves to {me.gloo} (loopback), where gloo would listen, and the job "
                     f"spans hosts: using GLOO_SOCKET_IFNAME={me.route[0]} ({me.route[1]}), the interface that "
                     "routes to MASTER_ADDR; set GLOO_SOCKET_IFNAME yourself to choose")

    def _decide(self, store: dist.Store, backend: str) -> _Verdict:
        """Rank 0: wait for every rank, naming the missing every 15 s; then read what they wrote."""
        next_say = time.monotonic() + _FIRST_SAY
        while int(store.add("joined", 0)) < self.world:
            now = time.monotonic()
            if now >= self.deadline:
                return _Verdict(self._missing(store), spans_hosts=False)
            if now >= next_say:
                self.say(f"{self._missing(store, waiting=True)}; waiting until the timeout ({self.timeout})")
                next_say = now + _SAY_EVERY
            time.sleep(0.02)
        written = store.multi_get([f"rank{r}" for r in range(self.world)])
        ranks = [_RankFacts(**json.loads(text)) for text in written]
        spans = len({about.host_id for about in ranks}) > 1
        problems = _version_mismatches(ranks, backend) + _shared_gpus(ranks)
        problems += _unreachable_listeners(ranks, backend) if spans else []
        return _Verdict(" ".join(problems) or None, spans)

    def _missing(self, store: dist.Store, waiting: bool = False) -> str:
        missing = [r for r in range(self.world) if not store.check([f"rank{r}"])]
        text = (f"{self.world - len(missing)} of WORLD_SIZE={self.world} ranks joined; rank {_ranges(missing)} did "
                f"not (a host whose ranks never started, or WORLD_SIZE one too many)")
        return text if waiting else f"{text} within the timeout ({self.timeout})"

    def _left(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.deadline - time.monotonic(), 1.0))


class _RankFacts(NamedTuple):
    """What the ranks compare before the backend connects (each rank's, as JSON in the start's store)."""
    host: str
    host_id: str  # ranks with one host id reach each other over loopback
    torch: str
    cuda: str | None
    nccl: str | None  # under nccl only
    gloo: str  # the address gloo will listen on
    gloo_chosen: str | None  # GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME as the user set them
    nccl_chosen: str | None
    route: list[str] | None  # [interface, address] this host reaches MASTER_ADDR from
    addresses: str
    gpu: str | None  # under nccl, the UUID of this rank's GPU: two ranks of a host must not share one

    @classmethod
    def of_this_rank(cls, backend: str, master_addr: str, port: int) -> _RankFacts:
        addresses = _addresses()
        nccl, gpu = None, None
        if backend == "nccl":
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
            gpu = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", "")) or None
        return cls(socket.gethostname(), _host_id(), torch.__version__, torch.version.cuda, nccl,
                   _gloo_address(addresses), os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME"),
                   _route(master_addr, port, addresses), _listed(addresses), gpu)


class _Verdict(NamedTuple):
    """Rank 0's reading of every rank's facts, which every rank reads: an error all raise, or None."""
    error: str | None
    spans_hosts: bool


def _version_mismatches(ranks: list[_RankFacts], backend: str) -> list[str]:
    problems = []
    for what in ("torch", "nccl") if backend == "nccl" else ("torch",):
        versions: dict[str, list[int]] = {}
        for rank, about in enumerate(ranks):
            versions.setdefault(getattr(about, what), []).append(rank)
        if len(versions) > 1:
            found = "; ".join(f"{version} on rank {_ranges(members)} ({_hosts(ranks, members)})"
                              for version, members in versions.items())
            problems.append(f"the ranks run different {what} versions ({found}): install one version on every host")
    return problems


def _shared_gpus(ranks: list[_RankFacts]) -> list[str]:
    """Ranks of one host on one GPU, which NCCL refuses: told apart from ranks each shown a GPU of its own."""
    sharing: dict[tuple[str, str], list[int]] = {}
    for rank, about in enumerate(ranks):
        if about.gpu:
            sharing.setdefault((about.host_id, about.gpu), []).append(rank)
    return [f"rank {_ranges(members)} on {ranks[members[0]].host} would share one GPU ({gpu}), and NCCL refuses two "
            "ranks on one. Start at most one process per GPU on each host (torchrun --nproc_per_node, srun "
            "--ntasks-per-node or --gpus-per-task=1), show each rank its own (CUDA_VISIBLE_DEVICES per rank), or "
            "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run CPU processes"
            for (_, gpu), members in sharing.items() if len(members) > 1]


def _unreachable_listeners(ranks: list[_RankFacts], backend: str) -> list[str]:
    """In a job across hosts, the ranks whose backend would listen on loopback, which no other host reaches."""
    problems = []
    for rank, about in enumerate(ranks):
        where = f"rank {rank} on {about.host} ({about.addresses})"
        if backend == "gloo" and _is_loopback(about.gloo) and (about.gloo_chosen is not None or about.route is None):
            chosen = f"GLOO_SOCKET_IFNAME={about.gloo_chosen}" if about.gloo_chosen else "its host name"
            route = "the interface of an address the other hosts reach"
            if about.route:
                route = f"{about.route[0]}, which routes to MASTER_ADDR"
            problems.append(f"the job spans hosts, and {where} would listen for gloo on {about.gloo} (loopback, "
                            f"from {chosen}), which no other host reaches: set GLOO_SOCKET_IFNAME={route}")
        elif backend == "nccl" and _names_loopback(about.nccl_chosen or ""):
            problems.append(f"the job spans hosts, and {where} has NCCL_SOCKET_IFNAME={about.nccl_chosen} "
                            "(loopback): set it to the interface of an address the other hosts reach")
    return problems


def _names_loopback(ifname: str) -> bool:
    """Whether NCCL_SOCKET_IFNAME lets NCCL use loopback: a prefix ("lo"), an exact name ("=lo"), or one of a list;
    a list that excludes ("^lo,docker") never names it."""
    if ifname.startswith("^"):
        return False
    return any(name.lstrip("=").startswith("lo") for name in ifname.split(","))


def _is_own_address(ip: str) -> bool:
    """Whether ``ip`` is this host's: only a host's own address can be bound."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "")


def _addresses() -> dict[str, str]:
    """This host's IPv4 address on each interface, by name (Linux; empty elsewhere)."""
    found: dict[str, str] = {}
    if sys.platform != "linux":
        return found
    import fcntl
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                answer = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                found[name] = socket.inet_ntoa(answer[20:24])
    return found


def _listed(addresses: dict[str, str]) -> str:
    return ", ".join(f"{name} {ip}" for name, ip in addresses.items()) or "unknown"


def _gloo_address(addresses: dict[str, str]) -> str:
    """Where gloo will listen, as ProcessGroupGloo chooses: GLOO_SOCKET_IFNAME's interface, else the first address
    of this host's name that can be bound, else loopback."""
    if chosen := os.environ.get("GLOO_SOCKET_IFNAME"):
        return addresses.get(chosen.split(",")[0], "")
    try:
        found = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)]
    except OSError:
        found = []
    return next((ip for ip in found if _is_own_address(ip)), "127.0.0.1")


def _route(addr: str, port: int, addresses: dict[str, str]) -> list[str] | None:
    """[interface, address] this host sends from to reach ``addr`` (connecting a UDP socket sends nothing)."""
    try:
        ip = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, port))
            source = s.getsockname()[0]
    except OSError:
        return None
    name = next((name for name, own in addresses.items() if own == source), None)
    return None if name is None or _is_loopback(source) else [name, source]


def _host_id() -> str:
    """Ranks with one host id reach each other over loopback: one kernel (its boot id), one network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": a list of ranks short enough to read at any world size."""
    groups = itertools.groupby(enumerate(ranks), lambda pair: pair[1] - pair[0])
    spans = [[rank for _, rank in group] for _, group in groups]
    return ", ".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)


def _hosts(ranks: list[_RankFacts], members: list[int]) -> str:
    names = sorted({ranks[r].host for r in members})
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


# ------------------------------ Data ---------------------------------------------------------
class _Sampler(DistributedSampler):
    """DistributedSampler, able to start mid-epoch. pad=False: its permutation, every index exactly once
    across the ranks (it pads to ``total_size`` and checks ``num_samples``: the unpadded sizes reuse the rest)."""

    def __init__(self, dataset: Dataset, world: int, rank: int, *, shuffle: bool, seed: int, pad: bool):
        super().__init__(dataset, world, rank, shuffle=shuffle, seed=seed)
        self.skip = 0
        if not pad:
            self.total_size = len(dataset)
            self.num_samples = len(range(rank, self.total_size, world))

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        if not 0 <= skip <= self.num_samples:
            raise ValueError(f"set_epoch: skip must be between 0 and this rank's share of {self.num_samples} "
                             f"samples, got: {skip}")
        super().set_epoch(epoch)
        self.skip = skip
        if hasattr(self.dataset, "set_epoch"):  # seeded_dataset's: its per-sample seeds change with the epoch
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)  # indices only: nothing skipped is loaded

    def __len__(self) -> int:
        return self.num_samples - self.skip


def _refuse_iterable(dataset: Dataset, where: str) -> None:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(f"{where}: got an IterableDataset ({type(dataset).__name__}), which has no indices to shard. "
                        "Beside this file, sharded_stream.py has both ways: sharded_stream(shards, read, ...) deals "
                        "shards of records to the ranks and their loader workers (the same records each step at any "
                        "world size, exact resume); or shard it yourself in __iter__ and loop over "
                        "stop_together(loader): a rank that runs out first then leaves none waiting in an all-reduce")


def _unrepeatable(index: int, seeded: bool) -> str:
    if seeded:
        return (f"item {index} differs between two reads: your dataset draws from a generator seeded_dataset does "
                "not reseed (one it owns: an np.random.Generator, random.Random or torch.Generator, as "
                "albumentations >= 1.4.21 and MONAI keep). Seed it per item inside __getitem__ from "
                "torch.initial_seed(), the item's seed (seeded_dataset.py's docstring shows how)")
    return (f"item {index} differs between two reads: the data's items change from one read to the next (random "
            "augmentation from a global generator), so each rank, one process and a resumed run draw their own. "
            "Wrap the dataset with seeded_dataset(data, seed) (`from seeded_dataset import seeded_dataset`, the file "
            "beside distributed.py): each sample's randomness then depends only on (seed, epoch, index)")


def _same_item(a: Any, b: Any) -> bool:
    """Whether two reads of an item are equal: tensors and arrays element by element, containers item by item."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same_item, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_item(a[key], b[key]) for key in a)
    try:
        equal = a == b
        return bool(equal.all()) if hasattr(equal, "all") else bool(equal)  # numpy arrays, without numpy
    except Exception:
        return False


# ------------------------------ Collectives --------------------------------------------------
_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _reduce_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        return torch.float64
    if op == "sum" and dtype == torch.bool:
        return torch.int64
    return dtype


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """gloo has no int16 or bool arithmetic, and NCCL no int16; those travel as int32 / uint8, back exact."""
    return {torch.int16: torch.int32, torch.bool: torch.uint8}.get(dtype, dtype)


def _wire_device(backend: str, device: torch.device) -> torch.device:
    """Where a tensor must be for a collective: nccl moves CUDA tensors only ("cuda": the current GPU)."""
    return torch.device("cuda") if backend == "nccl" and device.type != "cuda" else device


def _all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's bytes in rank order, as tensors (lengths, then the bytes padded to the longest):
    torch's object collectives pickle through numpy, which torch does not install."""
    lengths = all_gather(len(data)).tolist()
    # From the buffer, not byte by byte (a large state saves fast); one byte more: frombuffer refuses an empty one.
    rows = all_gather(torch.frombuffer(bytearray(data.ljust(max(lengths) + 1, b"\0")), dtype=torch.uint8))
    return [bytes(row[:n].tolist()) for row, n in zip(rows, lengths, strict=True)]


# ------------------------------ Checkpoints --------------------------------------------------
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_WEIGHTS_ONLY_LEAVES = (torch.Tensor, int, float, complex, str, bytes, bool, type(None),
                        torch.dtype, torch.device, torch.Size)


def _strip_wrapper_prefixes(obj: Any) -> Any:
    """A state dict whose keys *all* carry a wrapper's prefix gets them removed (recursively)."""
    if not isinstance(obj, dict):
        return obj
    for prefix in _WRAPPER_PREFIXES * 2:  # DDP(compile(model)) or compile(DDP(model))
        if obj and all(isinstance(k, str) and k.startswith(prefix) for k in obj):
            obj = type(obj)((k[len(prefix):], v) for k, v in obj.items())
    return type(obj)((k, _strip_wrapper_prefixes(v)) for k, v in obj.items())


def _atomic_save(state: dict, path: str) -> None:
    # A temporary file of its own: two jobs saving to one path each leave a whole snapshot (the last
    # rename wins); with one fixed name, one job's rename took the other's file away.
    tmp = f"{path}.{os.getpid()}-{os.urandom(4).hex()}.tmp"
    try:
        with open(tmp, "xb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    except OSError as e:  # EINVAL: this filesystem cannot sync a directory (an SMB share), and the file is
        if e.errno != errno.EINVAL:  # saved: https://github.com/microsoft/WSL/issues/2557
            raise
    finally:
        os.close(directory)


def _corrupt(path: str, error: Exception) -> RuntimeError:
    return RuntimeError(f"cannot load the snapshot {path}: it is corrupt or truncated "
                        f"({type(error).__name__}: {error}); restore a good copy or delete it to start fresh")


# ============ The local launcher's supervisor: the processes launch() starts, their signals, =====
# ============ their deaths and their error reports (torchrun and srun do this themselves) =======
# ------------------------------ The job directory: each rank's channel to the launcher ----------
_JOB_DIR_ENV = "DISTRIBUTED_PY_JOB_DIR"  # set by launch() in its ranks: the job directory's path


class _RankFiles:
    """launch()'s private job directory, the one way a rank tells its launcher something: rank<r>.<kind>, written
    by the rank, read by the launcher (never half: written to a temporary name, then renamed; faulthandler writes
    the stacks itself). Kinds: "err" (the pickled report of the exception that ended the rank), "stack"
    (faulthandler's dumps: on request, and as the rank dies of a fatal signal), "progress" and "window"
    (report_progress's last lines), "backend" (the group's, for the hang report)."""

    def __init__(self, directory: str):
        self.dir = directory

    @classmethod
    def of_this_job(cls) -> _RankFiles | None:
        """The job directory of the launch() that started this process; None elsewhere (torchrun, srun)."""
        directory = os.environ.get(_JOB_DIR_ENV)
        if launch_mode() != "spawn" or not directory:
            return None
        return cls(directory)

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.dir, f"rank{rank}.{kind}")

    def write(self, rank: int, kind: str, data: str | bytes) -> None:
        path = self.path(rank, kind)
        with open(f"{path}.tmp", "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(f"{path}.tmp", path)

    def read(self, rank: int, kind: str) -> str:
        """The file's text; "" if the rank never wrote it."""
        with contextlib.suppress(OSError), open(self.path(rank, kind)) as f:
            return f.read()
        return ""

    def report(self, rank: int) -> _RankError | None:
        """The rank's exception report (_worker_entry's), or None."""
        with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError), open(self.path(rank, "err"), "rb") as f:
            return pickle.load(f)
        return None


# ------------------------------ The lifecycle: start, wait, stop ---------------------------------
class _Workers:
    """The processes of one local job started by launch(). Not torch.multiprocessing.spawn, which
    leaves workers running when the parent alone gets SIGINT or SIGKILL and reports whichever
    failure it sees first, often a collateral "connection closed". ``env`` adds to every worker's."""

    _GRACE_S = 0.5  # after SIGTERM, how long a worker may take before SIGKILL

    def __init__(self, worker: Callable[..., Any], nprocs: int, args: tuple, env: dict | None = None):
        self.dir = tempfile.mkdtemp(prefix="distributed-py-")
        self.files = _RankFiles(self.dir)
        self.started = time.time()  # NCCL flight-recorder dumps older than this are another job's
        self.processes: list[mp.Process] = []
        self.store = None
        self._ended: set[int] = set()  # ranks _end() has seen exit: a session is killed at most once
        try:
            with stop_signals_blocked():  # the forkserver the workers come from must outlive a group's signal
                self._start(worker, nprocs, args, env)
        except BaseException:
            self.close()
            raise

    def _start(self, worker: Callable[..., Any], nprocs: int, args: tuple, env: dict | None) -> None:
        init_method, self.store = _local_rendezvous(self.dir)
        ctx = _start_context()
        omp = os.environ.get("OMP_NUM_THREADS", "")
        threads = max(int(omp) if omp.isdigit() else _usable_cpus() // nprocs, 1)
        for rank in range(nprocs):
            rank_env = _spawn_env(rank, nprocs, init_method, threads) | {_JOB_DIR_ENV: self.dir} | (env or {})
            p = ctx.Process(target=_worker_entry, name=f"rank{rank}", daemon=False,
                            args=(worker, rank, nprocs, args, rank_env, os.getpid()))
            p.start()
            self.processes.append(p)

    def join(self, stopping: _Stopping | None = None) -> None:
        """Wait for every rank; on the first failure stop the rest and raise the root cause. A rank that exits
        with a stop's code, or dies of a signal ``stopping`` forwarded, did not fail; one that ``stopping`` had to
        kill after its grace did: its unsaved work is lost. start_workers' callers join with no forwarder."""
        stopping = stopping or _Stopping(grace=0.0)
        pending = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                rank = pending.pop(sentinel)
                self._end(rank)
                if not self.failed(rank, stopping):
                    continue
                if rank in stopping.killed:
                    raise _killed_after_grace(self, stopping)
                evidence = _evidence(self, rank, stopping)  # before the others are stopped
                self._stop_all()
                raise _root_cause(self, evidence, killed_at=time.time())

    def failed(self, rank: int, stopping: _Stopping) -> bool:
        """Whether an exited rank failed: not 0, not a stop's exit code, not a signal ``stopping`` forwarded."""
        code = self.processes[rank].exitcode
        forwarded = -code in stopping.received and rank not in stopping.killed
        return code != 0 and code not in _STOP_EXITS and not forwarded

    def close(self) -> None:
        """Terminate every live worker (SIGTERM, then SIGKILL after a grace period); idempotent."""
        self._stop_all()
        self.store = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_all(self) -> None:
        """SIGTERM every live rank, SIGKILL those still alive after _GRACE_S, then _end() each."""
        alive = [p for p in self.processes if p.is_alive()]
        for p in alive:
            p.terminate()  # SIGTERM; a process that has exited meanwhile is skipped
        deadline = time.monotonic() + self._GRACE_S
        for p in alive:
            p.join(max(deadline - time.monotonic(), 0))
            if p.is_alive():
                p.kill()
        for rank, p in enumerate(self.processes):
            if p.pid is not None:
                self._end(rank)

    def _end(self, rank: int) -> None:
        """Wait for a rank that has exited; if a signal killed it, SIGKILL what is left of its session (see
        _worker_entry). A DataLoader worker whose rank died before the worker's loop began takes init for its
        parent, so never sees the death: it would run forever, holding the launcher's output open. At once and
        once: the session's number could be another's long after it emptied. A rank that exited ran Python's
        exit, which ends its loader workers; what else it leaves running (an upload, say) is its own, as
        under torchrun."""
        p = self.processes[rank]
        p.join()
        if rank not in self._ended and p.exitcode < 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        self._ended.add(rank)


def _start_context() -> Any:
    """forkserver: it imports torch once and forks every worker from that clean state; each imports the
    main script afresh, as mp.spawn's do, whatever threads the launcher has. (A fork of a launcher whose
    OpenMP threads exist hangs at its first parallel op: https://gcc.gnu.org/bugzilla/show_bug.cgi?id=60035)"""
    # Its socket is $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX: over AF_UNIX's 107 bytes (a long TMPDIR on a cluster),
    # Python < 3.13 fails with "AF_UNIX path too long" (python/cpython#132124). spawn needs no socket.
    if "forkserver" not in mp.get_all_start_methods() or len(tempfile.gettempdir()) + 32 > 107:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    return ctx


def _worker_entry(worker: Callable[..., Any], rank: int, nprocs: int, args: tuple,
                  env: dict[str, str], parent_pid: int) -> None:
    """The main of a process spawned by launch(): run the worker, record any error, exit non-zero."""
    # Its own session, as torchrun's agent gives each rank: what it starts (DataLoader workers) can be ended with
    # it (_Workers._end), and Ctrl-C in a terminal reaches the launcher alone, which stops every rank.
    os.setsid()
    gc.freeze()  # torch's many objects live as long as this process: no full collection need scan them
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked in the forkserver (see _Workers)
    # SIGINT sent to every process (scancel --signal=INT) is the launcher's too: N KeyboardInterrupt tracebacks
    # would bury its report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forkserver child inherits it as the default start method: back to the platform's, as under torchrun
    # and srun, so DataLoader workers fork from this rank and inherit its stop-signal recorder.
    multiprocessing.set_start_method(None, force=True)
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    files = _RankFiles(env[_JOB_DIR_ENV])
    stack_file = open(files.path(rank, "stack"), "w")  # noqa: SIM115 (open until the process ends)
    _prepare_rank(_launcher_env(), stack_file, parent_pid)
    try:
        worker(rank, nprocs, *args)
    except Exception as e:
        pickled = None
        with contextlib.suppress(Exception):
            pickle.loads(pickle.dumps(e))
            pickled = pickle.dumps(e)
        report = _RankError(time.time(), rank, type(e).__qualname__, str(e), traceback.format_exc(), pickled)
        files.write(rank, "err", pickle.dumps(report))
        # This is the process's main, not library code: the exit code tells the parent to look.
        raise SystemExit(1) from None


def _prepare_rank(env: _Launcher, stack_file: Any = None, launcher_pid: int | None = None) -> None:
    """What a rank sets up once, under any launcher (launch()'s ranks as they start, the others as they join): a
    name ps shows, death with its launcher, its stacks on SIGQUIT (for launch()'s, into the job directory, where
    the launcher collects them, also as it dies of a fatal signal: NCCL's watchdog), srun's CPUs as its threads."""
    _name_process(f"r{env.rank}")
    if env.mode in ("torchrun", "spawn"):  # a SIGKILLed launcher must not leave its ranks running
        _die_with_parent(launcher_pid)
    if stack_file is None:  # `kill -QUIT <pid>` prints where this rank is
        faulthandler.register(_STACK_SIGNAL, all_threads=True)
    else:
        faulthandler.register(_STACK_SIGNAL, stack_file, all_threads=True)
        faulthandler.enable(stack_file, all_threads=True)
    if env.mode == "slurm" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(_slurm_threads())  # unlike torchrun, srun sets no OMP_NUM_THREADS


def _local_rendezvous(workdir: str) -> tuple[str, Any]:
    """(init_method, a store the parent keeps alive or None): a FileStore in the job's private
    directory, so no port to race for; with an explicit MASTER_PORT, a TCPStore held by the parent."""
    port = os.environ.get("MASTER_PORT")
    if not port:
        return f"file://{os.path.join(workdir, 'store')}", None
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        store = dist.TCPStore(addr, int(port), is_master=True, wait_for_workers=False)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"launch: cannot listen on MASTER_ADDR={addr} MASTER_PORT={port} ({e}); the port is "
            "busy or invalid: unset MASTER_PORT to rendezvous without a port, or choose a free one"
        ) from e
    return "env://", store


def _spawn_env(rank: int, nprocs: int, init_method: str, threads: int) -> dict[str, str]:
    """What a spawned rank sees: torchrun's variables, so user code reading RANK etc. just works."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
           "LOCAL_WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": str(threads),
           _INIT_METHOD_ENV: init_method}
    if init_method == "env://":  # explicit MASTER_PORT: connect to the store the parent holds
        env |= {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if sys.platform == "linux":  # a local job's connections (gloo's, NCCL's bootstrap) stay on loopback
        env |= {name: "lo" for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in os.environ}
    return env


def _die_with_parent(launcher_pid: int | None = None) -> None:
    """SIGKILL this process when its launcher dies: the parent-death signal when the launcher is the
    parent (torchrun's agent); a worker of launch()'s forkserver, which outlives the launcher while
    any worker holds its "alive" pipe, also watches the launcher's pidfd."""
    if not _prctl(1, signal.SIGKILL):  # 1: PR_SET_PDEATHSIG
        return
    if launcher_pid in (None, os.getppid()):
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        return
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # already gone
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return  # no pidfd (old kernel): the parent-death signal alone
    # A pidfd becomes readable when its process exits.
    threading.Thread(target=lambda: select.select([pidfd], [], []) and os.kill(os.getpid(), signal.SIGKILL),
                     name="exit-with-launcher", daemon=True).start()


def _prctl(option: int, arg: int | bytes) -> bool:
    """Linux's prctl(2) for this process; False where there is none (other systems) or it fails."""
    if sys.platform != "linux":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ------------------------------ Stops: the signals launch() forwards -----------------------------
class _Stopping:
    """What launch()'s handler of the stop signals did: the signals it forwarded, the ranks it killed after the
    grace (they had not exited: their unsaved work is lost)."""

    def __init__(self, grace: float):
        self.grace = grace
        self.received: list[int] = []
        self.killed: list[int] = []


@contextlib.contextmanager
def _forwarding_stop_signals(workers: _Workers, grace: float) -> Iterator[_Stopping]:
    """While the workers run, a stop signal goes on to each of them, and SIGKILL ``grace`` seconds after
    the first; the launcher's own handlers come back afterwards."""
    stopping = _Stopping(grace)
    if threading.current_thread() is not threading.main_thread():
        yield stopping  # signal handlers can only be installed in the main thread
        return
    processes = workers.processes

    def kill_the_rest() -> None:
        stopping.killed += [rank for rank, p in enumerate(processes) if p.exitcode is None]
        for rank in stopping.killed:
            processes[rank].kill()

    deadline = threading.Timer(grace, kill_the_rest)
    deadline.daemon = True

    def forward(signum: int, frame: Any) -> None:
        stopping.received.append(signum)
        for p in processes:
            with contextlib.suppress(ProcessLookupError):
                if p.exitcode is None:  # a reaped worker's pid may be someone else's by now
                    os.kill(p.pid, signum)
        if len(stopping.received) == 1:
            deadline.start()

    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        yield stopping
    finally:
        deadline.cancel()
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _end_as_stopped(workers: _Workers, stopping: _Stopping) -> None:
    """The launcher's end once no rank failed and every worker is gone: a launcher sent a stop signal dies of it,
    as its sender expects (exit code 128 + its number); one whose ranks stopped at a signal of their own (and
    saved) exits with their code. A rank that failed never gets here: its error is the launcher's."""
    if stopping.received:
        shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)  # dying skips atexit
        signal.raise_signal(stopping.received[0])
    if stopped := [p.exitcode for p in workers.processes if p.exitcode in _STOP_EXITS]:
        raise SystemExit(stopped[0])


# ------------------------------ The failure report: the root cause, not the collateral -----------
_TIMED_OUT = r"Timed out|timed out|Timeout"
# A peer vanished or timed out: what the surviving ranks see when another rank fails first.
_COLLATERAL = (r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|Socket Timeout|Timed out waiting|timed out|"
               r"peer rank \d+ \(pid \d+\) exited")


class _RankError(NamedTuple):
    """The exception that ended one of launch()'s ranks, as the rank records it for the launcher (rank<r>.err)."""
    time: float
    rank: int
    type: str  # the exception's class, qualified
    message: str
    traceback: str
    exception: bytes | None  # the exception itself, pickled, where it pickles: the launcher re-raises it as is

    @property
    def collateral(self) -> bool:
        """Whether it only says that a peer went away or timed out: what the others see when a rank fails first."""
        return bool(re.search(_COLLATERAL, self.traceback))


class _Evidence(NamedTuple):
    """What the launcher gathers at the first failure it sees, before it stops the other ranks."""
    first: int  # the failed rank it saw first
    seen_at: float
    failed: list[int]  # every rank exited failing by then: a slowed launcher sees exits at once, in any order
    stacks: dict[int, str] | None  # every rank's stacks where a collective timed out, else None


def _evidence(workers: _Workers, first: int, stopping: _Stopping) -> _Evidence:
    seen_at = time.time()
    report = workers.files.report(first)
    if report is not None and report.collateral:
        # gloo closes a failing rank's connections before its exception reaches Python: the rank that failed
        # first may still be writing its report, and a busy machine can report the exit of a rank killed by a
        # signal after its peers'. A moment for every rank to exit.
        deadline = time.monotonic() + 1.0
        for p in workers.processes:
            p.join(max(deadline - time.monotonic(), 0))
    failed = [rank for rank, p in enumerate(workers.processes)
              if p.exitcode is not None and workers.failed(rank, stopping)]
    reports = [report for report in map(workers.files.report, range(len(workers.processes))) if report]
    # Any rank's timeout counts: the first to exit may be one that then lost its peer.
    timed_out = any(p.exitcode == -signal.SIGABRT for p in workers.processes) or \
        any(re.search(_TIMED_OUT, report.traceback) for report in reports)
    stacks = _stacks(workers.processes, workers.files) if timed_out else None
    return _Evidence(first, seen_at, failed, stacks)


def _root_cause(workers: _Workers, evidence: _Evidence, killed_at: float) -> BaseException:
    """The failure to report: every rank that raised, or exited failing, before the job was stopped competes. A
    rank that raised or died first is the root cause; errors that only say a peer went away ("connection
    closed") are what the *other* ranks see, so they rank last."""
    processes, files = workers.processes, workers.files
    reports = {rank: files.report(rank) for rank in range(len(processes))}
    competing = []  # (collateral, time, rank, report or None)
    for rank, report in reports.items():
        if report is not None and report.time <= killed_at:
            competing.append((report.collateral, report.time, rank, report))
        elif rank == evidence.first:
            competing.append((False, evidence.seen_at, rank, None))
        elif rank in evidence.failed:  # died without a report (a signal, a crash in C): seen after the first
            competing.append((False, killed_at, rank, None))
    collateral, _, rank, report = min(competing, key=lambda failure: failure[:3])
    if report is None:
        error = _exit_error(workers, rank)
    else:
        error = _exception_from(report, located=evidence.stacks is not None)
    finished = [r for r, p in enumerate(processes) if p.exitcode == 0]
    if collateral and finished:
        error.add_note(f"rank(s) {finished} had already finished (exit code 0) while rank {rank} still "
                       "called a collective: every rank must run the same collectives (the same number of "
                       "batches)")
    # The job's backend as its ranks wrote it: the launcher's own view of the GPUs says nothing of it.
    nccl = any(files.read(r, "backend") == "nccl" for r in range(len(processes)))
    if evidence.stacks is not None:  # a collective timed out: where was each rank?
        tracebacks = {r: report.traceback for r, report in reports.items() if report is not None}
        error.add_note(_where_ranks_are(evidence.stacks, tracebacks, nccl=nccl))
        if window := files.read(0, "window"):  # a monitor's last verdict (slow_rank.py): who held the others back
            error.add_note(f"The last window before it, on rank 0: {window}")
    if nccl and (dumps := _flight_recorder_dumps(len(processes), workers.started)):
        error.add_note(f"NCCL's flight recorder wrote each rank's last collectives (pickles): {', '.join(dumps)}")
    return error


_SIGNAL_HINTS = {
    "SIGKILL": " (the OOM killer sends SIGKILL: check memory, e.g. dmesg)",
    "SIGABRT": " (under nccl, NCCL's watchdog aborts a rank whose collective timed out: another rank is probably "
               "stuck; else a crash in C++: see the rank's stderr)",
}


def _exit_error(workers: _Workers, rank: int) -> WorkerFailed:
    """A rank that died without a Python exception; one killed by a fatal signal is placed by the stacks
    faulthandler wrote as it died (kept in a file of their own: the job's directory is deleted)."""
    exitcode = workers.processes[rank].exitcode
    if exitcode >= 0:
        return WorkerFailed(f"rank {rank} exited with code {exitcode} without a Python exception", rank)
    name = signal.Signals(-exitcode).name
    message = f"rank {rank} was killed by signal {name}{_SIGNAL_HINTS.get(name, '')}"
    if progress := workers.files.read(rank, "progress"):
        message += f" ({progress})"
    stack = workers.files.read(rank, "stack")
    frames = _user_frames(stack)[1]
    if frames:
        message += f"; it was at {_place(frames)} (its stacks: {_keep_stacks({rank: stack})})"
    return WorkerFailed(message, rank)


def _killed_after_grace(workers: _Workers, stopping: _Stopping) -> WorkerFailed:
    for p in workers.processes:
        p.join()  # the deadline killed them all at once
    lost = "; ".join(f"rank {rank}: {workers.files.read(rank, 'progress') or 'it reported no snapshot'}"
                     for rank in stopping.killed)
    return WorkerFailed(f"rank(s) {stopping.killed} had not exited {stopping.grace:g} s after "
                        f"{signal.Signals(stopping.received[0]).name} and were killed: what they did since "
                        f"their last snapshot is lost ({lost}). Stop sooner (a Checkpointer checks about every "
                        "second), save faster, or give launch() a longer grace", stopping.killed[0])


class _ScriptUnpickler(pickle.Unpickler):
    """Workers know the main script as __mp_main__: ``except MyError`` around launch() catches theirs."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class("__main__" if module == "__mp_main__" else module, name)


def _exception_from(report: _RankError, located: bool = False) -> BaseException:
    """The rank's exception itself where it unpickles (else a WorkerFailed naming it), its traceback as a note."""
    note = f"\n[rank {report.rank}] failed first; its traceback:\n{report.traceback.rstrip()}"
    if re.search(_TIMED_OUT, report.traceback) and not located:
        note += ("\nA collective timed out: another rank is probably stuck (or slower than the timeout;"
                 " raise it with init_process_group(..., timeout=seconds)).")
    try:
        error = _ScriptUnpickler(io.BytesIO(report.exception)).load()
    except Exception:
        error = WorkerFailed(f"rank {report.rank} raised {report.type}: {report.message}", report.rank)
    with contextlib.suppress(AttributeError):
        error.rank = report.rank
    error.add_note(note)
    return error


# ------------------------------ The hang report: where each rank was ---------------------------
_STACK_SIGNAL = signal.SIGQUIT  # faulthandler's stack dump; kill -QUIT <pid> shows a rank's stack


def _stacks(processes: list, files: _RankFiles) -> dict[int, str]:
    """Every live rank's Python stacks, dumped by faulthandler on _STACK_SIGNAL (from C, so also
    while C code holds the GIL; a rank that does not answer within a second is left out), and those
    faulthandler wrote as a rank died of a fatal signal (SIGABRT: NCCL's watchdog)."""
    stacks = {rank: files.read(rank, "stack") for rank, p in enumerate(processes) if p.exitcode is not None}
    live = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for rank in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[rank].pid, _STACK_SIGNAL)
    deadline = time.monotonic() + 1.0
    while not all(stacks.get(rank) for rank in live) and time.monotonic() < deadline:
        time.sleep(0.1)  # a dump takes milliseconds: after 0.1 s a non-empty file is whole
        stacks.update({rank: files.read(rank, "stack") for rank in live})
    return {rank: text for rank, text in stacks.items() if text or rank in live}


def _where_ranks_are(stacks: dict[int, str], tracebacks: dict[int, str], nccl: bool = False) -> str:
    """Each rank's place when a collective timed out, from its stack (alive) or its traceback (raised):
    waiting in a collective, raised, or not in one (it never reached it), the innermost frames of the user's
    code first. Under nccl (``nccl``: the job's backend) a collective on CUDA tensors returns before it
    completes and the rank blocks at its next synchronizing call: a place outside one is only where it blocked."""
    texts, raised = {}, set()
    for rank in sorted(stacks.keys() | tracebacks.keys()):
        stack, tb = stacks.get(rank, ""), tracebacks.get(rank, "")
        # A rank caught exiting after its own timeout has no frame of the user's left: its traceback places it.
        if stack and (not tb or _user_frames(stack)[1]):
            texts[rank] = stack
        else:
            texts[rank] = tb
            raised.add(rank)
    path = _keep_stacks(texts)
    lines, waits = [f"Where each rank was when the collective timed out (every stack: {path}):"], {}
    for rank, text in sorted(texts.items()):
        called, frames = _user_frames(text)
        if not text:
            lines.append(f"  rank {rank}: did not answer within 1 s (stopped, or blocked in the kernel)")
        elif called:
            waits[rank] = (called, *frames[0][:2])  # the collective, and the user's file and line
            lines.append(f"  rank {rank}: waiting in {called}(), at {_place(frames)}")
        elif not frames:
            lines.append(f"  rank {rank}: exiting, past your code (none of its frames is yours)")
        elif rank in raised:
            lines.append(f"  rank {rank}: raised at {_place(frames)}")
        elif nccl:
            lines.append(f"  rank {rank}: blocked outside a collective call, at {_place(frames)}; under nccl a rank "
                         "waits for an earlier collective at its next synchronizing call (.item(), .tolist(), a "
                         "copy to the CPU), so it may have reached one")
        else:
            lines.append(f"  rank {rank}: not in a collective (it never reached it), at {_place(frames)}")
    if len({called for called, *_ in waits.values()}) > 1:
        lines.append("  The ranks wait in different collectives, or in the same ones in a different order: every "
                     "rank must call the same collectives in the same order")
    called, file, line = waits.get(0, ("", "", "0"))
    if called and any(waits.get(r, ("",))[0] != called for r in texts) and _in_primary_only_branch(file, line):
        lines.append(f"  {called}() on rank 0 is a collective inside a primary-only branch (`if is_primary():`):"
                     " every rank must call it; move it out of the branch")
    return "\n".join(lines)


def _flight_recorder_dumps(world: int, since: float) -> list[str]:
    """The dumps NCCL's flight recorder wrote for this job's ranks (on a watchdog timeout, where its trace buffer
    is on): the prefix + the rank, newer than ``since``."""
    found = []
    for rank in range(world):
        with contextlib.suppress(OSError):
            if os.stat(f"{_flight_recorder_prefix()}{rank}").st_mtime >= since:
                found.append(f"{_flight_recorder_prefix()}{rank}")
    return found


def _flight_recorder_prefix() -> str:
    """Where NCCL's flight recorder dumps a rank's last collectives, the rank appended: torch's newer variable,
    then its older one, then their default."""
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or \
        "/tmp/nccl_trace_rank_"


def _keep_stacks(texts: dict[int, str]) -> str:
    """Write every rank's stacks to a file that outlives the job; its path."""
    fd, path = tempfile.mkstemp(prefix="distributed-py-stacks-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.writelines(f"--- rank {rank}\n{text}\n" for rank, text in sorted(texts.items()))
    return path


def _place(frames: list[tuple[str, str, str]]) -> str:
    """The innermost three frames of the user's code: ``train.py:42 in evaluate <- train.py:30 in main``."""
    return " <- ".join(f"{os.path.basename(file)}:{line} in {function}" for file, line, function in frames[:3])


_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
# This project's files, beside this one: their frames are never "your code" in a report.
_LIBRARY_FILES = ("distributed.py", "checkpointer.py", "ddp_check.py", "shared_memory_allreduce.py",
                  "seeded_dataset.py", "sync_batchnorm.py", "sharded_stream.py", "slow_rank.py")
# This project's functions that wait for every rank: a rank inside one is waiting for its peers.
_COLLECTIVE_HELPERS = ("reduce", "all_gather", "barrier", "_all_gather_bytes", "_gather_to_primary", "stop_requested")
# Where a rank waiting for its peers has Python frames: torch.distributed's calls, DDP's forward.
_COMMUNICATION = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}")


def _user_frames(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """From a faulthandler dump or a traceback, the main thread's frames of the user's code, innermost
    first, as (file, line, function), and the collective the innermost of them waits in ("" if none)."""
    main = [b for b in text.split("\n\n") if "File" in b and "_bootstrap_inner" not in b][-1:] or [""]
    frames = _FRAME.findall(main[0])[:: 1 if "(most recent call first)" in main[0] else -1]
    stdlib = sysconfig.get_paths()["stdlib"]
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [i for i, (file, _, _) in enumerate(frames)
            if not (f"{os.sep}torch{os.sep}" in file or file.startswith((stdlib, "<"))
                    or os.path.dirname(os.path.abspath(file)) == here and os.path.basename(file) in _LIBRARY_FILES)]
    if not ours:
        return "", []
    return _collective(frames[:ours[0]]), [frames[i] for i in ours]


def _collective(inner: list[tuple[str, str, str]]) -> str:
    """The collective that the frames below the user's innermost line (innermost first) wait in, "" if none:
    a call of this project's that reaches torch.distributed or DDP (reduce, a Checkpointer's step), a
    torch.distributed call (all_reduce), DDP's forward, or a backward (DDP all-reduces the gradients from
    autograd's threads, which have no Python frame)."""
    if not inner:
        return ""
    file, _, called = inner[-1]
    if called == "backward":
        return called
    # Inside one of this project's collective helpers: waiting, whatever is below it. Under nccl the collective
    # returns once queued, and the rank blocks (and the watchdog's SIGABRT finds it) in the helper's copy back to
    # the CPU, below no torch.distributed frame.
    if any(os.path.basename(file) in _LIBRARY_FILES and function in _COLLECTIVE_HELPERS
           for file, _, function in inner):
        return called
    communicating = [function for file, _, function in inner if file.endswith(".py") and
                     any(part in file for part in _COMMUNICATION)]
    if not communicating:
        return ""
    if os.path.basename(file) in _LIBRARY_FILES and f"{os.sep}torch{os.sep}" not in file:
        return called
    if any(f"{os.sep}nn{os.sep}parallel{os.sep}" in file for file, _, _ in inner):
        return "DistributedDataParallel.forward"
    return next((function for function in communicating if function != "wrapper"), communicating[0])


def _in_primary_only_branch(file: str, line: str) -> bool:
    """Whether this line sits under an `if` that tests for the primary rank (within 30 lines above)."""
    text = linecache.getline(file, int(line))
    indent = len(text) - len(text.lstrip())
    for n in range(int(line) - 1, max(int(line) - 30, 0), -1):
        above = linecache.getline(file, n)
        if above.strip() and len(above) - len(above.lstrip()) < indent:
            return above.lstrip().startswith("if") and bool(re.search(r"is_primary|rank\(?\)? *== *0", above))
    return False
