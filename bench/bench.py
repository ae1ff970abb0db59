"""Benchmarks for distributed.py and min_ddp's training loop on this machine, side by side in one run.

    python bench/bench.py                  # the table (about 5 minutes on 2 cores)
    python bench/bench.py --runs 9 --json  # more runs; machine-readable
    python bench/bench.py --srun           # only the SLURM row (needs a cluster: bash .ci/slurm up)
    python bench/bench.py --save           # only a Checkpointer save with 64 MB of state per rank, world 2
    python bench/bench.py --start          # only a start by hand (env://): ours against torch's
    python bench/bench.py --world3         # only world 3: what bitwise resume costs
    python bench/bench.py --items          # only seeded_dataset's cost per item read
    python bench/bench.py --streams        # only stop_together's cost per step of min_ddp's loop, world 2
    python bench/bench.py --sharded        # only sharded_stream's records/s against a stream sharded by hand
    python bench/bench.py --slow-rank      # only SlowRank's cost per step of min_ddp's loop, world 2

An MLP 512 -> 1024 -> 1024 -> 10, batch 128 per process, SGD with momentum, data as (input, label) pairs.
Each number is the median of --runs runs; each ratio compares numbers of the same run. min_ddp's loop
(written here, so that the example stays free to change) at worlds 1 and 2, and with gloo's all-reduce,
each against a plain loop on all cores with the same global batches, taking turns in one job (this VM's
speed drifts by up to 15% between jobs); the PyTorch tutorial's raw DDP; a trivial 2-process job via
launch() and torchrun; a rank raising until the launcher exits; `srun -n 2 python min_ddp.py` (no -c)
against `python min_ddp.py --nprocs 2`, alternating.
"""
import argparse
import hashlib
import itertools
import json
import os
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from typing import Any
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the library this measures sits one folder up, as in the repository
import distributed as dist  # noqa: E402
from shared_memory_allreduce import shared_memory_allreduce  # noqa: E402
from seeded_dataset import seeded_dataset  # noqa: E402
from sharded_stream import sharded_stream, stop_together  # noqa: E402
from slow_rank import SlowRank  # noqa: E402

BATCH, WARMUP = 128, 10
TARGETS = {"ddp2_vs_plain": 0.85, "ddp2_vs_raw": 1.25, "world1_vs_plain": 0.98,
           "launch_vs_torchrun": 0.80, "fail_fast_s": 1.0, "srun_vs_spawn": 0.80}
MIN_DDP_2_EPOCHS = [sys.executable, os.path.join(ROOT, "min_ddp.py"),
                    "--epochs", "2", "--log-every", "100000"]


def bench_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def bench_data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 512, generator=gen), torch.randint(10, (samples,), generator=gen))


def plain_loop(global_batch: int, steps: int) -> Callable[[int], float]:
    """The plain loop, all cores, no DataLoader, the same global batches gathered from a new random order:
    run(n) trains n more steps (n <= steps) of the same model; its samples/s."""
    x, y = bench_data(global_batch * steps).tensors
    (model, optimizer), epochs = bench_model(), itertools.count()

    def run(n: int) -> float:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(next(epochs)))
        start = time.perf_counter()
        for i in range(n):
            batch = order[i * global_batch:(i + 1) * global_batch]
            loss = F.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return global_batch * n / (time.perf_counter() - start)
    return run


def train_steps(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer) -> None:
    """One pass in min_ddp's loop shape: DDP forward and backward, a step, the metrics summed on the device."""
    stats = torch.zeros(3, dtype=torch.float64)
    for x, y in loader:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats[:2] += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum()])
        stats[2] += len(y)
    dist.all_gather(stats)  # the epoch's metric line: one all-gather


