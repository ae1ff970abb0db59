"""A user's own iteration loop as nanoGPT writes it, on a Checkpointer (test_stop.py):

    python own_loop.py SNAPSHOT OUT [--nprocs 2] [--batch 16] [--iters 30] [--stop N] [--sleep S]
                       [--check-every K] [--save-interval S]

No epochs, no sampler: each rank draws its batches from its global generator seeded 1337 + rank, and its targets'
noise from a torch.Generator kept in `state`; the loop keeps the best loss, a sum, each rank's running totals in a
tensor it updates in place through its own name (`totals`), and an LR scheduler. Rank 1 signals itself (SIGUSR1) before
its STOP-th iteration of this run (0: never); --sleep makes every iteration take S seconds longer. Rank 0 prints
each rank's first batch of this run and how many iterations this run trained; OUT gets the final model and state.
"""
import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
from checkpointer import Checkpointer


def worker(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    distributed.init_process_group(local_rank, world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    torch.manual_seed(1337 + distributed.get_rank())  # nanoGPT: each rank draws its own batches
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    noise = torch.Generator().manual_seed(7)
    totals = torch.zeros(2, dtype=torch.float64)  # this rank's loss sum and steps: updated through this name
    state = {"best_loss": float("inf"), "loss_sum": 0.0, "totals": totals, "scheduler": scheduler, "noise": noise}
    try:
        ckpt = Checkpointer(args.snapshot, model, optimizer, batch_size=args.batch, state=state,
                            check_every=args.check_every, save_interval=args.save_interval)
        ddp = DDP(model) if world_size > 1 else model
        trained = 0
        for iteration in ckpt.iterations(args.iters):
            if trained + 1 == args.stop and distributed.get_rank() == min(1, world_size - 1):
                os.kill(os.getpid(), signal.SIGUSR1)
            x = torch.randn(args.batch, 8, dtype=torch.float64)
            if trained == 0:
                distributed.print_primary("first batches:", *distributed.all_gather(x.sum()).tolist())
            target = x.sum(1, keepdim=True).sin() + 0.01 * torch.randn(args.batch, 1, generator=noise,
                                                                         dtype=torch.float64)
            loss = F.mse_loss(ddp(x), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            mean = distributed.reduce(loss.detach(), "mean").item()
            state["best_loss"] = min(state["best_loss"], mean)
            state["loss_sum"] += mean
            totals += torch.stack([loss.detach(), torch.tensor(1.0, dtype=torch.float64)])
            trained += 1
            distributed.print_primary(f"iteration {iteration + 1}", flush=True)
            time.sleep(args.sleep)
            ckpt.step()
        distributed.print_primary(f"trained {trained} iterations")
        distributed.save_checkpoint({"model": model.state_dict(), "best": state["best_loss"],
                                     "sum": state["loss_sum"], "totals": distributed.all_gather(totals)}, args.out)
    finally:
        distributed.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot")
    p.add_argument("out")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--stop", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--check-every", type=int, default=None)
    p.add_argument("--save-interval", type=float, default=1800.0)
    args = p.parse_args()
    distributed.launch(worker, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
