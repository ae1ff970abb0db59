"""Optional: average DDP's CPU gradients through shared memory instead of gloo's loopback TCP.

Copy it next to distributed.py (which it uses) when your ranks are CPU processes on one host:

    ddp = DDP(model)
    shared_memory_allreduce(ddp)    # all ranks; returns False and changes nothing where it cannot work

Why: gloo sends the gradients through loopback TCP, and on busy cores each of its wake-ups costs
milliseconds. Here the ranks share one /dev/shm mapping instead (BENCHMARKS.md has the numbers).
Its correctness rests on x86-64 store ordering (see _SharedGradients), hence the platform check.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

import distributed

__all__ = ["shared_memory_allreduce"]


def shared_memory_allreduce(
    model: DistributedDataParallel, timeout: datetime.timedelta | float | None = None
) -> bool:
    """Average DDP's gradients through shared memory when all ranks are CPU processes on this host.

    Must be called on all ranks, right after ``DDP(model)``. Returns True if it registered the
    comm hook; False when gloo's all-reduce stays (nothing changes): a world of one, a backend other
    than gloo, GPU parameters, ranks on several hosts, not Linux on x86-64, or a /dev/shm with less
    than twice the room needed: (world size - 1) x the largest bucket (DDP's bucket_cap_mb, 25 MB,
    plus one parameter, or all the gradients if smaller).

    The result is DDP's own mean (each rank divides by the world size, then the shares are summed):
    bitwise what gloo gives for two ranks; for more, the sum runs in rank order, so it can differ
    from gloo's ring order in the last bit, never between ranks, and never with DDP's bucket layout:
    a resume is bitwise at any number of processes.

    How: each rank sums one chunk of every bucket from the shares the others wrote to the shared
    mapping, and copies the other chunks' sums back, with a spin barrier between. A rank that dies
    is noticed within 0.1 s and a rank that stalls fails after ``timeout`` (default
    ``distributed.DEFAULT_TIMEOUT``), as a gloo collective would.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"shared_memory_allreduce: expected a DistributedDataParallel model, got: "
                        f"{type(model).__name__}; wrap it first: DDP(model)")
    if (distributed.get_world_size() == 1 or torch_dist.get_backend() != "gloo"
            or model.process_group != torch_dist.group.WORLD):
        return False
    local_ok = (sys.platform == "linux" and platform.machine() == "x86_64"
                and all(p.device.type == "cpu" for p in model.parameters()))
    grad_bytes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    # DDP closes a bucket once it reaches bucket_bytes_cap, so its last parameter may overshoot.
    bucket_bytes = min(sum(grad_bytes), model.bucket_bytes_cap + max(grad_bytes, default=0))
    if timeout is None:
        timeout = distributed.DEFAULT_TIMEOUT
    elif not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    if not timeout.total_seconds() > 0:
        raise ValueError(f"shared_memory_allreduce: timeout must be positive, got: {timeout!r}")
    state = _SharedGradients.attach(local_ok, bucket_bytes, timeout)
    if state is None:
        return False
    model.register_comm_hook(state, _shared_memory_hook)
    return True


