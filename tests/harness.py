"""The equivalence harness: models, data, the tasks the worker pools run, and helpers for real processes.

Starting a process that imports torch costs 1-3 s here, so each world size gets one pool of real
processes (ddp_check.worker_pools: started as launch() starts its workers, with a gloo group each)
shared by every test and by ddp_check itself. Hypothesis generates examples in the parent (it cannot
shrink across processes); the workers run the ``task_*`` functions below on every rank (by name:
they import this module) and return tensors; the parent computes the 1-process reference and
asserts. A failing or hung task gets every rank's error, and its pool is restarted on next use.
conftest.py holds the pytest side: the Hypothesis profiles and the ``pools`` fixture.
"""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import queue
import re
import runpy
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import distributed
import forked_python
from ddp_check import assert_ddp_equivalent
from shared_memory_allreduce import shared_memory_allreduce

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: the library, the example
SCRIPTS = Path(HERE, "tests", "rank_scripts")  # the programs the tests run as processes (ranks, launchers, drivers)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")  # conftest.py loads it


def examples(n: int) -> int:
    """How many examples a property runs: n in CI, 5n in the dev profile."""
    return n * (5 if PROFILE == "dev" else 1)


# ---------------------------------------------------------------------------------------------
# Models and data (float64: property tests compare with tight tolerances)
# ---------------------------------------------------------------------------------------------
FEATURES, CLASSES, IMAGE, VOCAB, SEQ = 5, 3, 6, 11, 6


class TinyLM(nn.Module):
    """A causal transformer language model: token + position embeddings, one block, a head."""

    def __init__(self, width: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(SEQ, width)
        self.block = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width,
                                                dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.block(h, src_mask=self.mask, is_causal=True))


def build_model(kind: str, width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, CLASSES))
    elif kind == "conv":
        model = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(width * IMAGE * IMAGE, CLASSES))
    elif kind == "bn":
        model = nn.Sequential(nn.Linear(FEATURES, width), nn.BatchNorm1d(width), nn.ReLU(),
                              nn.Linear(width, CLASSES))
    elif kind == "lm":
        model = TinyLM(2 * width)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    return model.double()


