"""Minimal data-parallel training with distributed.py: a classifier on built-in synthetic data.

    python min_ddp.py                                   # every visible GPU, else one CPU process
    python min_ddp.py --nprocs 2                        # 2 gloo processes on CPU
    torchrun --standalone --nproc_per_node=2 min_ddp.py # the same script under torchrun
    srun -n 2 python min_ddp.py                         # ... and under SLURM
    python min_ddp.py --print-config > cfg.json         # the settings as JSON; edit, then
    python min_ddp.py --config cfg.json --epochs 3      # flags override the file
    python min_ddp.py --snapshot run.pt --epochs 10     # resumes from run.pt if it exists

Every --log-every steps each rank prints its own loss/accuracy and the primary prints the global
ones (weighted by sample counts). Every epoch the whole validation set is evaluated exactly once
across the ranks (pad=False), so the validation metrics equal a one-process evaluation.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset

import distributed as dist

FEATURES, CLASSES = 32, 10
TRAIN_SIZE, VAL_SIZE = 16384, 4096
DATA_SEED = 1234  # the dataset is fixed; --seed changes the model init and the data order


def main_worker(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = dist.init_process_group(local_rank, world_size, timeout=args.timeout)
    try:
        train(args, device)
    finally:
        dist.cleanup()


def train(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first_epoch, train_loss = resume(args, model, optimizer)
    ddp_model, allreduce = wrap(model, device, args.timeout)
    train_set, val_set = make_dataset("train"), make_dataset("val")
    # Also distributed in a world of one: then its order is the global order of every world size.
    train_sampler = dist.data_sampler(train_set, True, shuffle=True, seed=args.seed)
    train_loader = batched_loader(train_set, train_sampler, args.batch_size)
    val_loader = batched_loader(val_set, dist.data_sampler(val_set, True, False, pad=False), args.batch_size)
    dist.print_primary(banner(device, allreduce))
    started, samples = time.perf_counter(), 0
    for epoch in range(first_epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle every epoch
        train_loss = train_epoch(ddp_model, train_loader, optimizer, args, epoch)
        samples += len(train_loader.dataset)
        val_loss, val_acc = evaluate(model, val_loader, device)
        elapsed = time.perf_counter() - started
        done = epoch + 1 - first_epoch
        dist.print_primary(
            f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | val_acc {val_acc:.4f} | "
            f"{samples / elapsed:.0f} samples/s | eta {elapsed / done * (args.epochs - epoch - 1):.1f}s"
        )
        if args.snapshot and ((epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs):
            dist.save_checkpoint(snapshot(model, optimizer, epoch + 1, train_loss, args), args.snapshot)
    if first_epoch >= args.epochs:  # the snapshot has every epoch already: report its model
        val_loss, val_acc = evaluate(model, val_loader, device)
    if args.save_model:
        dist.save_checkpoint(model.state_dict(), args.save_model)
    elapsed = time.perf_counter() - started
    dist.print_primary(
        f"done: world={dist.get_world_size()} epochs={args.epochs} train_loss={train_loss:.4f} "
        f"val_loss={val_loss:.4f} val_acc={val_acc:.4f} samples_per_s={samples / elapsed:.0f}"
    )


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, CLASSES))


def make_dataset(split: str) -> TensorDataset:
    """Gaussian blobs, one per class: deterministic, identical on every rank, nothing downloaded."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(DATA_SEED))
    size, offset = (TRAIN_SIZE, 1) if split == "train" else (VAL_SIZE, 2)
    gen = torch.Generator().manual_seed(DATA_SEED + offset)
    labels = torch.randint(CLASSES, (size,), generator=gen)
    inputs = centers[labels] * 0.75 + torch.randn(size, FEATURES, generator=gen)
    return TensorDataset(inputs, labels)