def min_ddp_trainer(steps: int, allreduce: str) -> Callable[[], float]:
    """Warmed up; epoch() trains `steps` steps: global samples/s (of the slowest rank)."""
    (model, optimizer), world = bench_model(), dist.get_world_size()
    ddp_model = model
    if world > 1:  # as min_ddp wraps its model; "gloo-find-unused": the opt-in route to bitwise resume at 3+
        ddp_model = DDP(model, gradient_as_bucket_view=True, find_unused_parameters=allreduce == "gloo-find-unused")
    if world > 1 and allreduce == "shared-memory":
        assert shared_memory_allreduce(ddp_model, 300)
    warm, timed = (DataLoader(data, batch_size=BATCH, sampler=dist.data_sampler(data, True, True))
                   for data in (list(zip(*bench_data(BATCH * world * n).tensors, strict=True))
                                for n in (WARMUP, steps)))
    train_steps(ddp_model, warm, optimizer)

    def epoch() -> float:
        dist.barrier()
        start = time.perf_counter()
        train_steps(ddp_model, timed, optimizer)
        return BATCH * world * steps / dist.reduce(time.perf_counter() - start, "max").item()
    return epoch


def turns_worker(local_rank: int, world_size: int, steps: int, rounds: int, plain_threads: int, allreduce: str,
                 result: str) -> None:
    """The loop's epochs and the plain loop's (the same global batch, `plain_threads` threads) take turns
    in one job; writes [plain, loop] samples/s per round as JSON. The plain loop runs on rank 0 while the
    other ranks wait in a barrier, so each turn has the cores to itself."""
    dist.init_process_group(local_rank, world_size)
    epoch = min_ddp_trainer(steps, allreduce)
    plain = plain_loop(BATCH * world_size, steps) if dist.is_primary() else None
    rank_threads, pairs, plain_samples_per_s = torch.get_num_threads(), [], None
    for turn in range(rounds + 1):  # turn 0 warms the plain loop up; the others wait in epoch()'s barrier
        if plain:
            torch.set_num_threads(plain_threads)
            plain_samples_per_s = plain(steps if turn else WARMUP)
            torch.set_num_threads(rank_threads)
        ddp_samples_per_s = epoch()
        if turn:
            pairs.append([plain_samples_per_s, ddp_samples_per_s])
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(pairs, f)
    dist.cleanup()