def build_data(kind: str, n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    if kind == "lm":
        tokens = torch.randint(VOCAB, (n, SEQ + 1), generator=gen)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    shape = (n, 1, IMAGE, IMAGE) if kind == "conv" else (n, FEATURES)
    return TensorDataset(torch.randn(shape, generator=gen, dtype=torch.float64),
                         torch.randint(CLASSES, (n,), generator=gen))


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


def batch_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """loss_fn in ddp_check's form: (model, batch) -> the batch's mean loss."""
    return loss_fn(model, *batch)


def optimizer_for(name: str, lr: float, params: Any) -> torch.optim.Optimizer:
    """The optimizer named "sgd", "momentum" or "adam": ddp_check's make_optimizer with name and lr bound."""
    return {"sgd": torch.optim.SGD, "momentum": functools.partial(torch.optim.SGD, momentum=0.9),
            "adam": torch.optim.Adam}[name](params, lr=lr)


def hook_shared_memory(ddp: DDP) -> None:
    """after_ddp for ddp_check: shared_memory_allreduce, which must take over whenever world > 1."""
    hooked = shared_memory_allreduce(ddp)
    assert hooked == (distributed.get_world_size() > 1), f"shared_memory_allreduce returned {hooked}"


def check_training(spec: dict, world: int, rtol: float) -> None:
    """ddp_check on these models and data: N ranks through DDP against one process on the union of their
    batches (with ``accum`` micro-batches a step, all but the last under no_sync); AssertionError at the first
    divergence, or when a micro-step other than the last all-reduced."""
    assert_ddp_equivalent(
        functools.partial(build_model, spec["kind"], spec["width"], spec["model_seed"]),
        functools.partial(build_data, spec["kind"], spec["n"], spec["data_seed"]), batch_loss,
        make_optimizer=functools.partial(optimizer_for, spec["optim"], spec["lr"]), world_sizes=(world,),
        steps=spec["steps"], batch_size=spec["batch"], seed=spec["data_seed"], accum=spec["accum"],
        after_ddp=hook_shared_memory if spec["allreduce"] == "shared-memory" else None, rtol=rtol)


@contextlib.contextmanager
def one_thread():
    """The 1-process reference runs with one thread, like each pool worker: same kernels, same sums."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def param_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def grad_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()]).clone()


def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
              steps: int, accum: int) -> dict:
    """``steps`` optimizer steps of ``accum`` micro-batches each; the parameters after every step.

    Under DDP all micro-batches but the last of a step run under no_sync(): no all-reduce.
    Also returns the gradient after the very first micro-batch (local under no_sync).
    """
    batches = iter(loader)
    params, first_grad = [], None
    for _ in range(steps):
        for micro in range(accum):
            x, y = next(batches)
            local = micro < accum - 1 and isinstance(model, DDP)
            with model.no_sync() if local else contextlib.nullcontext():
                (loss_fn(model, x, y) / accum).backward()
            if first_grad is None:
                first_grad = grad_vector(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params.append(param_vector(model))
    return {"params": params, "first_grad": first_grad}


def train_loader(spec: dict, batch_size: int) -> DataLoader:
    """The data through the project's data_sampler: this rank's shard, or all of it in one process."""
    data = build_data(spec["kind"], spec["n"], spec["data_seed"])
    sampler = distributed.data_sampler(data, True, spec["shuffle"], seed=spec["data_seed"])
    sampler.set_epoch(spec["epoch"])
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


# ---------------------------------------------------------------------------------------------
# Tasks: run on every rank of a pool (module-level so spawn can pickle them by reference)
# ---------------------------------------------------------------------------------------------


def task_train(spec: dict) -> dict:
    """spec["allreduce"]: "gloo" (DDP's own) or "shared-memory" (shared_memory_allreduce.py);
    spec["bucket_cap_mb"]: DDP's bucket size (tiny: one bucket per parameter)."""
    model = DDP(build_model(spec["kind"], spec["width"], spec["model_seed"]),
                bucket_cap_mb=spec.get("bucket_cap_mb"))
    if spec.get("allreduce") == "shared-memory":
        hooked = shared_memory_allreduce(model)
        assert hooked == (distributed.get_world_size() > 1), f"shared_memory_allreduce returned {hooked}"
    optimizer = optimizer_for(spec["optim"], spec["lr"], model.parameters())
    loader = train_loader(spec, spec["batch"])
    return run_steps(model, optimizer, loader, spec["steps"], spec["accum"])


def task_grads(spec: dict) -> torch.Tensor:
    """One backward through DDP on this rank's explicit indices; the (averaged) gradient."""
    rank = distributed.get_rank()
    model = DDP(build_model(spec["kind"], spec["width"], spec["model_seed"]))
    data = build_data(spec["kind"], spec["n"], spec["data_seed"])
    x, y = data[spec["indices"][rank]]
    (loss_fn(model, x, y, spec["reduction"]) * spec["scale"][rank]).backward()
    return grad_vector(model)


def task_sampler(spec: dict) -> list[list[int]] | str:
    """This rank's indices for each epoch, or the error data_sampler raised."""
    data = TensorDataset(torch.arange(spec["n"]))
    try:
        sampler = distributed.data_sampler(data, True, spec["shuffle"], pad=spec["pad"], seed=spec["seed"])
    except ValueError as e:
        return f"ValueError: {e}"
    out = []
    for epoch in spec["epochs"]:
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(out[-1]) == len(sampler), "len(sampler) disagrees with what it yields"
    return out


def task_reduce(spec: dict) -> dict:
    value = spec["values"][distributed.get_rank()]
    before = value.clone() if isinstance(value, torch.Tensor) else value
    result = distributed.reduce(value, spec["op"])
    untouched = torch.equal(value, before) if isinstance(value, torch.Tensor) else value == before
    return {"result": result, "untouched": untouched, "is_new": result is not value}


def task_identity(spec: dict) -> dict:
    return {"rank": distributed.get_rank(), "world": distributed.get_world_size(),
            "primary": distributed.is_primary(), "mode": distributed.launch_mode(),
            "start_method": multiprocessing.get_start_method(allow_none=True)}


def task_eval(spec: dict) -> tuple[float, float, float]:
    """Exact evaluation as the README teaches it, on this rank's pad=False share of spec's float64 data:
    per-sample losses summed in float64, then one reduce of (loss sum, correct, samples)."""
    data = TensorDataset(spec["x"], spec["y"])
    loader = DataLoader(data, batch_size=spec["batch"], sampler=distributed.data_sampler(data, True, False, pad=False))
    return evaluate(build_model("mlp", 4, 0), loader)


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float, float]:
    stats = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            stats += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum(),
                                  torch.tensor(len(y))])
    loss_sum, correct, count = distributed.reduce(stats).tolist()
    return loss_sum / count, correct, count