class _SharedGradients:
    """The ranks' shared /dev/shm mapping: a flag per rank, then world x (world - 1) chunk regions.

    Each call cuts the bucket into one chunk per rank; rank c owns chunk c. Region (c, p) holds
    rank p's share of chunk c (its gradients / world), then the chunk's sum. A call: each rank
    writes its shares of the other ranks' chunks; barrier; each owner sums its chunk and writes
    the sum back over those shares; barrier; each rank copies the other chunks' sums into its
    bucket. A region is only ever used by its rank p and owner c, in turn, with a barrier at each
    hand-over (p writes | c reads, writes | p reads, then writes the next call), so one set of
    regions serves every call and every bucket, and the memory touched stays small (cache).

    Flags and regions are plain stores and loads. This relies on x86-64 never reordering a store
    with an earlier store or load, nor a load with an earlier load (a rank that sees a flag sees
    the regions written before it), hence the x86-64 check in shared_memory_allreduce.
    """

    LINE = 64  # one cache line per flag: a rank's writes do not disturb the flags its peers spin on
    SPIN_S, NAP_S, CHECK_S = 0.005, 0.0002, 0.1

    def __init__(self, memory: torch.Tensor, region_bytes: int, peers: list, timeout: datetime.timedelta):
        self.rank, self.world = distributed.get_rank(), distributed.get_world_size()
        self.memory = memory  # the mapping must outlive the raw flag pointers below
        # Each flag is a plain 8-byte load or store: a tensor op per access would cost far more, on
        # the critical path of every step.
        self.flags = [ctypes.c_int64.from_address(memory.data_ptr() + self.LINE * (1 + rank))
                      for rank in range(self.world)]
        self.regions = memory[self.LINE * (1 + self.world):].view(self.world * (self.world - 1), region_bytes)
        # A bucket fits if each of its chunks does; tensor_split's chunks differ by one element.
        self.max_bytes = (region_bytes - 16) * self.world  # 16: the largest element size
        self.views: dict[tuple[int, torch.dtype], tuple[list[int], list[list[Any]]]] = {}
        self.peers, self.timeout, self.calls = peers, timeout, 0

    @classmethod
    def attach(cls, local_ok: bool, bucket_bytes: int, timeout: datetime.timedelta) -> _SharedGradients | None:
        """Collective. Rank 0 creates the file; every rank maps it if it sees rank 0's token and
        every peer's process (same host, same /dev/shm, same PID namespace); else None on all."""
        world = distributed.get_world_size()
        region_bytes = -(-(-(-bucket_bytes // world) + 16) // cls.LINE) * cls.LINE
        size = cls.LINE * (1 + world) + world * (world - 1) * region_bytes
        token = int.from_bytes(os.urandom(8), "little") >> 1  # a positive int64
        created = _create_shm_file(size, token) if distributed.is_primary() and local_ok else None
        try:
            # Plain integers as one tensor: torch's object collectives would need numpy.
            mine = [local_ok, os.getpid(), _process_start(os.getpid()) or -1, created is not None, token]
            infos = distributed.all_gather(torch.tensor([int(v) for v in mine], dtype=torch.int64)).tolist()
            _, pid0, _, created0, token = infos[0]
            path = _shm_path(pid0, token) if created0 else None
            peers = [(pid, start) for _, pid, start, _, _ in infos]
            # Checked before mapping: torch.from_file(shared=True) creates a missing file, which on
            # another host would leave a stray one in its /dev/shm.
            ok = path is not None and all(info[0] for info in infos) and _sees(path, token, peers)
            memory = _map_shared(path, size) if ok else None
            if not distributed.reduce(memory is not None, "min").item():  # also: every rank has mapped it, or given up
                return None
            return cls(memory, region_bytes, peers, timeout)
        finally:
            if created:
                os.unlink(created)  # the mappings stay; nothing is left in /dev/shm, even after a crash

    def allreduce(self, grads: torch.Tensor) -> torch.futures.Future:
        """DDP's mean of this bucket: the ranks' shares (grads / world) summed in rank order."""
        if grads.numel() * grads.element_size() > self.max_bytes:  # not with DDP's bucketing; gloo if ever
            torch_dist.all_reduce(grads.div_(self.world))
            return _done(grads)
        self.calls += 1
        sizes, regions = self._regions(grads.numel(), grads.dtype)
        chunks, me = grads.split(sizes), self.rank
        for owner, chunk in enumerate(chunks):
            if owner != me:
                torch.div(chunk, self.world, out=regions[owner][me])
        self._meet(2 * self.calls - 1)
        self._sum_chunk(chunks[me], regions[me])
        self._meet(2 * self.calls)
        for owner, chunk in enumerate(chunks):
            if owner != me:
                chunk.copy_(regions[owner][me])
        return _done(grads)

    def _sum_chunk(self, mine: torch.Tensor, shares: list[Any]) -> None:
        """Owner's step: every rank's share of my chunk summed in rank order, ((s0 + s1) + s2) + ..., into
        ``mine`` and over the peers' shares. My own share is ``mine / world``, the same division as every
        peer's, so an element's sum depends on its values alone, not on which rank owns its chunk, which moves
        with DDP's bucket layout (a resumed DDP's first step runs in another one: bitwise resume at any world
        size). For two ranks it is bitwise gloo's result (a + b = b + a, and halving is exact unless the half is
        subnormal); for more it may differ from gloo's ring order in the last bit, never between ranks."""
        world, me = self.world, self.rank
        mine.div_(world)
        if me == 0:  # my share + rank 1's
            mine.add_(shares[1])
            later = range(2, world)
        else:  # the ranks below mine summed in rank 0's region, then + my share
            for rank in range(1, me):
                shares[0].add_(shares[rank])
            torch.add(shares[0], mine, out=mine)  # bitwise mine + shares[0]: IEEE addition commutes
            later = range(me + 1, world)
        for rank in later:
            mine.add_(shares[rank])
        for rank in range(world):
            if rank != me:
                shares[rank].copy_(mine)

    def _regions(self, numel: int, dtype: torch.dtype) -> tuple[list[int], list[list[Any]]]:
        """The chunk sizes (as tensor_split cuts) and region (c, p) cut to chunk c (None for p = c),
        for a bucket of this shape; made once per shape, not every call."""
        key = (numel, dtype)
        if key not in self.views:
            world = self.world
            sizes = [numel // world + (c < numel % world) for c in range(world)]

            def region(c: int, p: int) -> torch.Tensor | None:  # row-major, the diagonal left out
                if p == c:
                    return None
                return self.regions[c * (world - 1) + p - (p > c), :sizes[c] * dtype.itemsize].view(dtype)
            self.views[key] = (sizes, [[region(c, p) for p in range(world)] for c in range(world)])
        return self.views[key]

    def _meet(self, call: int) -> None:
        """Barrier: publish this rank's call number, wait until every rank's flag reaches it."""
        self.flags[self.rank].value = call
        started, check_at = time.monotonic(), self.CHECK_S
        while min(flag.value for flag in self.flags) < call:
            waited = time.monotonic() - started
            # A peer a few ms behind: spin (a sleeping rank wakes up late on busy cores). Far
            # behind (evaluating, saving): nap, so an oversubscribed machine keeps the core busy.
            if waited < self.SPIN_S:
                os.sched_yield()
            else:
                time.sleep(self.NAP_S)
            if waited > check_at:
                self._check_peers(call, waited)
                check_at = waited + self.CHECK_S

    def _check_peers(self, call: int, waited: float) -> None:
        late = [rank for rank in range(self.world) if self.flags[rank].value < call]
        for rank in late:
            pid, start = self.peers[rank]
            if _process_start(pid) != start:
                raise RuntimeError(f"shared_memory_allreduce: peer rank {rank} (pid {pid}) exited "
                                   "before the gradient all-reduce; its own error is the cause")
        if waited > self.timeout.total_seconds():
            raise RuntimeError(f"shared_memory_allreduce: timed out after {self.timeout} waiting for "
                               f"ranks {late} at the gradient all-reduce; pass a larger timeout= if a "
                               "rank legitimately works alone that long")


def _shared_memory_hook(state, bucket):  # no annotations: DDP checks them, and ours are strings
    return state.allreduce(bucket.buffer())


def _done(result: torch.Tensor) -> torch.futures.Future:
    """A Future that already holds ``result`` (what DDP hooks and async callers wait on)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return future


def _shm_path(pid: int, token: int) -> str:
    return f"/dev/shm/distributed-py-grads-{pid}-{token:x}"


def _create_shm_file(size: int, token: int) -> str | None:
    """A new /dev/shm file of ``size`` bytes starting with ``token``; its path, or None if there is
    no room. It may take at most half of the free space: DataLoader workers pass their batches
    through /dev/shm too, and a full one makes them fail.
    """
    path = _shm_path(os.getpid(), token)
    try:
        free = os.statvfs("/dev/shm")
        if size > free.f_bavail * free.f_frsize // 2:
            return None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS later
        os.pwrite(fd, token.to_bytes(8, "little"), 0)
        return path
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _sees(path: str, token: int, peers: list) -> bool:
    """This rank opens rank 0's file (same /dev/shm) and sees every peer's process (same PIDs)."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != token.to_bytes(8, "little"):
                return False
    except OSError:
        return False
    return all(_process_start(pid) == start for pid, start in peers)


def _map_shared(path: str, size: int) -> torch.Tensor | None:
    try:
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except (RuntimeError, OSError):  # this rank alone must not raise: the others would wait for it
        return None


def _process_start(pid: int) -> int | None:
    """A live process's start time (identifies it across PID reuse); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, *fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if state in ("Z", "X") else int(fields[18])
