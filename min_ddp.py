"""Minimal data-parallel training with distributed.py: a classifier on built-in synthetic data.

    python min_ddp.py                                   # every visible GPU, else one CPU process
    python min_ddp.py --nprocs 2                        # 2 gloo processes on CPU
    torchrun --standalone --nproc_per_node=2 min_ddp.py # the same script under torchrun
    srun -n 2 python min_ddp.py                         # ... and under SLURM
    python min_ddp.py --print-config > cfg.json         # the settings as JSON; edit, then
    python min_ddp.py --config cfg.json --epochs 3      # flags override the file
    python min_ddp.py --snapshot run.pt --epochs 10     # resumes from run.pt if it exists; on SIGTERM,
                                                        # SIGUSR1 or SIGUSR2 saves there and exits

Prints each rank's and the global loss/accuracy every --log-every steps, and an exact validation every epoch.
"""
import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import warnings
from typing import Callable

# torch warns at import that numpy is missing; nothing here needs it. PYTHONWARNINGS: the same for the
# processes launch() starts, whose forkserver imports torch before this file.
warnings.filterwarnings("ignore", "Failed to initialize NumPy")
os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import distributed
from shared_memory_allreduce import shared_memory_allreduce  # optional: delete it and its line in wrap()

FEATURES, CLASSES, TRAIN_SIZE, VAL_SIZE = 32, 10, 16384, 4096
DATA_SEED = 1234  # the dataset is fixed; --seed changes the model init and the data order
LOSS_SUM, CORRECT, SAMPLES = range(3)  # a metrics tensor: sums over samples (never means), summable over ranks
MAX_REQUEUES = 20  # a job that keeps being stopped is requeued at most this often (SLURM_RESTART_COUNT)
REQUEUE_EXIT = 75  # EX_TEMPFAIL: a requeue was due but scontrol failed; RequeueExit=75 in slurm.conf acts on it


class SettingsError(ValueError):
    """A setting this run cannot use: reported in one line, without a traceback."""


