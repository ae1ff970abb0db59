"""Benchmarks for distributed.py and min_ddp.py on this machine, side by side in one run.

    python bench.py                 # the table (about 6 minutes on 2 cores)
    python bench.py --runs 5 --json # more runs; machine-readable

Workload: an MLP 512 -> 1024 -> 1024 -> 10 (1.6M parameters), batch 128 per process, SGD with
momentum, in-memory synthetic data. Every number is the median of --runs runs; every ratio
compares numbers measured in this same run (a throughput ratio: the median of its turns' ratios).

1. Training throughput (samples/s after warm-up) of min_ddp's own train_epoch at world sizes 1
   and 2, against (a) a plain single-process loop on all cores with the same model, data and
   global batch, shuffled as min_ddp's sampler shuffles, and (b) a raw DDP loop in the PyTorch
   tutorial's style (mp.spawn, DistributedSampler, per-sample DataLoader, default threads) at
   world size 2. min_ddp's epochs and the plain loop's take turns in one job (rank 0 runs the
   plain loop while the other rank sleeps in a barrier): this VM switches between a fast and a
   slow phase for seconds or many minutes at a time, so separate jobs differ by up to 15%. Also,
   as separate jobs: the plain loop reading the data in storage order (gathers nothing); min_ddp's DDP at
   world 2 with gloo's all-reduce instead of shared memory, to show what that buys, and with no
   all-reduce at all: the ceiling any all-reduce could reach; and two processes that each run
   the plain loop at batch 128 on one thread, with no DDP: what two processes reach on these cores.
2. Launch: wall time of a trivial 2-process job (init, one all-reduce, exit) via launch() and
   via `torchrun --standalone`, until the command's process exits.
3. Fail-fast: time from a rank raising to the launcher's exit.
4. Logging: min_ddp's per-rank + global metrics every 10 steps vs only at the end of the epoch,
   timed epochs taking turns in one world-2 job (separate jobs differ by several % here).
5. SLURM (where a cluster answers): `srun -n 2 python min_ddp.py` without -c against
   `python min_ddp.py --nprocs 2`, min_ddp's own 2-epoch throughput, the two commands alternating.
   `python bench.py --srun` measures this row alone.
6. Stop checks (`python bench.py --stop`, alone): what distributed.stop_requested() costs min_ddp's own
   step (its model, data and batch 64, 2 processes) when asked every step, every 20 and every 100 steps
   (min_ddp's --check-every), 200-step epochs with and without it taking turns in one job.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distributed as dist
import min_ddp

BATCH, WARMUP = 128, 10
TARGETS = {"ddp2_vs_plain": 0.85, "ddp2_vs_raw": 1.25, "world1_vs_plain": 0.98,
           "launch_vs_torchrun": 0.80, "fail_fast_s": 1.0, "srun_vs_spawn": 0.80}
HERE = os.path.dirname(os.path.abspath(__file__))
MIN_DDP_2_EPOCHS = [sys.executable, os.path.join(HERE, "min_ddp.py"), "--epochs", "2", "--log-every", "100000"]


def bench_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def bench_data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 512, generator=gen), torch.randint(10, (samples,), generator=gen))


def as_pairs(data: TensorDataset) -> list[tuple[torch.Tensor, int]]:
    """The data as min_ddp.make_dataset gives its own: a list of (input, label) pairs."""
    inputs, labels = data.tensors
    return list(zip(inputs, labels.tolist()))


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# ---------------------------------------------------------------------------------------------
# 1. Throughput
# ---------------------------------------------------------------------------------------------


def plain_loop(global_batch: int, steps: int, shuffle: bool = True) -> Callable[[int], float]:
    """The fastest honest single-process loop: no DataLoader, all cores, and min_ddp's batches.
    Returns run(n): n more steps (n <= steps) on the same model, in a new order; samples/s.

    shuffle=True: a random order, each batch gathered with one index tensor inside the loop, as
    min_ddp's sampler and DataLoader do (its ranks' batches together are such global batches).
    shuffle=False: contiguous slices in storage order, nothing gathered: what shuffling costs.
    """
    x, y = bench_data(global_batch * steps).tensors
    model = bench_model()
    optimizer = optimizer_for(model)
    epochs = itertools.count()

    def run(n: int) -> float:
        generator = torch.Generator().manual_seed(next(epochs))  # a new order every run
        order = torch.randperm(len(x), generator=generator) if shuffle else None
        start = time.perf_counter()
        for i in range(n):
            batch = slice(i * global_batch, (i + 1) * global_batch)
            if shuffle:
                batch = order[batch]  # an index tensor: x[batch] gathers; a slice is a view
            xb, yb = x[batch], y[batch]
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return global_batch * n / (time.perf_counter() - start)
    return run


def plain_throughput(global_batch: int, steps: int, shuffle: bool = True) -> float:
    run = plain_loop(global_batch, steps, shuffle)
    run(WARMUP)
    return run(steps)


def min_ddp_trainer(device: torch.device, steps: int, allreduce: str) -> Callable[[int], float]:
    """min_ddp's own setup and train_epoch on the benchmark model, warmed up. Returns
    epoch(log_every): one timed epoch of `steps` steps; global samples/s (of the slowest rank).

    allreduce: "shared-memory" (min_ddp's), "gloo" (DDP's own), or "none": a hook that skips the
    all-reduce (wrong training, but the throughput ceiling of any all-reduce)."""
    model = bench_model().to(device)
    if allreduce == "shared-memory":
        ddp_model = min_ddp.wrap(model, device, 300)[0]  # min_ddp's own: the plain model at world 1
    else:
        ddp_model = DDP(model, gradient_as_bucket_view=True)
        if allreduce == "none":
            ddp_model.register_comm_hook(None, no_allreduce)
    optimizer = optimizer_for(model)
    world = dist.get_world_size()
    warm, timed = (DataLoader(data, batch_size=BATCH, sampler=dist.data_sampler(data, True, True))
                   for data in (as_pairs(bench_data(BATCH * world * n)) for n in (WARMUP, steps)))
    quiet = contextlib.redirect_stdout(io.StringIO())  # the metric lines are part of the cost, not the output
    with quiet:
        min_ddp.train_epoch(ddp_model, warm, optimizer, log_every=10**9)

    def epoch(log_every: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        with quiet:
            min_ddp.train_epoch(ddp_model, timed, optimizer, log_every=log_every, epoch=1)
        return BATCH * world * steps / dist.reduce(time.perf_counter() - start, "max").item()
    return epoch


def min_ddp_worker(local_rank: int, world_size: int, steps: int, log_every: tuple[int, ...], rounds: int,
                   allreduce: str, result: str) -> None:
    """Writes min_ddp's global samples/s as JSON: for each of `rounds` rounds, one timed epoch per
    value of log_every, in turn."""
    epoch = min_ddp_trainer(dist.init_process_group(local_rank, world_size), steps, allreduce)
    samples_per_s = [[epoch(every) for every in log_every] for _ in range(rounds)]
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(samples_per_s, f)
    dist.cleanup()


def turns_worker(local_rank: int, world_size: int, steps: int, rounds: int, plain_threads: int,
                 result: str) -> None:
    """min_ddp's epochs and the plain loop's (the same global batch, `plain_threads` threads) take
    turns in one job; writes [plain, min_ddp] samples/s per round as JSON. The plain loop runs on
    rank 0 while the other ranks sleep in a barrier, so each turn has the cores to itself."""
    epoch = min_ddp_trainer(dist.init_process_group(local_rank, world_size), steps, "shared-memory")
    plain = plain_loop(BATCH * world_size, steps) if dist.is_primary() else None
    rank_threads, pairs, plain_samples_per_s = torch.get_num_threads(), [], None
    for turn in range(rounds + 1):  # turn 0 warms the plain loop up; the others wait in epoch()'s barrier
        if plain:
            torch.set_num_threads(plain_threads)
            plain_samples_per_s = plain(steps if turn else WARMUP)
            torch.set_num_threads(rank_threads)
        ddp_samples_per_s = epoch(10**9)
        if turn:
            pairs.append([plain_samples_per_s, ddp_samples_per_s])
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(pairs, f)
    dist.cleanup()


def raw_ddp_worker(rank: int, world_size: int, port: int, steps: int, result: str) -> None:
    """The tutorial's way: fixed env rendezvous, DistributedSampler, per-sample DataLoader."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    data = bench_data(BATCH * world_size * (WARMUP + steps))
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, sampler=DistributedSampler(data))
    model = DDP(bench_model())
    optimizer = optimizer_for(model)
    for i, (x, y) in enumerate(loader):
        if i == WARMUP:
            start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        with open(result, "w") as f:
            f.write(str(BATCH * world_size * steps / elapsed))
    torch.distributed.destroy_process_group()


