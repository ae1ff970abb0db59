"""Minimal data-parallel training with distributed.py: a classifier on built-in synthetic data, printing each rank's
and the global loss/accuracy every --log-every steps, and an exact validation every epoch.

    python min_ddp.py                                   # every visible GPU, else one CPU process
    python min_ddp.py --nprocs 2 --slow-rank            # 2 gloo processes on CPU; which rank holds the others back
    torchrun --standalone --nproc_per_node=2 min_ddp.py # the same script under torchrun
    srun -n 2 python min_ddp.py                         # ... and under SLURM
    python min_ddp.py --print-config > cfg.json         # the settings as JSON; edit, then --config cfg.json
    python min_ddp.py --snapshot run.pt --epochs 10     # resumes if run.pt exists; SIGTERM/USR1/USR2 save there, exit
"""
import argparse
import contextlib
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch's at import: numpy is not needed here
os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")  # and in launch()'s processes
import torch  # noqa: E402
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import distributed
from checkpointer import Checkpointer  # optional: exact resume and clean stops
from min_ddp_cli import SettingsError, parse_args  # the flags, --config, and their checks
from shared_memory_allreduce import shared_memory_allreduce  # optional: delete it and its line in wrap()
from slow_rank import SlowRank  # optional: which rank the others wait for (--slow-rank)
from sync_batchnorm import sync_batchnorm  # optional: BatchNorm on the global batch (--sync-bn)

FEATURES, CLASSES, VAL_SIZE, DATA_SEED = 32, 10, 4096, 1234  # the data is fixed; --seed: the init, the order


def main_worker(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = distributed.init_process_group(local_rank, world_size, timeout=args.timeout)
    try:
        train(args, device)
    finally:
        distributed.cleanup()  # after a stop too: every rank saved the same step and ends normally


def train(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    layers = [nn.Linear(FEATURES, 256, bias=False), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(256, CLASSES)).to(device)
    model = sync_batchnorm(model) if args.sync_bn else model  # BatchNorm on the global batch
    world = distributed.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_set, val = make_dataset("train", args.train_size), make_dataset("val", VAL_SIZE)
    sampler = distributed.data_sampler(train_set, shuffle=True, seed=args.seed)  # this rank's share
    if args.batch_size > len(sampler):
        raise SettingsError(f"--batch-size {args.batch_size} is more than each process's share of the training data "
                            f"({len(sampler)} samples at world size {world}); use --batch-size {len(sampler)} or less")
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=device.type == "cuda")
    val_loader = DataLoader(val, args.batch_size, sampler=distributed.data_sampler(val, shuffle=False, pad=False))
    zeros = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples: summable over ranks
    metrics = {"unlogged": zeros, "epoch": zeros.clone(), "train_loss": float("nan"), "world": world}
    try:  # restores the model, optimizer, RNG, position and metrics from --snapshot if it exists
        ckpt = Checkpointer(args.snapshot, model, optimizer, loader=loader, grad_accum=args.grad_accum,
                            settings={"--seed": args.seed, "--lr": args.lr, "--train-size": args.train_size},
                            state=metrics, check_every=args.check_every)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    if metrics["world"] != world:  # resumed at another world size: per-rank sums cannot be split; the Checkpointer
        metrics.update(unlogged=metrics["unlogged"].zero_(), world=world)  # restored rank 0's into this very tensor
    ddp_model, allreduce, watch = wrap(model, device, args)
    backend = torch.distributed.get_backend() if world > 1 else "none"
    distributed.print_primary(f"mode={distributed.launch_mode()} world={world} backend={backend} allreduce={allreduce} "
                              f"device={device.type} threads={torch.get_num_threads()}")
    started, samples = time.perf_counter(), 0
    val_loss, correct, count = evaluate(model, val_loader) if ckpt.epoch >= args.epochs else (0, 0, 1)
    for epoch in ckpt.epochs(args.epochs):  # it calls sampler.set_epoch (a new shuffle; mid-epoch: what is left)
        samples += len(loader) * args.batch_size * world
        metrics["train_loss"] = train_epoch(ddp_model, watch, loader, optimizer, ckpt, metrics, args)
        val_loss, correct, count = evaluate(model, val_loader)
        distributed.print_primary(f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | val_acc "
                                  f"{correct / count:.4f} ({correct:.0f}/{count:.0f}) | "
                                  f"{samples / (time.perf_counter() - started):.0f} samples/s")
        metrics["epoch"].zero_()
    if args.save_model:
        distributed.save_checkpoint(model.state_dict(), args.save_model)
    speed = f" samples_per_s={samples / (time.perf_counter() - started):.0f}" if samples else ""  # none trained
    distributed.print_primary(f"done: world={world} epochs={args.epochs} train_loss={metrics['train_loss']:.4f} "
                              f"val_loss={val_loss:.4f} val_acc={correct / count:.4f}{speed}")


def wrap(model: nn.Module, device: torch.device, args: argparse.Namespace) -> tuple[nn.Module, str, SlowRank]:
    """DDP beyond one process (gradients as bucket views: one copy less a step), its all-reduce, and its SlowRank."""
    if distributed.get_world_size() == 1:
        return model, "none", SlowRank(model)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    watch = SlowRank(ddp, enabled=args.slow_rank)  # before the all-reduce's hook, which it wraps; alone: nothing
    shared = shared_memory_allreduce(ddp, args.timeout)  # CPU ranks on one host; elsewhere False, nothing changed
    return ddp, "shared-memory" if shared else torch.distributed.get_backend(), watch


def make_dataset(split: str, size: int) -> list[tuple[torch.Tensor, int]]:
    """(input, label) pairs of Gaussian blobs, one per class, the same on every rank: a list is a dataset."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(DATA_SEED))
    gen = torch.Generator().manual_seed(DATA_SEED + (1 if split == "train" else 2))
    labels = torch.randint(CLASSES, (size,), generator=gen)
    return list(zip(centers[labels] * 0.75 + torch.randn(size, FEATURES, generator=gen), labels.tolist(), strict=True))


def train_epoch(model: nn.Module, watch: SlowRank, loader: DataLoader, optimizer: torch.optim.Optimizer,
                ckpt: Checkpointer, metrics: dict, args: argparse.Namespace) -> float:
    """The rest of this epoch, a step every --grad-accum batches; returns the epoch's global mean training loss."""
    model.train()
    device, accum = next(model.parameters()).device, args.grad_accum
    first = ckpt.epoch_steps * accum  # batches done before a mid-epoch resume (the sampler skips them)
    batches, stats = first + len(loader), metrics["unlogged"]
    for i, (x, y) in enumerate(watch.batches(loader), start=first):  # the loader's batches, timed
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        group_start = i - i % accum  # this batch's accumulation group: its first batch,
        group = min(accum, batches - group_start)  # its size (an epoch's last group may be short),
        last_of_group = i + 1 == group_start + group  # and whether this batch ends it (all-reduce, step)
        loss, logits = micro_step(model, x, y, last_of_group, group)
        stats[:2] += torch.stack([loss * len(y), (logits.argmax(1) == y).sum()])
        stats[2] += len(y)  # a Python number: no copy to the device, no wait for it
        if (i + 1) % args.log_every == 0 or i + 1 == batches:
            metrics["epoch"] += log_metrics(stats, f"epoch {ckpt.epoch + 1} step {i + 1}/{batches}")
            stats.zero_()
        if last_of_group:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ckpt.step()  # a snapshot, or a stop, when due
    return (metrics["epoch"][0] / metrics["epoch"][2]).item()


def micro_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, last_of_group: bool, group: int) -> tuple:
    """Forward and backward of 1/group of a group's mean loss; only the group's last batch all-reduces."""
    with model.no_sync() if isinstance(model, DDP) and not last_of_group else contextlib.nullcontext():
        logits = model(x)  # inside no_sync too: DDP decides at the forward whether the backward all-reduces
        loss = F.cross_entropy(logits, y)
        (loss / group).backward()
    return loss.detach(), logits