def batched_loader(dataset: TensorDataset, sampler: Sampler, batch_size: int) -> DataLoader:
    """Whole batches from in-memory tensors: one index tensor per batch, no per-sample collation.

    TensorDataset indexes its tensors with each batch's index tensor at once: 5% more samples/s
    than DataLoader(batch_size=...) here, and 39 instead of 119 us per batch than with the list
    that BatchSampler yields (torch converts a list of indices one by one).
    """
    return DataLoader(dataset, sampler=IndexBatches(sampler, batch_size), batch_size=None)


class IndexBatches(Sampler):
    """The sampler's order cut into batches (the last may be smaller), each one index tensor."""

    def __init__(self, sampler: Sampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        order = torch.tensor(list(self.sampler), dtype=torch.int64)
        return iter(order.split(self.batch_size) if len(order) else ())  # split() of nothing is one empty batch


def wrap(model: nn.Module, device: torch.device, timeout: float) -> tuple[nn.Module, str]:
    """DDP for more than one process, and how its gradients are averaged ("none" in one process).

    Gradients as views of DDP's buckets skip a copy per step. CPU ranks on one host average them
    through shared memory (dist.shared_memory_allreduce: 1.4x the samples/s of gloo's, bench.py).
    """
    if dist.get_world_size() == 1:
        return model, "none"
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if dist.shared_memory_allreduce(ddp, timeout):
        return ddp, "shared-memory"
    return ddp, torch.distributed.get_backend()


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                args: argparse.Namespace, epoch: int) -> float:
    """One pass over this rank's shard; returns the global mean training loss of the epoch."""
    model.train()
    device = next(model.parameters()).device
    steps = len(loader)
    metrics = EpochMetrics(epoch, steps, args.log_every, device)
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        group_start = step - step % args.grad_accum
        group_end = min(group_start + args.grad_accum, steps)
        # Micro-batches before the last of each group stay local: no all-reduce until the last.
        syncing = step + 1 == group_end
        with contextlib.nullcontext() if syncing or not isinstance(model, DDP) else model.no_sync():
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            micro_batches = group_end - group_start
            # Each micro-batch's share of the group's mean loss. Dividing by 1 is exact, but it adds an
            # op and a backward node to every step: skip it.
            (loss / micro_batches if micro_batches > 1 else loss).backward()
        if syncing:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        metrics.add(step, loss, logits, y)
    return metrics.mean_loss()


