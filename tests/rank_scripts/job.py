"""A job whose ranks misbehave on request (test_launch.py): python job.py BEHAVIOUR RANK NPROCS [TIMEOUT].

RANK is the rank that misbehaves. Each rank writes its parent's pid into a file in $READY_DIR once connected.
With JOB_THREAD set, the launcher runs a second thread; with LAUNCHER_SEES_CUDA set, the launcher (only)
believes a GPU is visible, as on a GPU machine where the job itself chose gloo.
"""
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpointer
import distributed
from slow_rank import SlowRank


def spin():
    while True:
        pass


def abort_here():
    time.sleep(0.2)
    os.abort()


def kill_the_rank(rank_pid, worker_id):
    with contextlib.suppress(ProcessLookupError):   # the other loader worker was first
        os.kill(rank_pid, signal.SIGKILL)


def write_whole(directory, name, text):
    """The test counts and reads the files in ``directory`` as they appear: each comes whole, from a temporary
    file beside the directory (one inside would be counted)."""
    with open(f"{directory}.{name}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{directory}.{name}.tmp", os.path.join(directory, name))


def worker(local_rank, world_size, behaviour, bad_rank, timeout, ready_dir):
    distributed.init_process_group(local_rank, world_size, timeout=timeout)
    distributed.reduce(torch.ones(1))               # everyone is connected
    rank = distributed.get_rank()
    write_whole(ready_dir, f"ready{rank}", str(os.getppid()))
    if behaviour == "raise-leaving-a-child":           # what a rank starts and leaves running (an upload, say)
        child = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        write_whole(ready_dir, f"child{rank}", str(child.pid))
        distributed.reduce(torch.ones(1))           # every rank has started its own before one fails
        if rank == bad_rank:
            raise ValueError(f"root cause on rank {rank}")
        time.sleep(3600)                            # no collective to fail in: the launcher's SIGTERM kills it
    if behaviour == "raise" and rank == bad_rank:
        time.sleep(0.2)                             # the others are already waiting below
        raise ValueError(f"root cause on rank {rank}")
    if behaviour == "sigkill" and rank == bad_rank:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "sigkill-seen-late" and rank == bad_rank:
        torch.distributed.destroy_process_group()   # its peers fail at once ("connection closed")
        time.sleep(0.2)                             # its own death reaches the launcher after theirs
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "sigkill-when-told" and rank == bad_rank:
        while not os.path.exists(ready_dir + ".go"):  # the test has stopped the launcher first
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "sigkill-as-loader-starts" and rank == bad_rank:
        # Killed before its DataLoader workers enter their loop: torch's watchdog there then takes init for
        # their parent, and they never see the death (as when the OOM killer strikes at an epoch's start).
        init = functools.partial(kill_the_rank, os.getpid())
        next(iter(torch.utils.data.DataLoader(range(4), num_workers=2, worker_init_fn=init)))
    if behaviour == "segv" and rank == bad_rank:
        ctypes.string_at(0)                         # a crash in C code: SIGSEGV
    if behaviour == "wait":
        time.sleep(3600)
    if behaviour == "ignore-sigterm":               # the launcher waits its grace period, then SIGKILLs
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    if behaviour == "spin" and rank == bad_rank:
        spin()                                      # never returns: the others wait below
    if behaviour == "read" and rank == bad_rank:
        os.read(os.pipe()[0], 1)                    # blocked in a C call, forever
    if behaviour == "slow-then-hang":               # SlowRank names the late rank, which then never arrives
        ddp = DDP(torch.nn.Linear(2, 1))
        watch = SlowRank(ddp, every=2)
        for step, x in enumerate(watch.batches([torch.ones(1, 2)] * 5)):
            time.sleep(0.05 if rank == bad_rank else 0)
            if rank == bad_rank and step == 4:
                time.sleep(3600)
            ddp(x).sum().backward()
    if behaviour == "primary-only":
        if distributed.is_primary():
            distributed.reduce(torch.ones(1))       # a collective on the primary alone
        distributed.barrier()
    if behaviour == "abort" and rank == bad_rank:
        abort_here()                                # as NCCL's watchdog aborts a rank (SIGABRT)
    if behaviour == "leave" and rank == bad_rank:
        return                                      # finishes early: its peers wait below
    if behaviour == "library-calls":                # the healthy ranks wait inside calls that are not ours
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = checkpointer.Checkpointer(None, model, optimizer, check_every=1)
        if rank == bad_rank:
            time.sleep(3600)                        # it never reaches a collective
        elif rank == 0:
            optimizer.step()
            ckpt.step()                             # waits in the stop check's all-reduce
        else:
            # The user's own call of torch.distributed, of the stop check's size and dtype: of another size,
            # gloo may see the mismatch and fail at once instead of waiting (then no rank waits to be reported).
            torch.distributed.all_reduce(torch.zeros(3, dtype=torch.float64))
    distributed.reduce(torch.ones(1))               # where the healthy ranks wait
    distributed.print_primary("job ok")
    distributed.cleanup()


if __name__ == "__main__":
    behaviour, bad_rank, nprocs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    if os.environ.get("JOB_THREAD"):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    if os.environ.get("LAUNCHER_SEES_CUDA"):
        torch.cuda.is_available = lambda: True      # the launcher's view only: the ranks import torch afresh
    distributed.launch(worker, behaviour, bad_rank, timeout, os.environ["READY_DIR"], nprocs=nprocs,
                       grace=float(os.environ.get("GRACE", 25)))
