"""min_ddp's command line: its flags, settings from a JSON file (--config, --print-config), and the
checks that make a bad value one line naming its flag, before any process starts."""
import argparse
import json
import os

import torch


class SettingsError(ValueError):
    """A setting this run cannot use: reported in one line, without a traceback."""


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    flag = lambda name, kind, default, text: p.add_argument(name, type=kind, default=default,  # noqa: E731
                                                            help=f"{text} (default: %(default)s)")
    flag("--nprocs", int, None, "local processes; None: one per visible GPU, else 1")
    flag("--epochs", int, 5, "passes over the training data")
    flag("--batch-size", int, 64, "per process")
    flag("--lr", float, 0.01, "learning rate (SGD, momentum 0.9)")
    flag("--seed", int, 0, "model init and data order")
    flag("--log-every", int, 100, "batches between metric lines")
    flag("--grad-accum", int, 1, "micro-batches per optimizer step")
    flag("--timeout", float, 300.0, "seconds a collective waits for a stuck rank")
    flag("--save-model", writable, None, "write the final weights to this PATH")
    flag("--snapshot", writable, None, "save training state to this PATH; resume if it exists")
    flag("--check-every", int, None, "optimizer steps between checks for a stop signal; None: about 1 s apart")
    flag("--workers", int, 0, "DataLoader worker processes per rank")
    flag("--train-size", int, 16384, "samples of synthetic training data")
    flag("--config", str, None, "settings from FILE.json, keyed by the flags' names; flags override")
    p.add_argument("--no-sync-bn", dest="sync_bn", action="store_false",
                   help="BatchNorm with each process's own batch statistics, not the global batch's")
    p.add_argument("--slow-rank", action="store_true", help="print which rank the others wait for, and why, "
                   "after 10 steps, then about once a minute")
    p.add_argument("--print-config", action="store_true", help="print the settings as JSON and exit")
    args = p.parse_args(argv)
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                settings = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"--config {args.config}: {e}")
        if not isinstance(settings, dict) or settings.keys() - vars(args).keys():
            p.error(f"--config {args.config}: expected a JSON object whose keys are among: {', '.join(vars(args))}")
        # Text defaults go through each flag's type: a bad value in the file is an error naming its flag.
        p.set_defaults(**{key: value if value is None or isinstance(value, bool) else str(value)
                          for key, value in settings.items()})
        args = p.parse_args(argv)  # the command line wins over the file
    for name, value in vars(args).items():
        if name in POSITIVE and value is not None and not (value >= 0 if name == "workers" else value > 0):
            p.error(f"--{name.replace('_', '-')} must be {'>=' if name == 'workers' else '>'} 0, got: {value}")
    if problem := too_many_processes(args.nprocs, torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p.error(problem)
    if args.print_config:  # like --help: print, then exit
        print(json.dumps({k: v for k, v in vars(args).items() if k not in ("config", "print_config")}, indent=2))
        p.exit()
    return args


POSITIVE = ("nprocs", "epochs", "batch_size", "lr", "log_every", "grad_accum", "timeout", "check_every", "workers",
            "train_size")


def writable(path: str) -> str:
    """A path whose file can be written: fail before training, not after hours of it."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path} is a directory, or {directory} is missing or read-only; name a "
                                         "file in a writable directory (create it first)")
    return path


def too_many_processes(nprocs: int | None, gpus: int) -> str | None:
    """What is wrong with --nprocs on a machine with ``gpus`` visible GPUs (NCCL takes one process per GPU)."""
    if nprocs and gpus and nprocs > gpus:
        return (f"--nprocs {nprocs} but {gpus} GPU(s) are visible, and NCCL takes one process per GPU: run "
                f"`python min_ddp.py` for every GPU, or `CUDA_VISIBLE_DEVICES= python min_ddp.py --nprocs {nprocs}` "
                "for CPU processes")
    return None