class CountingDataset(torch.utils.data.Dataset):
    """The numbers 0..n-1, recording every index loaded: a sample the sampler skips must never be."""

    def __init__(self, n: int):
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


def task_sampler_skip(spec: dict) -> dict:
    """This rank's order for an epoch, whole, then resumed after spec["skip"] samples through a
    DataLoader (what that loaded, and len() before), then the next epoch's len()."""
    data = CountingDataset(spec["n"])
    sampler = distributed.data_sampler(data, spec.get("distributed", True), spec["shuffle"], pad=spec["pad"],
                                       seed=spec["seed"])
    sampler.set_epoch(spec["epoch"])
    whole = list(sampler)
    sampler.set_epoch(spec["epoch"], skip=spec["skip"])
    out = {"whole": whole, "len": len(sampler)}
    out["resumed"] = [int(i) for batch in DataLoader(data, batch_size=spec["batch"], sampler=sampler) for i in batch]
    out["loaded"], out["next_len"] = data.loaded, (sampler.set_epoch(spec["epoch"] + 1), len(sampler))[1]
    return out


# ---------------------------------------------------------------------------------------------
# Real processes: the one way a test starts one, waits for it, and finds what a process tree left behind
# ---------------------------------------------------------------------------------------------


# torch 2.8-2.10's gloo prints this on stdout in every rank at each group's start (2.11 made it a log message, off
# by default): torch's line, not the job's output, which tests compare line by line. Whole lines only: conftest.py
# keeps PYTHONUNBUFFERED from the processes the suite starts, so C's stdout writes gloo's line in one piece.
GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                            r"Expected number of connected peer ranks is : \d+\n", re.MULTILINE)


def job_output(stdout: str | None) -> str | None:
    """A process's stdout as the job printed it: without gloo's connection lines."""
    return stdout if stdout is None else GLOO_CONNECTED.sub("", stdout)