class Stopped(Exception):
    """A stop signal arrived and every rank has saved the same step: exit with ``code``."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def main_worker(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = distributed.init_process_group(local_rank, world_size, timeout=args.timeout)
    code = 0
    try:
        train(args, device)
    except Stopped as stop:  # every rank saved the same step: end as normally, then exit with its code
        code = stop.code  # (cleanup() inside this except would see an exception and, under nccl, skip destroy)
    finally:
        distributed.cleanup()
    if code:
        raise SystemExit(code)  # a shell's code for the signal; launch() knows it too


def train(args: argparse.Namespace, device: torch.device) -> None:
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_model().to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    at = resume(args, model, optimizer)  # where training is: epoch, batches done in it, their metrics
    ddp_model, allreduce = wrap(model, device, args.timeout)
    train_set, val_set = make_dataset("train", dtype), make_dataset("val", dtype)
    # A sampler in a world of one too: then every world size reads the same global order.
    train_sampler = distributed.data_sampler(train_set, True, shuffle=True, seed=args.seed)
    if args.batch_size > len(train_sampler):
        raise SettingsError(f"--batch-size {args.batch_size} is more than each process's share of the training data "
                            f"({len(train_sampler)} samples at world size {distributed.get_world_size()}): an epoch "
                            f"would be one short step; use --batch-size {len(train_sampler)} or less")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, worker_init_fn=ignore_stop_signals)
    val_sampler = distributed.data_sampler(val_set, True, shuffle=False, pad=False)  # no duplicates
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler)
    backend = torch.distributed.get_backend() if distributed.get_world_size() > 1 else "none"
    distributed.print_primary(f"mode={distributed.launch_mode()} world={distributed.get_world_size()} "
                              f"backend={backend} allreduce={allreduce} device={device.type} "
                              f"threads={torch.get_num_threads()}")
    started, samples, resumed_at, train_loss = time.perf_counter(), 0, dict(at), at["train_loss"]
    distributed.stop_requested()  # installs the stop handlers (before then a signal kills at once)
    for epoch in range(at["epoch"], args.epochs):
        train_sampler.set_epoch(epoch, skip=at["batches"] * args.batch_size)  # a new shuffle every epoch
        at["epoch"] = epoch
        train_loss = train_epoch(ddp_model, train_loader, optimizer, grad_accum=args.grad_accum,
                                 log_every=args.log_every, epoch=epoch, at=at,
                                 after_step=lambda: save_or_stop(args, model, optimizer, at, resumed_at))
        samples += len(train_set)
        val_loss, correct, count = evaluate(model, val_loader)
        distributed.print_primary(f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | val_acc "
                                  f"{correct / count:.4f} ({correct:.0f}/{count:.0f}) | "
                                  f"{samples / (time.perf_counter() - started):.0f} samples/s")
        at.update(epoch=epoch + 1, batches=0, train_loss=train_loss, totals=torch.zeros_like(at["totals"]))
        if args.snapshot and ((epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs):
            distributed.save_checkpoint(snapshot(model, optimizer, at, args), args.snapshot)
    if resumed_at["epoch"] >= args.epochs:  # the snapshot has every epoch already: report its model
        val_loss, correct, count = evaluate(model, val_loader)
    if args.save_model:
        distributed.save_checkpoint(model.state_dict(), args.save_model)
    speed = f" samples_per_s={samples / (time.perf_counter() - started):.0f}" if samples else ""  # none trained
    distributed.print_primary(f"done: world={distributed.get_world_size()} epochs={args.epochs} train_loss="
                              f"{train_loss:.4f} val_loss={val_loss:.4f} val_acc={correct / count:.4f}{speed}")


def wrap(model: nn.Module, device: torch.device, timeout: float) -> tuple[nn.Module, str]:
    """DDP for more than one process, and which all-reduce averages its gradients."""
    if distributed.get_world_size() == 1:
        return model, "none"
    # Gradients as views into DDP's all-reduce buckets: one copy of every gradient less per step.
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    shared = shared_memory_allreduce(ddp, timeout)  # CPU ranks on one host; elsewhere False, nothing changed
    return ddp, "shared-memory" if shared else torch.distributed.get_backend()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES))


def make_dataset(split: str, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, int]]:
    """(input, label) pairs of Gaussian blobs, one per class, the same on every rank: a list is a dataset."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(DATA_SEED))
    size, offset = (TRAIN_SIZE, 1) if split == "train" else (VAL_SIZE, 2)
    gen = torch.Generator().manual_seed(DATA_SEED + offset)
    labels = torch.randint(CLASSES, (size,), generator=gen)
    inputs = centers[labels] * 0.75 + torch.randn(size, FEATURES, generator=gen)
    return list(zip(inputs.to(dtype), labels.tolist()))


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, *, grad_accum: int = 1,
                log_every: int = 100, epoch: int = 0, at: dict | None = None,
                after_step: Callable[[], None] | None = None) -> float:
    """One pass over this rank's shard, an optimizer step every ``grad_accum`` batches, metrics every
    ``log_every`` steps; returns the global mean training loss of the epoch. ``at`` (min_ddp's, kept up
    to date) says where the epoch is: the batches already done (the sampler skips them) and their
    metrics. ``after_step()`` runs on all ranks after every optimizer step (snapshots, stops)."""
    model.train()
    device = next(model.parameters()).device
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # this rank's LOSS_SUM, CORRECT, SAMPLES
    at = at or {"batches": 0, "stats": stats, "totals": torch.zeros_like(stats)}  # totals: every rank's, logged
    stats, epoch_stats = at["stats"], at["totals"]
    steps = at["batches"] + len(loader)
    for step, (x, y) in enumerate(loader, start=at["batches"]):
        x, y = x.to(device), y.to(device)
        # A group of micro-batches adds up locally and all-reduces at its last (the epoch's last may be short).
        micro_batches = min(grad_accum, steps - step // grad_accum * grad_accum)
        syncing = (step + 1) % grad_accum == 0 or step + 1 == steps
        with model.no_sync() if isinstance(model, DDP) and not syncing else contextlib.nullcontext():
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            (loss / micro_batches).backward()  # each micro-batch's share of the group's mean loss
        if syncing:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        stats[LOSS_SUM:SAMPLES] += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum()])
        stats[SAMPLES] += len(y)  # a Python number: no copy to the device, no wait for it
        if (step + 1) % log_every == 0 or step + 1 == steps:
            epoch_stats += log_metrics(stats, f"epoch {epoch + 1} step {step + 1}/{steps}")
            stats.zero_()
        at["batches"] = step + 1
        if syncing and after_step is not None:
            after_step()
    return (epoch_stats[LOSS_SUM] / epoch_stats[SAMPLES]).item()