def raw_ddp_worker(rank: int, world_size: int, port: int, steps: int, threads: int, result: str) -> None:
    """The tutorial's way: a fixed port, DistributedSampler, per-sample DataLoader; threads=0 as written."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if threads:
        torch.set_num_threads(threads)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    data = bench_data(BATCH * world_size * (WARMUP + steps))
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, sampler=DistributedSampler(data))
    plain, optimizer = bench_model()
    model = DDP(plain)
    for i, (x, y) in enumerate(loader):
        if i == WARMUP:
            start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    if rank == 0:
        with open(result, "w") as f:
            f.write(str(BATCH * world_size * steps / (time.perf_counter() - start)))
    torch.distributed.destroy_process_group()


def run_raw_ddp(world: int, steps: int, threads: int = 0) -> float:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(raw_ddp_worker, args=(world, port, steps, threads, os.path.join(tmp, "result")), nprocs=world)
        return float(open(os.path.join(tmp, "result")).read())


def turns(world: int, steps: int, allreduce: str = "shared-memory", rounds: int = 8) -> tuple[float, float, float]:
    """(plain loop, the loop at `world`, the median of the rounds' ratios), epochs taking turns in one job."""
    pairs = run_launched(turns_worker, world, steps, rounds, torch.get_num_threads(), allreduce)
    return (statistics.median(plain for plain, _ in pairs), statistics.median(ddp for _, ddp in pairs),
            statistics.median(ddp / plain for plain, ddp in pairs))


def streams_worker(local_rank: int, world_size: int, steps: int, runs: int, result: str) -> None:
    """min_ddp's loop (shared-memory all-reduce) over its loader, plain and through stop_together, alternating
    epoch by epoch; writes [plain, wrapped] seconds per step (the slowest rank's) per run as JSON."""
    dist.init_process_group(local_rank, world_size)
    model, optimizer = bench_model()
    ddp_model = DDP(model, gradient_as_bucket_view=True)
    assert shared_memory_allreduce(ddp_model, 300)
    data = list(zip(*bench_data(BATCH * world_size * steps).tensors, strict=True))
    loader = DataLoader(data, batch_size=BATCH, sampler=dist.data_sampler(data))
    train_steps(ddp_model, loader, optimizer)  # warm-up
    pairs = []
    for _ in range(runs):
        pair = []
        for wrap in (lambda batches: batches, stop_together):
            dist.barrier()
            start = time.perf_counter()
            train_steps(ddp_model, wrap(loader), optimizer)
            pair.append(dist.reduce(time.perf_counter() - start, "max").item() / steps)
        pairs.append(pair)
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(pairs, f)
    dist.cleanup()


def slow_rank_worker(local_rank: int, world_size: int, steps: int, runs: int, result: str) -> None:
    """min_ddp's loop (shared-memory all-reduce) on two identical models, one plain and one under SlowRank's default
    window, alternating epoch by epoch (each first in every other pair); writes [plain, watched] seconds per step (the
    slowest rank's) per run, and the same for a 2-parameter model: SlowRank's own work per step."""
    dist.init_process_group(local_rank, world_size)
    trainers = []
    for watched in (False, True):
        model, optimizer = bench_model()
        ddp_model = DDP(model, gradient_as_bucket_view=True)
        watch = SlowRank(ddp_model, enabled=watched)  # before the all-reduce's hook, which it then wraps
        assert shared_memory_allreduce(ddp_model, 300)
        trainers.append((ddp_model, optimizer, watch))
    data = list(zip(*bench_data(BATCH * world_size * steps).tensors, strict=True))
    loader = DataLoader(data, batch_size=BATCH, sampler=dist.data_sampler(data))
    for ddp_model, optimizer, watch in trainers:
        train_steps(ddp_model, watch.batches(loader), optimizer)  # warm-up (and SlowRank's first window)
    pairs = []
    for run in range(runs):
        pair = [0.0, 0.0]
        for which in (0, 1) if run % 2 == 0 else (1, 0):  # plain first, then watched first: no order favoured
            ddp_model, optimizer, watch = trainers[which]
            dist.barrier()
            start = time.perf_counter()
            train_steps(ddp_model, watch.batches(loader), optimizer)
            pair[which] = dist.reduce(time.perf_counter() - start, "max").item() / steps
        pairs.append(pair)
    # SlowRank's own work per step, apart from the model's: a 2-parameter model, 2,000 steps each way, alternating.
    tiny = []
    for watched in (False, True):
        ddp_model = DDP(nn.Linear(1, 1), gradient_as_bucket_view=True)
        watch = SlowRank(ddp_model, enabled=watched)
        assert shared_memory_allreduce(ddp_model, 300)
        tiny.append((ddp_model, watch))
    batches = [torch.ones(1, 1)] * 2000
    per_step = [[], []]
    for _ in range(5):
        for (ddp_model, watch), seconds in zip(tiny, per_step, strict=True):
            dist.barrier()
            start = time.perf_counter()
            for x in watch.batches(batches):
                ddp_model(x).sum().backward()
            seconds.append(dist.reduce(time.perf_counter() - start, "max").item() / len(batches))
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump({"pairs": pairs, "tiny": per_step}, f)
    dist.cleanup()


SHARD_FILES, SHARD_RECORDS, RECORD_FLOATS = 24, 4000, 32


def write_shards(directory: str) -> list[str]:
    """24 text shards of 4,000 records: a label and 32 numbers per line, as JSON-lines or CSV shards hold them."""
    paths, gen = [], torch.Generator().manual_seed(0)
    for shard in range(SHARD_FILES):
        values = torch.randn(SHARD_RECORDS, RECORD_FLOATS, generator=gen).tolist()
        path = os.path.join(directory, f"shard{shard:02}.csv")
        with open(path, "w") as f:
            f.writelines(f"{i % 10}," + ",".join(f"{v:.6f}" for v in row) + "\n" for i, row in enumerate(values))
        paths.append(path)
    return paths


def read_shard(path: str, start: int = 0):
    """A shard's records from ``start`` (lines before it skipped, not parsed): (input, label)."""
    with open(path) as f:
        for line in itertools.islice(f, start, None):
            label, *values = line.split(",")
            yield torch.tensor([float(v) for v in values]), int(label)


class ByHand(IterableDataset):
    """The stream sharded by hand, as users write it: every (world x workers)-th file, from this reader's offset."""

    def __init__(self, paths: list[str], workers: int):
        self.paths, self.workers = paths, workers

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        reader = dist.get_rank() * self.workers + (info.id if info else 0)
        for path in self.paths[reader::dist.get_world_size() * self.workers]:
            yield from read_shard(path)


def sharded_worker(local_rank: int, world_size: int, paths: list[str], runs: int, result: str) -> None:
    """Every record of the shards read at world 2 with 2 loader workers a rank, by hand and through sharded_stream,
    alternating; writes [by hand, sharded_stream] records/s of the whole job (the slowest rank's time) per run."""
    dist.init_process_group(local_rank, world_size)
    batch = 120  # 240 a step: 20 records from each of 12 streams
    loaders = {"hand": DataLoader(ByHand(paths, 2), batch_size=batch, num_workers=2),
               "ours": sharded_stream(paths, read_shard, streams=12, global_batch=batch * world_size, num_workers=2)}
    pairs = []
    for _ in range(runs):
        pair = []
        for name in ("hand", "ours"):
            dist.barrier()
            start, records = time.perf_counter(), 0
            for x, _ in loaders[name]:
                records += len(x)
            seconds = dist.reduce(time.perf_counter() - start, "max").item()
            pair.append(dist.reduce(records).item() / seconds)
        pairs.append(pair)
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump(pairs, f)
    dist.cleanup()


def run_launched(worker: Callable[..., None], world: int, *args: Any) -> Any:
    """launch(worker, *args, result_file) on `world` processes; the JSON value rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        dist.launch(worker, *args, result, nprocs=world)
        with open(result) as f:
            return json.load(f)


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


def run_to_exit(command: list[str]) -> tuple[float, int, str]:
    """(seconds until the command's own process exits, its exit code, its output, read to the end: launch()'s
    forkserver tears torch down ~0.5 s longer, which must not slow the next measurement)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        code = proc.wait(timeout=120)  # the output is a few lines: it cannot fill the pipe
        seconds = time.perf_counter() - start
        return seconds, code, proc.communicate(timeout=60)[0]
    finally:
        proc.kill()


def wall_time(command: list[str], samples_per_s: bool = False) -> float:
    """Seconds until the command exits; or its samples/s (min_ddp's last epoch line)."""
    seconds, code, out = run_to_exit(command)
    assert code == 0, out
    return float(re.findall(r"\| (\d+) samples/s", out)[-1]) if samples_per_s else seconds


def fail_fast_latency() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        raised = os.path.join(tmp, "raised")
        start = time.time()
        seconds, code, out = run_to_exit([sys.executable, __file__, "--job", "--fail-file", raised])
        assert code != 0 and "fails on purpose" in out, out
        return start + seconds - float(open(raised).read())


def save_worker(local_rank: int, world_size: int, saves: int, result: str) -> None:
    """Checkpointer.save() with 64 MB of `state` per rank (an EMA copy of a model): each save's seconds, and
    each rank's peak resident memory above what it held before the first save (MB)."""
    from checkpointer import Checkpointer
    dist.init_process_group(local_rank, world_size)
    ckpt = Checkpointer(os.path.join(os.path.dirname(result), "snap.pt"), nn.Linear(4, 4),
                        state={"ema": torch.randn(16 << 20)})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(saves):
        dist.barrier()
        start = time.perf_counter()
        ckpt.save()
        seconds.append(time.perf_counter() - start)
    peaks = dist.all_gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before).tolist()
    if dist.is_primary():
        with open(result, "w") as f:
            json.dump({"seconds": seconds, "peak_mb": peaks}, f)
    dist.cleanup()