def start(command: list[str], cwd: str | os.PathLike = HERE, env: dict | None = None, own_session: bool = False,
          **popen: Any) -> subprocess.Popen | forked_python.ForkedProcess:
    """The one way a test starts a process: ``command`` in ``cwd``, ``env`` added to this process's environment (a
    None value removes that variable), stdout and stderr captured as text; wait for it with finish() or at_once().
    `python script.py` and `python -m module` come forked from a process that imported torch already where that is
    what a fresh interpreter would be (forked_python.py), and as a fresh interpreter elsewhere or under
    DDP_TESTS_FRESH_PYTHON=1.
    ``own_session``: a session and process group of its own, with SIGINT's default disposition, for a process the
    test signals (a suite started with SIGINT ignored, `nohup python -m pytest &` or some CI runners, would pass
    that on and the child would not stop). ``popen``: what subprocess.Popen takes besides (stdin, stdout to a
    file)."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    environ = {name: value for name, value in {**os.environ, **(env or {})}.items() if value is not None}
    command = [os.fspath(part) for part in command]
    if command[:2] == [sys.executable, str(MIN_DDP)]:  # the driver's exec, done here: one process fewer
        command, environ = _min_ddp_driver()(command[2:], environ)
    # DDP_TESTS_FRESH_PYTHON=1 (CI's second pass): every process a fresh interpreter: forks are never the only proof.
    if os.environ.get("DDP_TESTS_FRESH_PYTHON") != "1":
        forked = forked_python.start(command, cwd, environ, own_session, **popen)
        if forked is not None:
            return forked
    if own_session:
        popen.update(start_new_session=True, preexec_fn=_default_sigint)
    return subprocess.Popen(command, cwd=cwd, env=environ, text=True, **popen)


def run(command: list[str], cwd: str | os.PathLike = HERE, env: dict | None = None, timeout: float = 240,
        input: str | None = None, check: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """start()ed and waited for, its result as subprocess.run's: ``input`` goes to its stdin; still running after
    ``timeout`` is a hang (killed, and the test fails with its output); ``check``: a non-zero exit fails the test."""
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    [done] = at_once([start(command, cwd, env, **popen)], timeout, input)
    if check and done.returncode != 0:
        raise AssertionError(f"{command} exited with {done.returncode}: {done.stderr}")
    return done


def finish(procs: list, timeout: float = 180, input: str | None = None) -> list[tuple[int, str, str]]:
    """Every process's (exit code, stdout, stderr); a process still running after ``timeout`` is a hang: all
    are killed and the test fails."""
    try:
        outputs = [p.communicate(input, timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"hung, killed after {timeout} s: {[(p.args, *p.communicate()) for p in procs]}") from None
    return [(p.returncode, job_output(out), err) for p, (out, err) in zip(procs, outputs, strict=True)]


def at_once(procs: list, timeout: float = 180, input: str | None = None) -> list[subprocess.CompletedProcess]:
    """Independent commands, started by the caller, run side by side (one run waits on its peers, on signals and on
    SLURM; side by side they keep both cores busy); each one's result, as subprocess.run's."""
    results = finish(procs, timeout, input)
    return [subprocess.CompletedProcess(p.args, code, out, err)
            for p, (code, out, err) in zip(procs, results, strict=True)]


def signal_once_printed(command: list[str], cwd: str | os.PathLike, line: str, send: Callable[[int], None],
                        env: dict | None = None, timeout: float = 180,
                        then: float = 60) -> tuple[int, str, str, float]:
    """Run ``command`` in a session of its own; once it prints a line containing ``line``, ``send(its pid)``; then
    (exit code, all its stdout, its stderr, seconds from the signal to the exit). Not printed within ``timeout`` s,
    or the process ended first, or still running ``then`` s after the signal: the job is killed and the test fails
    with what it printed, each stdout line with the second it came (a slow start reads apart from a hang)."""
    proc = start(command, cwd, env, own_session=True)
    began = time.monotonic()
    out: list[tuple[float, str]] = []
    err: list[str] = []
    arrived: queue.Queue = queue.Queue()
    readers = [threading.Thread(target=_collect, args=(proc.stdout, out, began, arrived), daemon=True),
               threading.Thread(target=_collect, args=(proc.stderr, err, None, None), daemon=True)]
    for reader in readers:
        reader.start()
    failure = None
    try:
        while True:
            try:
                text = arrived.get(timeout=max(0.0, began + timeout - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"did not print {line!r} within {timeout} s") from None
            if text is None:
                raise AssertionError(f"closed its stdout without printing {line!r}")
            if line in text:
                break
        sent = time.monotonic()
        send(proc.pid)
        try:
            proc.wait(timeout=then)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still ran {then} s after the signal") from None
        seconds = time.monotonic() - sent
    except AssertionError as e:
        failure = e
    finally:
        signal_every_process(signal.SIGKILL)(proc.pid)  # the job, launch()'s ranks in their own sessions included
        with contextlib.suppress(ProcessLookupError):  # what a launcher that exited left behind
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:  # the group is gone: its pipes close
        reader.join(10)
    if failure is not None:
        printed = "".join(f"{at:7.2f} s  {text}" for at, text in out)
        raise AssertionError(f"{command} {failure} (exit code {proc.returncode}); stdout, seconds from the start:\n"
                             f"{printed}stderr:\n{''.join(err)}")
    return proc.returncode, job_output("".join(text for _, text in out)), "".join(err), seconds


def signal_every_process(sig: int) -> Callable[[int], None]:
    """What sends ``sig`` to a process and every process below it, as SLURM signals every process of a job step
    (a shell's Ctrl-C reaches only the launcher's process group: launch() gives each rank a session of its own)."""
    def send(pid: int) -> None:
        for each in process_tree(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, sig)
    return send


def process_tree(pid: int) -> list[int]:
    """``pid`` and the processes below it, parents first."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree = [pid]
    for each in tree:  # grows as it goes: breadth first
        tree += children.get(each, [])
    return tree