def log_metrics(stats: torch.Tensor, where: str) -> torch.Tensor:
    """Print every rank's (loss sum, correct, samples) and their global sum, from one all-gather
    (so it must be called on all ranks); returns the global sum."""
    per_rank = distributed.all_gather(stats)
    total = per_rank.sum(0)
    if distributed.is_primary():
        for rank, (loss_sum, correct, count) in enumerate(per_rank.tolist()):
            print(f"[rank {rank}] {where} | loss {loss_sum / count:.4f} | acc {correct / count:.4f}")
        loss_sum, correct, count = total.tolist()
        print(f"[global] {where} | loss {loss_sum / count:.4f} | acc {correct / count:.4f} "
              f"({correct:.0f}/{count:.0f})", flush=True)
    return total


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float, float]:
    """Global validation (mean loss, correct, samples), each sample counted once. ``model`` is the plain
    module: ranks may run different batch counts, and a DDP forward could start a collective others skip."""
    model.eval()
    device = next(model.parameters()).device
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # LOSS_SUM, CORRECT, SAMPLES
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        # Per-sample losses summed in float64: the total does not depend on how samples are batched.
        stats[LOSS_SUM:SAMPLES] += torch.stack([F.cross_entropy(logits, y, reduction="none").double().sum(),
                                                (logits.argmax(1) == y).sum()])
        stats[SAMPLES] += len(y)
    loss_sum, correct, count = distributed.reduce(stats).tolist()  # sums and counts, never means
    return loss_sum / count, correct, count


# --- Snapshots, stops and resumes: everything an exact resume needs, loadable with weights_only=True
def save_or_stop(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, at: dict,
                 resumed_at: dict) -> None:
    """After every optimizer step, on all ranks: a snapshot every --save-steps steps, and every
    --check-every steps (one all-reduce) a stop that all ranks agree on: save, requeue, exit."""
    step = -(-at["batches"] // args.grad_accum)  # optimizer steps into the epoch (the last may be short)
    if args.snapshot and args.save_steps and step % args.save_steps == 0:
        distributed.save_checkpoint(snapshot(model, optimizer, at, args), args.snapshot)
    if step % args.check_every or not (signum := distributed.stop_requested()):
        return
    if args.snapshot:
        distributed.save_checkpoint(snapshot(model, optimizer, at, args), args.snapshot)
    # Requeue for the time limit's early warning only (SIGTERM is also scancel), after progress, not forever.
    progressed = (at["epoch"], at["batches"]) > (resumed_at["epoch"], resumed_at["batches"])
    wanted = (args.snapshot and signum != signal.SIGTERM and progressed and "SLURM_JOB_ID" in os.environ
              and int(os.environ.get("SLURM_RESTART_COUNT", 0)) < MAX_REQUEUES)
    requeued = bool(distributed.reduce(distributed.requeue() if wanted else False, "max"))  # the primary asks
    distributed.print_primary(f"stopped by {signum.name} after batch {at['batches']} of epoch {at['epoch'] + 1}; "
                              + (f"saved to {args.snapshot}" if args.snapshot else "not saved (no --snapshot)")
                              + ("; requeued" if requeued else "; could not requeue" if wanted else ""))
    raise Stopped(REQUEUE_EXIT if wanted and not requeued else 128 + signum)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, at: dict, args: argparse.Namespace) -> dict:
    """Everything an exact resume needs; the sampler derives the data order from seed and epoch. Call
    it on all ranks: it gathers every rank's CPU generator state (cloned: set_rng_state on a view
    crashes) and metrics not yet logged."""
    rng = [state.clone() for state in distributed.all_gather(torch.get_rng_state())]
    stats = distributed.all_gather(at["stats"])
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": at["epoch"],
            "batches": at["batches"], "samples_seen": int(at["totals"][SAMPLES] + stats[:, SAMPLES].sum()),
            "train_loss": at["train_loss"], "totals": at["totals"], "stats": stats, "rng": rng,
            "settings": resume_settings(args)}