def start_rank(how: str) -> None:
    """One rank of a job started by hand (RANK, MASTER_PORT...): the init, timed, as JSON on stdout."""
    entered = time.time()
    if how == "ours":
        dist.init_process_group(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        torch.distributed.init_process_group("gloo", init_method="env://", timeout=dist.DEFAULT_TIMEOUT)
    left = time.time()
    torch.distributed.all_reduce(torch.ones(1))
    torch.distributed.destroy_process_group()
    print(json.dumps([entered, left]))


def start_seconds(how: str) -> float:
    """A good 2-rank start on one host: from the last rank entering init to the last one leaving it (the
    imports before it vary by a second and are the same either way)."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--start-rank", how], stdout=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(2)]
    times = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return max(left for _, left in times) - max(entered for entered, _ in times)


def world3(steps: int, runs: int) -> str:
    """min_ddp's loop at world 3: the shared-memory all-reduce (whose owner now divides its own share apart,
    one more pass over a third of the gradients), gloo, and gloo with find_unused_parameters=True (no bucket
    rebuild). The extra pass is timed alone, one thread as each rank has here, against the loop's step."""
    found = {kind: [turns(3, steps, kind, rounds=3)[1] for _ in range(runs)]
             for kind in ("shared-memory", "gloo", "gloo-find-unused")}
    step_ms = {kind: [1000 * BATCH * 3 / s for s in values] for kind, values in found.items()}
    chunk = torch.randn(sum(p.numel() for p in bench_model()[0].parameters()) // 3)
    torch.set_num_threads(1)
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            chunk.div_(3)
        passes.append((time.perf_counter() - start) * 10)  # ms per pass
    median = {kind: statistics.median(v) for kind, v in step_ms.items()}
    share = [statistics.median(passes) / ms for ms in step_ms["shared-memory"]]
    unused = [u / g for u, g in zip(step_ms["gloo-find-unused"], step_ms["gloo"], strict=False)]
    return (f"world 3, ms per step (median of {runs}): shared memory {median['shared-memory']:.1f}, gloo "
            f"{median['gloo']:.1f}, gloo + find_unused_parameters {median['gloo-find-unused']:.1f}\n"
            f"the owner's own division, one pass over a third of the gradients: {statistics.median(passes):.3f} ms "
            f"(runs: {min(passes):.3f}-{max(passes):.3f}) = {100 * statistics.median(share):.2f}% of the "
            f"shared-memory step (runs: {100 * min(share):.2f}-{100 * max(share):.2f}%; target <= 1%)\n"
            f"find_unused_parameters=True against plain gloo, run by run: {statistics.median(unused):.3f}x "
            f"(runs: {min(unused):.3f}-{max(unused):.3f})")


class SmallItem(torch.utils.data.Dataset):
    """An item that costs about 20 us to read, drawing from torch's generator as an augmentation would."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> torch.Tensor:
        return (torch.rand(64) * 2 + index).sum()


class ItemTimer(torch.utils.data.Dataset):
    """Item 0 times READS reads of the plain and the seeded item where it is read (a loader worker): us per read."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, _: int) -> list[list[float]]:
        return time_items(5)


READS = 20000


def time_items(runs: int) -> list[list[float]]:
    """[plain, seeded] microseconds per read, `runs` times, alternating, in this process."""
    def single_reads(data: torch.utils.data.Dataset) -> float:
        start = time.perf_counter()
        for i in range(READS):
            data[i]
        return (time.perf_counter() - start) / READS * 1e6
    return alternate(runs, single_reads)


def time_batches(runs: int, batch: int = 64, batches: int = 300) -> list[list[float]]:
    """[plain, seeded] microseconds per item read as a DataLoader reads them in this process (one batch at a time,
    through the dataset's __getitems__ where it has one), `runs` times, alternating."""
    def batch_reads(data: torch.utils.data.Dataset) -> float:
        loader = iter(DataLoader(data, batch_size=batch, collate_fn=list))
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        return (time.perf_counter() - start) / (batches * batch) * 1e6
    return alternate(runs, batch_reads)


def alternate(runs: int, per_item_us: Callable[[torch.utils.data.Dataset], float]) -> list[list[float]]:
    """``per_item_us`` of the plain item and of the seeded one, taking turns, `runs` times."""
    plain, seeded = SmallItem(), seeded_dataset(SmallItem(), seed=1)
    return [[per_item_us(plain), per_item_us(seeded)] for _ in range(runs)]


def seeding_floor_us() -> tuple[float, float]:
    """What any per-item seeding must add, each piece timed alone here (best of 5): (main process, loader worker).
    A worker seeds torch's CPU generator, Python's and numpy's, from a key hashed as seeded_dataset hashes it; the
    main process also saves and restores Python's and torch's (numpy's is swapped: well under 1 us). The VM's
    speed moves these by up to 1.6x from one hour to the next: the floor says how much of a read is the machine."""
    cpu, numpy = torch.default_generator, sys.modules.get("numpy")
    call = min(timeit.repeat(lambda: None, number=READS, repeat=5))  # the lambda's own call, taken off each piece

    def us(piece: Callable[[], Any]) -> float:
        return (min(timeit.repeat(piece, number=READS, repeat=5)) - call) / READS * 1e6

    seeds = us(lambda: cpu.manual_seed(123456789)) + us(lambda: random.seed(123456789))
    seeds += us(lambda: int.from_bytes(hashlib.blake2b(b"1/0/123", digest_size=8).digest(), "little"))
    if numpy is not None:
        seeds += us(lambda: numpy.random.seed(123456789))
    saves = us(lambda: random.setstate(random.getstate())) + us(lambda: cpu.set_state(cpu.get_state()))
    return seeds + saves, seeds


def items() -> str:
    torch.set_num_threads(1)  # as a loader worker has
    here = time_items(5)
    batched = time_batches(5)
    worker = next(iter(DataLoader(ItemTimer(), batch_size=None, num_workers=1)))
    main_floor, worker_floor = seeding_floor_us()
    lines = [f"seeded_dataset, {READS} reads of a {statistics.median(p for p, _ in here):.1f}-us item (numpy "
             f"{'imported' if 'numpy' in sys.modules else 'absent'}), added per read, median of 5 (runs):"]
    for where, pairs, target, floor in (("main process", here, 25, main_floor),
                                        ("loader worker", worker, 10, worker_floor),
                                        ("main process, a DataLoader's batches of 64", batched, 25, None)):
        added = sorted(s - p for p, s in pairs)
        line = f"  {where}: {statistics.median(added):.1f} us ({added[0]:.1f}-{added[-1]:.1f}; target <= {target})"
        if floor is not None:
            line += f"; the generators' own seeding and saving, timed alone: {floor:.1f} us"
        lines.append(line)
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_answers() -> bool:
    return shutil.which("srun") is not None and subprocess.run(
        ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30).stdout.strip() in ("idle", "mix")


def configs(steps: int, srun: bool) -> dict[str, Callable[[], Any]]:
    """Every measurement by name; each run takes them all once, interleaved, as the machine's phases drift."""
    srun_rows = {"spawn2": lambda: wall_time([*MIN_DDP_2_EPOCHS, "--nprocs", "2"], samples_per_s=True),
                 "srun2": lambda: wall_time(["srun", "-n", "2", *MIN_DDP_2_EPOCHS], samples_per_s=True)}
    if srun:
        return srun_rows
    return {"world1": lambda: turns(1, steps), "world2": lambda: turns(2, steps),
            "gloo2": lambda: turns(2, steps, "gloo", rounds=3), "raw2": lambda: run_raw_ddp(2, steps),
            "raw2_1thread": lambda: run_raw_ddp(2, steps, 1),
            "launch_s": lambda: wall_time([sys.executable, __file__, "--job"]),
            "torchrun_s": lambda: wall_time(["torchrun", "--standalone", "--nproc_per_node=2", __file__, "--job"]),
            "fail_fast_s": fail_fast_latency, **(srun_rows if slurm_answers() else {})}


def table(runs: dict[str, list], n: int) -> str:
    """The rows: each value the median over the runs; each ratio the median of the runs' ratios, and its range."""
    med = {name: statistics.median(v[1] if isinstance(v, (list, tuple)) else v for v in values)
           for name, values in runs.items()}
    rows = [f"{'measurement (median of ' + str(n) + ' runs)':44s} {'value':>16s}   comparison"]

    def row(name: str, value: str, ratios: list[float] | None = None, what: str = "", target: str = "") -> None:
        if ratios:
            lower, ratio = target.endswith(("_s", "torchrun")), statistics.median(ratios)
            what = (f"{f'{ratio:.3f}x {what} ' if what else ''}(runs: {min(ratios):.2f}-{max(ratios):.2f}; target "
                    f"{'<=' if lower else '>='} {TARGETS[target]})  "
                    f"{'ok' if (ratio <= TARGETS[target] if lower else ratio >= TARGETS[target]) else 'MISSED'}")
        rows.append(f"{name:44s} {value:>16s}   {what}")
    for world, batch in ((2, 256), (1, 128)):
        if f"world{world}" in runs:
            plain = statistics.median(p for p, _, _ in runs[f"world{world}"])
            row(f"plain loop, all cores, batch {batch}", f"{plain:.0f} samples/s", what="(turns with the next row)")
            row(f"min_ddp's loop, world {world}, {world} x 128", f"{med[f'world{world}']:.0f} samples/s",
                [r for _, _, r in runs[f"world{world}"]], "the plain loop, turn by turn",
                "ddp2_vs_plain" if world == 2 else "world1_vs_plain")
    if "gloo2" in runs:
        row("the same, world 2, gloo's all-reduce", f"{med['gloo2']:.0f} samples/s",
            what=f"{statistics.median(r for _, _, r in runs['gloo2']):.3f}x its plain loop, turn by turn")
        row("raw DDP (tutorial as written), world 2", f"{med['raw2']:.0f} samples/s")
        raw = [d[1] / max(a, b) for d, a, b in zip(runs["world2"], runs["raw2"], runs["raw2_1thread"], strict=False)]
        row("raw DDP, 1 thread/process, world 2", f"{med['raw2_1thread']:.0f} samples/s", raw,
            "the faster raw: min_ddp's loop", "ddp2_vs_raw")
        row("trivial 2-process job: launch()", f"{med['launch_s']:.2f} s",
            [a / b for a, b in zip(runs["launch_s"], runs["torchrun_s"], strict=True)], "torchrun",
            "launch_vs_torchrun")
        row("trivial 2-process job: torchrun", f"{med['torchrun_s']:.2f} s")
        row("fail-fast: raise -> launcher exit", f"{med['fail_fast_s']:.2f} s", runs["fail_fast_s"], "", "fail_fast_s")
    if "srun2" in runs:
        row("python min_ddp.py --nprocs 2", f"{med['spawn2']:.0f} samples/s", what="2 epochs, its own count")
        row("srun -n 2 python min_ddp.py (no -c)", f"{med['srun2']:.0f} samples/s",
            [s / p for s, p in zip(runs["srun2"], runs["spawn2"], strict=False)], "--nprocs 2", "srun_vs_spawn")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="timed steps per throughput run")
    p.add_argument("--json", action="store_true", help="print every run's measurements as JSON")
    p.add_argument("--srun", action="store_true", help="only the SLURM row (needs a cluster: bash .ci/slurm up)")
    p.add_argument("--save", action="store_true", help="only a Checkpointer save, 64 MB of state per rank")
    p.add_argument("--start", action="store_true", help="only a good start by hand: ours against torch's env://")
    p.add_argument("--world3", action="store_true", help="only world 3: what bitwise resume costs")
    p.add_argument("--items", action="store_true", help="only seeded_dataset's cost per item read")
    p.add_argument("--streams", action="store_true", help="only stop_together's cost per step of min_ddp's loop")
    p.add_argument("--sharded", action="store_true", help="only sharded_stream's records/s against one by hand")
    p.add_argument("--slow-rank", action="store_true", help="only SlowRank's cost per step of min_ddp's loop")
    p.add_argument("--start-rank", choices=["ours", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # the trivial job, run as a command
    p.add_argument("--fail-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1 or args.steps < 1:
        p.error(f"--runs and --steps must be >= 1, got: --runs {args.runs} --steps {args.steps}")
    if args.job:
        return dist.launch(job_worker, args.fail_file, nprocs=2)
    if args.start_rank:
        return start_rank(args.start_rank)
    if args.start:
        pairs = [(start_seconds("torch"), start_seconds("ours")) for _ in range(args.runs)]  # alternating
        extra = sorted(ours - raw for raw, ours in pairs)
        print(f"a good start by hand, 2 ranks, one host: torch's env:// median "
              f"{statistics.median(r for r, _ in pairs):.3f} s, ours {statistics.median(o for _, o in pairs):.3f} s; "
              f"ours minus torch's, pair by pair: median {statistics.median(extra):+.3f} s (runs: {extra[0]:+.3f} to "
              f"{extra[-1]:+.3f}; target <= +0.3)")
        return None
    if args.world3:
        return print(world3(args.steps, args.runs))
    if args.items:
        return print(items())
    if args.streams:
        pairs = run_launched(streams_worker, 2, args.steps, 2 * args.runs + 1)
        added = sorted(wrapped / plain - 1 for plain, wrapped in pairs)
        print(f"stop_together, world 2, min_ddp's loop ({len(pairs)} epoch pairs of {args.steps} steps, alternating): "
              f"a step {statistics.median(p for p, _ in pairs) * 1e3:.2f} ms plain, "
              f"{statistics.median(w for _, w in pairs) * 1e3:.2f} ms wrapped; added: median "
              f"{statistics.median(added) * 100:+.2f}% (pairs: {added[0] * 100:+.2f}% to {added[-1] * 100:+.2f}%; "
              "target <= 1%)")
        return None
    if args.slow_rank:
        found = run_launched(slow_rank_worker, 2, args.steps, 2 * args.runs + 1)
        pairs, (plain_tiny, watched_tiny) = found["pairs"], found["tiny"]
        added = sorted(watched / plain - 1 for plain, watched in pairs)
        own_us = sorted((w - p) * 1e6 for p, w in zip(plain_tiny, watched_tiny, strict=True))
        print(f"SlowRank's own work, a 2-parameter model's step (5 pairs of 2,000 steps): "
              f"{statistics.median(plain_tiny) * 1e6:.0f} us plain, +{statistics.median(own_us):.0f} us watched "
              f"(pairs {own_us[0]:+.0f} to {own_us[-1]:+.0f} us)")
        print(f"SlowRank, world 2, min_ddp's loop ({len(pairs)} epoch pairs of {args.steps} steps, alternating): "
              f"a step {statistics.median(p for p, _ in pairs) * 1e3:.2f} ms plain, "
              f"{statistics.median(w for _, w in pairs) * 1e3:.2f} ms watched; added: median "
              f"{statistics.median(added) * 100:+.2f}% (pairs: {added[0] * 100:+.2f}% to {added[-1] * 100:+.2f}%; "
              "target <= 1%)")
        return None
    if args.sharded:
        with tempfile.TemporaryDirectory() as tmp:
            pairs = run_launched(sharded_worker, 2, write_shards(tmp), args.runs)
        ratios = sorted(ours / hand for hand, ours in pairs)
        print(f"sharded_stream, world 2, 2 loader workers a rank, {SHARD_FILES} CSV shards of {SHARD_RECORDS} records "
              f"({len(pairs)} pairs, alternating): by hand {statistics.median(h for h, _ in pairs):,.0f} records/s, "
              f"sharded_stream {statistics.median(o for _, o in pairs):,.0f}; ratio: median "
              f"{statistics.median(ratios):.3f} (pairs {ratios[0]:.3f} to {ratios[-1]:.3f}; target >= 0.9)")
        return None
    if args.save:
        found = run_launched(save_worker, 2, 2 * args.runs + 1)
        seconds = found["seconds"][1:]  # the first save also pays its first-time costs
        print(f"save, 64 MB state per rank, world 2: median {statistics.median(seconds):.2f} s (runs: "
              f"{min(seconds):.2f}-{max(seconds):.2f}); peak memory above the state, per rank: "
              f"{', '.join(f'{mb:.0f} MB' for mb in found['peak_mb'])}")
        return None
    if args.srun and not slurm_answers():
        p.error("--srun needs an idle SLURM node (sinfo); on this machine: bash .ci/slurm up")
    runs: dict[str, list] = {name: [] for name in configs(args.steps, args.srun)}
    for _ in range(args.runs):
        for name, measure in configs(args.steps, args.srun).items():
            runs[name].append(measure())
    print(json.dumps(runs, indent=2) if args.json else table(runs, args.runs))


if __name__ == "__main__":
    main()
