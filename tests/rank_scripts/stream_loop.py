"""A loop over sharded_stream on a Checkpointer (test_random_resume.py):

    python stream_loop.py SNAPSHOT OUT NPROCS STOP [--workers K] [--dropout P]

2 epochs over 30 shards of 20 to 27 records (dealt to 12 streams, 24 records a step); each record gets a random
augmentation in the stream's transform (noise and a sign flip from torch's global generator, as torchvision's
transforms draw), in the rank or in K loader workers per rank. Rank 1 (alone: rank 0) signals itself (SIGUSR1)
after the STOP-th optimizer step of this run (0: never). OUT gets the final weights and, per global step, every
rank's (id, input) rows sorted by id; OUT.reads each read(shard, start) call, as "shard start" lines.
"""
import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
from checkpointer import Checkpointer
from sharded_stream import sharded_stream

FEATURES = 8


def read(shard: int, start: int = 0):
    """Shard ``shard``'s records from ``start``, those before it never made: (id, x, y)."""
    with open(os.environ["STREAM_LOOP_READS"], "a") as log:
        log.write(f"{shard} {start}\n")
    for position in range(start, 20 + shard % 8):
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(shard * 1000 + position),
                        dtype=torch.float64)
        yield torch.tensor(shard * 1000 + position), x, x[:2].sum(0, keepdim=True).sin()


def augment(record):
    ident, x, y = record
    x = x + 0.1 * torch.randn(FEATURES, dtype=torch.float64)
    return ident, -x if torch.rand(()) < 0.5 else x, y


def worker(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    distributed.init_process_group(local_rank, world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    stream = sharded_stream(list(range(30)), read, streams=12, global_batch=24, transform=augment,
                            num_workers=args.workers, seed=5)
    torch.manual_seed(1234 + distributed.get_rank())  # dropout masks of each rank's own
    trained = {}
    try:
        ckpt = Checkpointer(args.snapshot, model, optimizer, loader=stream, check_every=1)
        ddp = DDP(model) if world_size > 1 else model
        steps_here = 0
        for _ in ckpt.epochs(2):
            for ident, x, y in stream:
                rows = distributed.all_gather(torch.cat([ident.double()[:, None], x], 1)).flatten(0, 1)
                trained[ckpt.steps + 1] = rows[rows[:, 0].argsort()]
                loss = F.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps_here += 1
                if distributed.get_rank() == min(1, world_size - 1) and steps_here == args.stop:
                    os.kill(os.getpid(), signal.SIGUSR1)
                ckpt.step()
        distributed.save_checkpoint({"model": model.state_dict()}, args.out)
    finally:
        if distributed.is_primary():  # what this run trained, added to the earlier runs'
            path = args.out + ".steps"
            torch.save({**(torch.load(path) if os.path.exists(path) else {}), **trained}, path)
        distributed.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot")
    p.add_argument("out")
    p.add_argument("nprocs", type=int)
    p.add_argument("stop", type=int)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.0)
    args = p.parse_args()
    os.environ["STREAM_LOOP_READS"] = args.out + ".reads"
    distributed.launch(worker, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