class EpochMetrics:
    """This rank's loss and accuracy in one epoch, logged every ``log_every`` steps without slowing
    the steps down (bench.py: under 1% of the step time at --log-every 10).

    Right after the optimizer's sweep through memory each small tensor op costs 10-40 us, so a step
    adds three (the eight that summed every step took 150 us: 1.7% of a world-1 step); the sums wait
    for 64 steps or the log step. Each log step's all-gather runs in the background and is printed
    one step later: waiting for it cost 1.5-2 ms per log step (gloo on busy cores), 2.4% in all.
    """

    def __init__(self, epoch: int, steps: int, log_every: int, device: torch.device):
        self.epoch, self.steps, self.log_every = epoch, steps, log_every
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (mean loss, hits) per step
        self.interval = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
        self.total = torch.zeros_like(self.interval)  # the same, summed over every rank
        self.logged: tuple[torch.futures.Future, int] | None = None  # a log step's all-gather, its step

    def add(self, step: int, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        """Record a step; on a log step (and always the last) start the all-gather of the interval."""
        self.pending.append((loss.detach(), logits.argmax(1) == y))
        self._print_logged()  # started a step ago, so finished: printing it waits for no rank
        logging = (step + 1) % self.log_every == 0 or step + 1 == self.steps
        if logging or len(self.pending) == 64:  # 64: the list stays small whatever --log-every is
            self.interval += interval_stats(self.pending)
            self.pending.clear()
        if logging:
            self.logged = (dist.all_gather(self.interval, async_op=True), step + 1)
            self.interval.zero_()  # all_gather copied it

    def mean_loss(self) -> float:
        """The global mean training loss of the epoch (after its last step's lines are printed)."""
        self._print_logged()
        loss_sum, _, count = self.total.tolist()
        return loss_sum / count

    def _print_logged(self) -> None:
        if self.logged is not None:
            future, step = self.logged
            self.total += log_interval(future.wait(), self.epoch, step, self.steps)
            self.logged = None


def interval_stats(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """This rank's (loss sum, correct, samples) in float64 from each step's (mean loss, hits)."""
    losses = torch.stack([loss for loss, _ in pending]).double()
    counts = torch.tensor([len(hits) for _, hits in pending], dtype=torch.float64, device=losses.device)
    correct = torch.cat([hits for _, hits in pending]).sum().double()
    return torch.stack([losses @ counts, correct, counts.sum()])


def log_interval(per_rank: torch.Tensor, epoch: int, step: int, steps: int) -> torch.Tensor:
    """Each rank's line, then the global one (sums of sample-weighted sums, never a mean of means).

    One all-gather of every rank's (loss sum, correct, samples) serves both, and its sum over the
    ranks (returned) adds up to the epoch's global totals without another collective: 4% of the
    step time at --log-every 10 with three collectives (print_ranked + reduce).
    """
    global_stats = per_rank.sum(0)
    if dist.is_primary():
        for rank, row in enumerate(per_rank.tolist()):
            print(f"[rank {rank}] {metrics_line(epoch, step, steps, *row)}")
        print(f"[global] {metrics_line(epoch, step, steps, *global_stats.tolist())}", flush=True)
    return global_stats


def metrics_line(epoch: int, step: int, steps: int, loss_sum: float, correct: float, count: float) -> str:
    return (f"epoch {epoch + 1} step {step}/{steps} | loss {loss_sum / count:.4f} | "
            f"acc {correct / count:.4f} ({correct:.0f}/{count:.0f})")


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Global validation loss and accuracy; every sample counted once (the sampler has pad=False).

    ``model`` is the plain module, not the DDP wrapper: ranks may hold different numbers of batches,
    and a DDP forward could start collectives that the other ranks never join.
    """
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        # Per-sample losses summed in float64: the total does not depend on how samples are batched.
        loss_sum = F.cross_entropy(logits, y, reduction="none").double().sum()
        stats += torch.stack([loss_sum, (logits.argmax(1) == y).sum().double(), torch.tensor(float(len(y)))]).to(stats)
    loss_sum, correct, count = dist.reduce(stats).tolist()
    return loss_sum / count, correct / count


# ----------------------------------------------------------------------------------------------
# Snapshots: everything an exact resume needs, all loadable with weights_only=True
# ----------------------------------------------------------------------------------------------


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, epochs_run: int, train_loss: float,
             args: argparse.Namespace) -> dict:
    """The data order needs no state: the sampler derives it from the seed and the epoch."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": epochs_run,
            "train_loss": train_loss, "rng": gather_rng_states(), "settings": resume_settings(args)}


def resume_settings(args: argparse.Namespace) -> dict:
    """What must match for a resume to continue the same run (world size alone may change)."""
    return {"seed": args.seed, "global_batch": args.batch_size * dist.get_world_size() * args.grad_accum,
            "world_size": dist.get_world_size()}


def resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, float]:
    """Load --snapshot if it exists; return (epochs already run, their last training loss)."""
    state = dist.load_checkpoint(args.snapshot) if args.snapshot else None
    if state is None:
        return 0, math.nan
    check_compatible(state, args)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"--snapshot {args.snapshot} holds a different model or optimizer than this "
                         f"script builds ({e}); use another --snapshot path") from e
    rng = state["rng"]
    torch.set_rng_state(rng[dist.get_rank()] if len(rng) == dist.get_world_size() else rng[0])
    dist.print_primary(f"resumed from {args.snapshot} after {state['epochs_run']} epoch(s)")
    return state["epochs_run"], state["train_loss"]