def resume_settings(args: argparse.Namespace) -> dict:
    """The settings that make the run what it is: a resume with others would silently start another."""
    world = distributed.get_world_size()
    return {"seed": args.seed, "lr": args.lr, "dtype": args.dtype,
            "global_batch": args.batch_size * world * args.grad_accum, "world_size": world,
            "batch_size": args.batch_size}


MAY_CHANGE = ("--epochs, --log-every, --timeout, --workers, --save-every, --save-steps, --check-every, "
              "--save-model; at an epoch's end also the process count and --batch-size, keeping the global batch")


def resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load --snapshot if it exists; return where training is (epoch, batches done in it, their metrics)."""
    device = next(model.parameters()).device
    zeros = torch.zeros(3, dtype=torch.float64, device=device)
    at = {"epoch": 0, "batches": 0, "train_loss": float("nan"), "stats": zeros, "totals": zeros.clone()}
    state = distributed.load_checkpoint(args.snapshot) if args.snapshot else None
    if state is None:
        return at
    if missing := {"model", "optimizer", "epoch", "batches", "train_loss", "totals", "stats", "rng",
                   "settings"} - state.keys():
        raise SettingsError(f"--snapshot {args.snapshot} is not a min_ddp snapshot of this version (missing: "
                            f"{sorted(missing)}); use another --snapshot path")
    check_settings(args, state)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise SettingsError(f"--snapshot {args.snapshot} holds a different model or optimizer than this "
                            f"script builds ({e}); use another --snapshot path") from e
    rank, mid_epoch = distributed.get_rank(), state["batches"] > 0
    rng = state["rng"]  # load_checkpoint maps tensors to this rank's device; set_rng_state takes CPU bytes
    torch.set_rng_state(rng[rank if len(rng) == distributed.get_world_size() else 0].cpu())
    at.update(epoch=state["epoch"], batches=state["batches"], train_loss=state["train_loss"], totals=state["totals"])
    if mid_epoch:
        at["stats"] = state["stats"][rank].clone()
    distributed.print_primary(f"resumed from {args.snapshot} " + (f"in epoch {at['epoch'] + 1} after batch {at['batches']}"
                                                              if mid_epoch else f"after {at['epoch']} epoch(s)"))
    return at


def check_settings(args: argparse.Namespace, state: dict) -> None:
    """Refuse a resume that could not continue the snapshot's run, naming every setting that differs."""
    saved, now = state["settings"], resume_settings(args)
    flags = {"seed": "--seed", "lr": "--lr", "dtype": "--dtype",
             "global_batch": "the global batch (--batch-size x processes x --grad-accum)"}
    if state["batches"] > 0:  # mid-epoch: the rest of the epoch is split as it was
        flags |= {"world_size": "the process count", "batch_size": "--batch-size"}
    if differ := [f"{flag}: {saved[key]} there, {now[key]} here" for key, flag in flags.items() if saved[key] != now[key]]:
        where = (f" (it stopped inside epoch {state['epoch'] + 1}, which must end as it began)"
                 if state["batches"] > 0 else "")
        raise SettingsError(f"--snapshot {args.snapshot} belongs to another run{where}: {'; '.join(differ)}. Use "
                            f"its settings to continue it, or another --snapshot path. May change on resume: "
                            f"{MAY_CHANGE}")


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore the stop signals: SLURM and shells signal the whole process group, and
    a loader worker dying of it would fail the step the ranks are finishing before they save."""
    for signum in distributed.STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


# --- Settings: argparse flags, optionally on top of a JSON file -------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nprocs", type=int, help="local processes; None: one per visible GPU, else 1")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training data")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (SGD, momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--log-every", type=int, default=100, help="steps between metric lines")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="model and data")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective waits for a stuck rank")
    p.add_argument("--save-model", metavar="PATH", type=writable, help="write the final weights here")
    p.add_argument("--snapshot", metavar="PATH", type=writable, help="save training state here; resume if it exists")
    p.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    p.add_argument("--save-steps", type=int, default=0, help="also a snapshot every N optimizer steps; 0: off")
    p.add_argument("--check-every", type=int, default=100,
                   help="optimizer steps between checks for a stop signal (an all-reduce each): aim for about a second")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--config", metavar="FILE.json", help="settings from JSON; flags override")
    p.add_argument("--print-config", action="store_true", help="print the settings as JSON and exit")
    args = p.parse_args(argv)
    if args.config:
        p.set_defaults(**read_config(args.config, p))
        args = p.parse_args(argv)  # the command line wins over the file
    if problem := nonpositive(args):
        p.error(problem)
    if args.print_config:  # like --help: print, then exit
        print(json.dumps({k: v for k, v in vars(args).items() if k not in ("config", "print_config")}, indent=2))
        p.exit()
    return args


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's line breaks and shows every flag's default."""