def _collect(stream: Any, into: list, began: float | None, arrived: queue.Queue | None) -> None:
    """A reader thread: every line of ``stream`` into ``into`` (with its second from ``began``, when given) and onto
    ``arrived``; None there at the end."""
    for text in stream:
        into.append(text if began is None else (time.monotonic() - began, text))
        if arrived is not None:
            arrived.put(text)
    if arrived is not None:
        arrived.put(None)


MIN_DDP = SCRIPTS / "min_ddp_driver.py"  # min_ddp.py as a command, with the suite's settings and hooks


def run_min_ddp(directory: str | os.PathLike, *flags: str, timeout: float = 180,
                **env: str) -> subprocess.CompletedProcess:
    """``python min_ddp_driver.py *flags`` in ``directory``, with ``env`` added (FLOAT64, TRAIN_SIZE, STOP_AT...)."""
    return at_once([start_min_ddp(directory, *flags, **env)], timeout)[0]


def start_min_ddp(directory: str | os.PathLike, *flags: str, **env: str) -> subprocess.Popen:
    """run_min_ddp's run, started and not waited for (finish it with at_once)."""
    return start([sys.executable, str(MIN_DDP), *flags], directory, env)


def start_ranks(command: list[str], cwd: str | os.PathLike, world: int = 2, prefixes: list | None = None) -> list:
    """``world`` ranks of ``python *command`` started by hand, as torchrun would (no launcher watching over them);
    ``prefixes[rank]`` goes before a rank's command (``unshare ...``)."""
    common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return [start([*(prefixes or [[]] * world)[rank], sys.executable, *command], cwd,
                  {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(world)]


@functools.cache
def _min_ddp_driver() -> Callable[[list[str], dict], tuple[list[str], dict]]:
    """min_ddp_driver.command: the command line and environment that driver runs min_ddp.py with."""
    return runpy.run_path(str(MIN_DDP))["command"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    """A port free right now, for tests that must pass one explicitly (MASTER_PORT, torchrun). Below the kernel's
    ephemeral range: a port from that range (as a bind to port 0 gives) can be handed to another process's socket
    (gloo's, a store's, any outgoing connection) before the test's process binds it, seconds later; then the job
    fails after its timeouts (seen once in a whole run: two torchrun agents, 157 s)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0  # not Linux: any free port
    draw = secrets.SystemRandom()  # not `random`: the suite's processes may seed it alike
    for _ in range(100 if ephemeral > 11000 else 0):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port := draw.randrange(10000, ephemeral)))
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cannot_run(command: list[str], what: str) -> str | None:
    """None if ``command`` succeeds here, else why not (a skip reason: "{what}: {its stderr}")."""
    try:
        done = run(command, timeout=30)
    except OSError as e:
        return f"{command[0]} is missing: {e}"
    return None if done.returncode == 0 else f"{what}: {done.stderr.strip()}"


def wait_for_job(job: str, timeout: float = 240) -> dict[str, str]:
    """Wait until SLURM no longer lists the job (a requeued job is listed while it waits); its fields. Polled
    every 0.5 s: `sbatch --wait` polls at 2, 8 and 32 s, so a 12-s job took 42."""
    deadline = time.monotonic() + timeout
    while run(["squeue", "-h", "-j", job], timeout=30).stdout.strip():
        if time.monotonic() > deadline:
            run(["scancel", job], timeout=30)
            raise TimeoutError(f"job {job} still listed after {timeout} s")
        time.sleep(0.5)
    out = run(["scontrol", "show", "job", "-o", job], timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def leftover_processes(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker``: a launcher's whole tree inherits it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker.encode() in environ and not zombie and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def task_save_ddp_state(spec: dict) -> None:
    """Every rank calls save_checkpoint with a DDP-wrapped model's state (keys start with module.)."""
    model = DDP(build_model("mlp", 4, 0))
    distributed.save_checkpoint({"model": model.state_dict()}, spec["path"])


def task_save_expecting_error(spec: dict) -> str:
    """save_checkpoint where the primary cannot write: every rank must raise, none may hang."""
    try:
        distributed.save_checkpoint({"x": torch.ones(1)}, spec["path"])
    except OSError as e:
        return str(e)
    return "no error"


def task_wire_contiguity(spec: dict) -> dict:
    """reduce(x.T) and all_gather(preds[:, 0]), with torch.distributed's all_reduce and all_gather wrapped
    to record whether each tensor they are handed is contiguous (NCCL refuses one that is not, gloo takes it;
    the real collectives still run)."""
    seen, real = [], (torch.distributed.all_reduce, torch.distributed.all_gather)

    def all_reduce(tensor, *args, **kwargs):
        seen.append(("all_reduce", tensor.is_contiguous()))
        return real[0](tensor, *args, **kwargs)

    def all_gather(parts, tensor, *args, **kwargs):
        seen.append(("all_gather", tensor.is_contiguous() and all(p.is_contiguous() for p in parts)))
        return real[1](parts, tensor, *args, **kwargs)
    torch.distributed.all_reduce, torch.distributed.all_gather = all_reduce, all_gather
    try:
        rank = distributed.get_rank()
        reduced = distributed.reduce(torch.arange(6.0).reshape(2, 3).T + rank)
        gathered = distributed.all_gather(torch.arange(6.0).reshape(3, 2)[:, 0] + rank)
    finally:
        torch.distributed.all_reduce, torch.distributed.all_gather = real
    return {"seen": seen, "reduced": reduced, "gathered": gathered}


def readme_snippet() -> str:
    """The README's train.py, as a user pastes it."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return re.search(r"```python\n(# train\.py.*?)```", f.read(), re.S).group(1)


def task_readme_evaluate(spec: dict) -> float:
    """The README snippet's evaluate() (its source executed here, as a module) on this rank's pad=False share."""
    namespace = {"__name__": "readme_train"}
    exec(compile(spec["source"], "train.py", "exec"), namespace)
    data = TensorDataset(spec["x"], spec["y"])
    loader = DataLoader(data, batch_size=spec["batch"], sampler=distributed.data_sampler(data, True, False, pad=False))
    torch.manual_seed(0)
    return namespace["evaluate"](nn.Linear(spec["x"].shape[1], CLASSES).double(), loader, torch.device("cpu"))


def task_all_gather(spec: dict) -> torch.Tensor:
    return distributed.all_gather(spec["values"][distributed.get_rank()])


def warm_ranks() -> dict:
    """The environment of a launch() job whose ranks train (random_loop, own_loop, stream_loop): its forkserver
    imports torch._dynamo once for them (rank_scripts/warm_forkserver), as min_ddp's hooks do for min_ddp's."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(SCRIPTS / "warm_forkserver"), os.environ.get("PYTHONPATH"))
                                          if p)}


def without_numpy(tmp_path) -> dict:
    """An environment whose interpreters, spawned ranks included, fail to `import numpy`, as on a
    machine where only requirements.txt is installed (torch does not depend on numpy)."""
    site = tmp_path / "no-numpy"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["numpy"] = None\n')
    return {"PYTHONPATH": os.pathsep.join([str(site), HERE])}


def assert_bitwise_equal(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