def no_allreduce(state, bucket):  # no annotations: DDP checks them, and ours would be strings
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def independent_worker(local_rank: int, world_size: int, steps: int, result: str) -> None:
    """Each rank runs the plain loop on its own model (batch 128, one thread), with no DDP and no
    collective while timed: what these processes reach on these cores before any DDP cost."""
    dist.init_process_group(local_rank, world_size)
    dist.barrier()
    slowest = dist.reduce(plain_throughput(BATCH, steps), "min").item()  # as min_ddp: the slowest rank
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(world_size * slowest, f)
    dist.cleanup()


def run_min_ddp(world: int, steps: int, allreduce: str = "shared-memory") -> float:
    """min_ddp's samples/s, metrics only at the end of the epoch."""
    return run_launched(min_ddp_worker, world, steps, (10**9,), 1, allreduce)[0][0]


def turns(world: int, steps: int, rounds: int = 8) -> dict[str, float]:
    """min_ddp at `world` against the plain loop on the same global batch, epochs taking turns in
    one job: medians of each, and the median of the rounds' ratios. Separate jobs here differ by
    up to 15% (this VM switches between a fast and a slow phase for seconds or many minutes at a
    time), so only turns within one job compare the two at the same moment."""
    pairs = run_launched(turns_worker, world, steps, rounds, torch.get_num_threads())
    return {"plain": statistics.median(plain for plain, _ in pairs),
            "min_ddp": statistics.median(ddp for _, ddp in pairs),
            "ratio": statistics.median(ddp / plain for plain, ddp in pairs)}