def writable(path: str) -> str:
    """A path whose file can be written: fail before training, not after hours of it."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory; name a file in it: {os.path.join(path, 'run.pt')}")
    try:
        tempfile.TemporaryFile(dir=(directory := os.path.dirname(os.path.abspath(path)))).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot write in {directory} ({e.strerror}); "
                                         "create the directory, make it writable, or choose another path")
    return path


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """Settings from a JSON object whose keys are the long flags' names (batch_size, lr, ...)."""
    try:
        with open(path, encoding="utf-8") as f:
            settings = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"--config {path}: {e}")
    known = set(vars(parser.parse_args([]))) - {"config", "print_config"}
    if not isinstance(settings, dict):
        parser.error(f"--config {path}: expected a JSON object whose keys are flag names, got: {type(settings).__name__}")
    if unknown := sorted(settings.keys() - known):
        parser.error(f"--config {path}: unknown key(s) {', '.join(unknown)}; the keys are: {', '.join(sorted(known))}")
    parser.exit_on_error = False  # each value is parsed as its flag would be; an error names the file
    for key, value in settings.items():
        try:
            problem = nonpositive(parser.parse_args([] if value is None else [f"--{key.replace('_', '-')}", str(value)]))
        except argparse.ArgumentError as e:
            problem = str(e)
        if problem:
            parser.error(f"--config {path}: {key}={value!r}: {problem}")
    parser.exit_on_error = True
    return {key: None if value is None else str(value) for key, value in settings.items()}


def nonpositive(args: argparse.Namespace) -> str | None:
    """What is wrong with the first numeric setting that is not > 0, if any."""
    for name in ("nprocs", "epochs", "batch_size", "lr", "log_every", "grad_accum", "timeout", "save_every",
                 "check_every"):
        if (value := getattr(args, name)) is not None and not value > 0:
            return f"--{name.replace('_', '-')} must be > 0, got: {value}"
    for name in ("save_steps", "workers"):
        if (value := getattr(args, name)) is not None and value < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got: {value}"
    return None


def main() -> None:
    args = parse_args()
    try:
        distributed.launch(main_worker, args, nprocs=args.nprocs)
    except SettingsError as e:
        sys.exit(f"min_ddp: {e}")
    except KeyboardInterrupt:
        print("min_ddp: interrupted", file=sys.stderr)
        sys.exit(130)  # what a shell reports for Ctrl-C


if __name__ == "__main__":
    main()