def check_compatible(state: dict, args: argparse.Namespace) -> None:
    missing = {"model", "optimizer", "epochs_run", "train_loss", "rng", "settings"} - state.keys()
    if missing:
        raise ValueError(f"--snapshot {args.snapshot} is not a min_ddp snapshot (missing {sorted(missing)})")
    saved, now = state["settings"], resume_settings(args)
    for key, hint in (("seed", "--seed"), ("global_batch", "--batch-size x processes x --grad-accum")):
        if saved[key] != now[key]:
            raise ValueError(
                f"--snapshot {args.snapshot} was written with {key}={saved[key]} (world size "
                f"{saved['world_size']}), this run has {key}={now[key]}: resuming would not continue the "
                f"same run. Keep {hint} equal to the snapshot's, or use another --snapshot path"
            )


def gather_rng_states() -> list[torch.Tensor]:
    """Every rank's CPU generator state (collective): all ranks resume their own random stream."""
    # Cloned rows: set_rng_state on a view into the stacked tensor (as saved, then loaded) crashes.
    return [state.clone() for state in dist.all_gather(torch.get_rng_state())]


def banner(device: torch.device, allreduce: str) -> str:
    backend = torch.distributed.get_backend() if dist.get_world_size() > 1 else "none"
    return (f"mode={dist.launch_mode()} world={dist.get_world_size()} backend={backend} "
            f"allreduce={allreduce} device={device.type} threads={torch.get_num_threads()}")


# ----------------------------------------------------------------------------------------------
# Settings: argparse flags, optionally on top of a JSON file
# ----------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got: {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=positive_int, default=None,
                   help="processes on this machine (default: visible GPUs, else 1); ignored under torchrun/srun")
    p.add_argument("--epochs", type=positive_int, default=5)
    p.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=positive_int, default=100, help="steps between metric lines")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds a collective may wait for a stuck rank before failing")
    p.add_argument("--save-model", default=None, metavar="PATH", help="write the final weights here")
    p.add_argument("--snapshot", default=None, metavar="PATH",
                   help="save training state here, and resume from it if it exists")
    p.add_argument("--save-every", type=positive_int, default=1, help="epochs between snapshots")
    p.add_argument("--config", default=None, metavar="FILE.json", help="settings from JSON; flags override")
    p.add_argument("--print-config", action="store_true", help="print the settings as JSON and exit")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**read_config(args.config, parser))
        args = parser.parse_args(argv)  # the command line wins over the file
    for flag, path in (("--snapshot", args.snapshot), ("--save-model", args.save_model)):
        if path:
            check_writable(flag, path, parser)
    return args


def check_writable(flag: str, path: str, parser: argparse.ArgumentParser) -> None:
    """Fail before training, not after hours of it, when the file could never be written."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        parser.error(f"{flag} {path}: cannot write in {directory} ({e.strerror}); "
                     "create the directory, make it writable, or choose another path")


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """Settings from a JSON object whose keys are the long flags' names (batch_size, lr, ...)."""
    try:
        with open(path, encoding="utf-8") as f:
            settings = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"--config {path}: {e}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "print_config")}
    if not isinstance(settings, dict):
        parser.error(f"--config {path}: expected a JSON object, got: {type(settings).__name__}")
    for key, value in settings.items():
        if key not in actions:
            parser.error(f"--config {path}: unknown setting {key!r}; known: {', '.join(sorted(actions))}")
        if value is not None and actions[key].type is not None:
            try:
                settings[key] = actions[key].type(str(value))
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"--config {path}: {key}={value!r}: {e}")
    return settings


def config_json(args: argparse.Namespace) -> str:
    settings = {k: v for k, v in vars(args).items() if k not in ("config", "print_config")}
    return json.dumps(settings, indent=2)


if __name__ == "__main__":
    args = parse_args()
    if args.print_config:
        print(config_json(args))
    else:
        dist.launch(main_worker, args, nprocs=args.nprocs)