def logging_overhead(steps: int, rounds: int = 4) -> float:
    """The fraction of samples/s that metrics every 10 steps cost, at world 2: timed epochs with
    and without them take turns in one job, so the job-to-job spread of this VM cancels out."""
    pairs = run_launched(min_ddp_worker, 2, steps, (10**9, 10), rounds, "shared-memory")
    return statistics.median(1 - logged / quiet for quiet, logged in pairs)


STOP_EVERY = (0, 1, 20, min_ddp.parse_args([]).check_every)  # steps between stop checks; 0: none


def stop_check_worker(local_rank: int, world_size: int, rounds: int, result: str) -> None:
    """Writes, per round, min_ddp's epoch time for each of STOP_EVERY, in turn, as JSON."""
    device = dist.init_process_group(local_rank, world_size)
    model = min_ddp.make_model().to(device)
    ddp_model, optimizer = min_ddp.wrap(model, device, 300)[0], torch.optim.SGD(model.parameters(), lr=0.01)
    data = (min_ddp.make_dataset("train") * 2)[:200 * 64 * world_size]  # 200 steps: whole checks at 100
    loader = DataLoader(data, batch_size=64, sampler=dist.data_sampler(data, True, True))

    def epoch(every: int) -> float:
        steps = itertools.count(1)
        check = (lambda: next(steps) % every == 0 and dist.stop_requested()) if every else None
        dist.barrier()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            min_ddp.train_epoch(ddp_model, loader, optimizer, after_step=check)
        return dist.reduce(time.perf_counter() - start, "max").item()
    epoch(0)  # warm-up
    times = [[epoch(every) for every in STOP_EVERY] for _ in range(rounds)]
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(times, f)
    dist.cleanup()


def stop_check_rows(runs: int) -> list[str]:
    """The cost of stop checks as a fraction of the epoch time: median and range over the rounds."""
    times = run_launched(stop_check_worker, 2, 5 * runs)
    rows = [f"min_ddp 200 steps, 2 processes, no check     {statistics.median(t[0] for t in times):.3f} s "
            f"({len(times)} rounds)"]
    for i, every in enumerate(STOP_EVERY[1:], 1):
        cost = [t[i] / t[0] - 1 for t in times]
        target = ("  target <= 1%: " + ("ok" if statistics.median(cost) <= 0.01 else "MISSED")
                  if every == STOP_EVERY[-1] else "")
        rows.append(f"stop_requested() every {every:2d} steps            {statistics.median(cost):+.2%} of the step "
                    f"(rounds: {min(cost):+.2%} .. {max(cost):+.2%}){target}")
    return rows