def log_metrics(stats: torch.Tensor, where: str) -> torch.Tensor:
    """Print every rank's (loss sum, correct, samples) and their sum, from one all-gather (on all ranks); returns it."""
    per_rank = distributed.all_gather(stats)
    if distributed.is_primary():
        for rank, (loss_sum, correct, count) in enumerate(per_rank.tolist()):
            print(f"[rank {rank}] {where} | loss {loss_sum / count:.4f} | acc {correct / count:.4f}")
        loss_sum, correct, count = per_rank.sum(0).tolist()
        print(f"[global] {where} | loss {loss_sum / count:.4f} | acc {correct / count:.4f} "
              f"({correct:.0f}/{count:.0f})", flush=True)
    return per_rank.sum(0)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float, float]:
    """Global (mean loss, correct, samples), each sample once; on the plain module: ranks' batch counts differ."""
    model.eval()
    device = next(model.parameters()).device
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:  # per-sample losses summed in float64: the same total however samples are batched
        logits, y = model(x.to(device)), y.to(device)
        stats += torch.stack([F.cross_entropy(logits, y, reduction="none").double().sum(),
                              (logits.argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    loss_sum, correct, count = distributed.reduce(stats).tolist()  # sums and counts, never means
    return loss_sum / count, correct, count


def main() -> None:
    args = parse_args(description=__doc__)
    try:
        distributed.launch(main_worker, args, nprocs=args.nprocs)
    except SettingsError as e:
        sys.exit(f"min_ddp: {e}")
    except KeyboardInterrupt:
        print("min_ddp: interrupted", file=sys.stderr)
        sys.exit(130)  # what a shell reports for Ctrl-C


if __name__ == "__main__":
    main()