def run_launched(worker: Callable[..., None], world: int, *args: Any) -> Any:
    """launch(worker, *args, result_file) on `world` processes; the JSON value rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        dist.launch(worker, *args, result, nprocs=world)
        with open(result) as f:
            return json.load(f)


def run_raw_ddp(world: int, steps: int, threads: str | None = None) -> float:
    """threads=None: the tutorial as written (torch's default: every core in every process)."""
    with tempfile.TemporaryDirectory() as tmp, _env(OMP_NUM_THREADS=threads):
        result = os.path.join(tmp, "result")
        mp.spawn(raw_ddp_worker, args=(world, free_port(), steps, result), nprocs=world)
        return float(open(result).read())


@contextlib.contextmanager
def _env(**values: str | None):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# 2-3. Launch and fail-fast: whole commands, timed from outside
# ---------------------------------------------------------------------------------------------


def job_worker(local_rank: int, world_size: int, fail_file: str | None) -> None:
    dist.init_process_group(local_rank, world_size)
    dist.reduce(torch.ones(1))
    if fail_file and dist.get_rank() == 1:
        with open(fail_file, "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("benchmark: rank 1 fails on purpose")
    if fail_file:
        dist.reduce(torch.ones(1))  # rank 0 waits here for the rank that is failing
    dist.cleanup()


def wall_time(command: list[str]) -> float:
    seconds, code, out = run_to_exit(command)
    assert code == 0, out
    return seconds


def min_ddp_throughput(command: list[str]) -> float:
    """min_ddp's samples/s over its epochs (its last epoch line), run as a command."""
    _, code, out = run_to_exit(command)
    assert code == 0, out
    return float(re.findall(r"\| (\d+) samples/s", out)[-1])


def slurm_answers() -> bool:
    return shutil.which("srun") is not None and subprocess.run(
        ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30).stdout.strip() in ("idle", "mix")


def srun_configs() -> dict[str, Callable[[], float]]:
    """srun without -c (every task could use every core) against launch()'s --nprocs 2."""
    return {"min_ddp_spawn2": lambda: min_ddp_throughput([*MIN_DDP_2_EPOCHS, "--nprocs", "2"]),
            "min_ddp_srun2": lambda: min_ddp_throughput(["srun", "-n", "2", *MIN_DDP_2_EPOCHS])}


def fail_fast_latency() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        raised = os.path.join(tmp, "raised")
        start = time.time()
        seconds, code, out = run_to_exit([sys.executable, __file__, "--job", "--fail-file", raised])
        assert code != 0 and "fails on purpose" in out, out
        return start + seconds - float(open(raised).read())


def run_to_exit(command: list[str]) -> tuple[float, int, str]:
    """(seconds until the command's own process exits, its exit code, its output).

    Where launch() uses its forkserver (a launcher with threads), the forkserver keeps the output pipe
    open ~0.5 s after the launcher exits, while its interpreter tears torch down. That is not the
    command's time, but the output is read to the end before returning, so that the teardown does not
    slow down the next measurement.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        code = proc.wait(timeout=120)  # the output is a few lines: it cannot fill the pipe
        seconds = time.perf_counter() - start
        return seconds, code, proc.communicate(timeout=60)[0]
    finally:
        proc.kill()


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def measure(runs: int, steps: int) -> dict:
    """Each run measures every configuration once, interleaved, so that slow phases of the
    machine hit all of them alike; the report takes each one's median over the runs."""
    configs = {
        "world1_turns": lambda: turns(1, steps),
        "world2_turns": lambda: turns(2, steps),
        "plain_b256_in_order": lambda: plain_throughput(2 * BATCH, steps, shuffle=False),
        "min_ddp_world2_gloo": lambda: run_min_ddp(2, steps, "gloo"),
        "min_ddp_world2_no_allreduce": lambda: run_min_ddp(2, steps, "none"),
        "independent_world2": lambda: run_launched(independent_worker, 2, steps),
        "raw_ddp_world2": lambda: run_raw_ddp(2, steps),
        "raw_ddp_world2_1thread": lambda: run_raw_ddp(2, steps, "1"),
        "launch_s": lambda: wall_time([sys.executable, __file__, "--job"]),
        "torchrun_s": lambda: wall_time(["torchrun", "--standalone", "--nproc_per_node=2", __file__, "--job"]),
        "fail_fast_s": fail_fast_latency,
        "logging_overhead": lambda: logging_overhead(steps),
        **(srun_configs() if slurm_answers() else {}),
    }
    samples: dict[str, list[Any]] = {name: [] for name in configs}
    for _ in range(runs):
        for name, run in configs.items():
            samples[name].append(run())
    m: dict[str, Any] = {name: statistics.median(values) for name, values in samples.items()
                         if not name.endswith("_turns")}
    for world, plain, ddp in ((1, "plain_b128", "min_ddp_world1"), (2, "plain_b256", "min_ddp_world2")):
        pairs = samples[f"world{world}_turns"]
        m[plain] = statistics.median(run["plain"] for run in pairs)
        m[ddp] = statistics.median(run["min_ddp"] for run in pairs)
    per_run = {name: [run["ratio"] for run in samples[f"world{world}_turns"]]
               for name, world in (("ddp2_vs_plain", 2), ("world1_vs_plain", 1))}
    m["ratios"] = {
        "ddp2_vs_plain": statistics.median(per_run["ddp2_vs_plain"]),
        "ddp2_vs_raw": m["min_ddp_world2"] / max(m["raw_ddp_world2"], m["raw_ddp_world2_1thread"]),
        "world1_vs_plain": statistics.median(per_run["world1_vs_plain"]),
        "launch_vs_torchrun": m["launch_s"] / m["torchrun_s"],
        "fail_fast_s": m["fail_fast_s"],
        "logging_overhead": m["logging_overhead"],
    }
    m["runs"] = samples
    m["ratio_ranges"] = {name: (min(values), max(values)) for name, values in per_run.items()}
    add_srun_ratio(m, samples)
    return m


def spread(m: dict, ratio: str) -> str:
    low, high = m["ratio_ranges"][ratio]
    return f"{low:.2f}-{high:.2f}"


def table(m: dict, runs: int) -> str:
    r = m["ratios"]
    higher = {"ddp2_vs_plain", "ddp2_vs_raw", "world1_vs_plain"}
    higher.add("srun_vs_spawn")
    met = {k: (r[k] >= TARGETS[k]) if k in higher else (r[k] <= TARGETS[k]) for k in TARGETS if k in r}
    rows = [
        ("plain loop, all cores, batch 256", f"{m['plain_b256']:8.0f} samples/s",
         "(shuffled, as min_ddp; epochs take turns with the next row's in one job)"),
        ("min_ddp, world 2, 2 x 128", f"{m['min_ddp_world2']:8.0f} samples/s",
         f"{r['ddp2_vs_plain']:.3f}x plain-256, turn by turn (runs: {spread(m, 'ddp2_vs_plain')}; target >= "
         f"{TARGETS['ddp2_vs_plain']})", "ddp2_vs_plain"),
        ("plain loop, all cores, batch 128", f"{m['plain_b128']:8.0f} samples/s",
         "(shuffled, as min_ddp; epochs take turns with the next row's in one process)"),
        ("min_ddp, world 1, batch 128", f"{m['min_ddp_world1']:8.0f} samples/s",
         f"{r['world1_vs_plain']:.3f}x plain-128, turn by turn (runs: {spread(m, 'world1_vs_plain')}; target >= "
         f"{TARGETS['world1_vs_plain']})", "world1_vs_plain"),
        ("plain loop, batch 256, in storage order", f"{m['plain_b256_in_order']:8.0f} samples/s",
         f"min_ddp world 2 = {m['min_ddp_world2'] / m['plain_b256_in_order']:.3f}x this (no shuffle, no gather)"),
        ("min_ddp, world 2, gloo all-reduce", f"{m['min_ddp_world2_gloo']:8.0f} samples/s",
         f"{m['min_ddp_world2_gloo'] / m['plain_b256']:.3f}x plain-256 (without shared memory)"),
        ("min_ddp, world 2, all-reduce skipped", f"{m['min_ddp_world2_no_allreduce']:8.0f} samples/s",
         f"{m['min_ddp_world2_no_allreduce'] / m['plain_b256']:.3f}x plain-256 (ceiling: compute only)"),
        ("2 independent plain loops, 1 thread each", f"{m['independent_world2']:8.0f} samples/s",
         f"{m['independent_world2'] / m['plain_b256']:.3f}x plain-256 (no DDP, no all-reduce: the processes alone)"),
        ("raw DDP (tutorial as written), world 2", f"{m['raw_ddp_world2']:8.0f} samples/s", ""),
        ("raw DDP, 1 thread/process, world 2", f"{m['raw_ddp_world2_1thread']:8.0f} samples/s",
         f"min_ddp = {r['ddp2_vs_raw']:.3f}x the faster raw (target >= {TARGETS['ddp2_vs_raw']})", "ddp2_vs_raw"),
        ("min_ddp, world 2, metrics every 10 steps", f"{100 * r['logging_overhead']:7.1f}% slower",
         "than without (epochs with and without take turns in one job)"),
        ("trivial 2-process job: launch()", f"{m['launch_s']:8.2f} s",
         f"{r['launch_vs_torchrun']:.2f}x torchrun (target <= {TARGETS['launch_vs_torchrun']})", "launch_vs_torchrun"),
        ("trivial 2-process job: torchrun", f"{m['torchrun_s']:8.2f} s", ""),
        ("fail-fast: raise -> launcher exit", f"{m['fail_fast_s']:8.2f} s",
         f"(target <= {TARGETS['fail_fast_s']} s)", "fail_fast_s"),
    ]
    if "srun_vs_spawn" in r:
        rows += srun_rows(m)
    lines = [f"{'measurement (median of ' + str(runs) + ' runs)':42s} {'value':>18s}   comparison"]
    for name, value, note, *key in rows:
        mark = ("  ok" if met[key[0]] else "  MISSED") if key else ""
        lines.append(f"{name:42s} {value:>18s}   {note}{mark}")
    return "\n".join(lines)


def srun_rows(m: dict) -> list[tuple]:
    r = m["ratios"]["srun_vs_spawn"]
    return [("min_ddp --nprocs 2 (launch)", f"{m['min_ddp_spawn2']:8.0f} samples/s", "2 epochs, its own count"),
            ("srun -n 2 python min_ddp.py (no -c)", f"{m['min_ddp_srun2']:8.0f} samples/s",
             f"{r:.3f}x --nprocs 2 (runs: {spread(m, 'srun_vs_spawn')}; target >= {TARGETS['srun_vs_spawn']})",
             "srun_vs_spawn")]


def measure_srun(runs: int) -> dict:
    """The SLURM rows alone, the two commands alternating."""
    samples = {name: [] for name in srun_configs()}
    for _ in range(runs):
        for name, run in srun_configs().items():
            samples[name].append(run())
    m: dict[str, Any] = {name: statistics.median(values) for name, values in samples.items()}
    m.update(runs=samples, ratio_ranges={}, ratios={})
    add_srun_ratio(m, samples)
    return m


def add_srun_ratio(m: dict, samples: dict) -> None:
    """srun's throughput over launch()'s, run by run (the two alternate), where SLURM was measured."""
    if "min_ddp_srun2" in samples:
        per_run = [s / p for s, p in zip(samples["min_ddp_srun2"], samples["min_ddp_spawn2"])]
        m["ratios"]["srun_vs_spawn"] = statistics.median(per_run)
        m["ratio_ranges"]["srun_vs_spawn"] = (min(per_run), max(per_run))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="timed steps per throughput run")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--srun", action="store_true", help="only the SLURM rows (needs a cluster: bash .ci/slurm up)")
    p.add_argument("--stop", action="store_true", help="only the cost of stop checks")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # the trivial job, run as a command
    p.add_argument("--fail-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1 or args.steps < 1:
        p.error(f"--runs and --steps must be >= 1, got: --runs {args.runs} --steps {args.steps}")
    if args.job:
        dist.launch(job_worker, args.fail_file, nprocs=2)
        return
    if args.stop:
        print("\n".join(stop_check_rows(args.runs)))
        return
    if args.srun:
        if not slurm_answers():
            p.error("--srun needs an idle SLURM node (sinfo); on this machine: bash .ci/slurm up")
        m = measure_srun(args.runs)
        rows = srun_rows(m)
        print(json.dumps(m, indent=2) if args.json else "\n".join(
            f"{name:42s} {value:>18s}   {note}" + (("  ok" if m["ratios"][key[0]] >= TARGETS[key[0]] else "  MISSED")
                                                  if key else "") for name, value, note, *key in rows))
        return
    m = measure(args.runs, args.steps)
    print(json.dumps(m, indent=2) if args.json else table(m, args.runs))


if __name__ == "__main__":
    main()
