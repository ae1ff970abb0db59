"""A loop with real training's randomness, on a Checkpointer (test_random_resume.py, test_resume_at_three.py and
test_gpu.py):

    python random_loop.py SNAPSHOT OUT NPROCS BATCH STOP [--dropout P] [--augment global|seeded|numpy-and-owned]
                          [--workers K] [--persistent] [--accum K] [--stop-mid-group]
                          [--ddp plain|find-unused|shared-memory] [--amp] [--loop-draws]
                          [--sampler data_sampler|repeated]

An epoch loop over distributed.data_sampler, 2 epochs of 256 samples. Each sample gets a random augmentation in
__getitem__ from torch's global generator (noise and a sign flip, as torchvision's transforms draw), in the rank
(--workers 0) or in DataLoader workers; --augment seeded wraps the dataset with distributed.seeded_dataset, and
numpy-and-owned draws from numpy's global generator and one the dataset owns (seeded per item), wrapped too. The
model may have dropout (on the GPU where one is visible). --amp trains as mixed precision does: a float32 model
under float16 autocast, a GradScaler (kept in the Checkpointer's state) whose scale backs off at an overflow and
grows after 3 good steps, the gradients unscaled and clipped before its step. Rank 1 (alone: rank 0) signals
itself (SIGUSR1) after the STOP-th optimizer step of this run (0: never). --loop-draws draws in the rank's loop from
Python's random (a sign flip) and, where numpy is installed, numpy's global generator (a mixup's np.random.beta).
OUT gets the final weights and, per global step, what that step trained on: every rank's (index, input) rows,
sorted by index (rank 0 gathers them), so runs at different world sizes compare step by step; with --amp,
OUT.scales the GradScaler's scale and growth tracker as each step began.
"""
import argparse
import contextlib
import os
import random
import signal

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

import distributed
from checkpointer import Checkpointer
from shared_memory_allreduce import shared_memory_allreduce
from seeded_dataset import seeded_dataset

SAMPLES, FEATURES = 256, 8


class Augmented(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=gen, dtype=torch.float64)
        self.y = self.x[:, :2].sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        x = self.x[index] + 0.1 * torch.randn(FEATURES, dtype=torch.float64)
        if torch.rand(()) < 0.5:
            x = -x
        return index, x, self.y[index]


class NumpyAndOwned(Augmented):
    """Noise from numpy's global generator (older albumentations, imgaug) and a sign flip from a generator of the
    dataset's own (newer albumentations, MONAI), seeded per item from the item's seed, torch.initial_seed()."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator()

    def __getitem__(self, index: int):
        import numpy as np
        self.gen.manual_seed(torch.initial_seed())
        x = self.x[index] + 0.1 * torch.from_numpy(np.random.randn(FEATURES))
        if torch.rand((), generator=self.gen) < 0.5:
            x = -x
        return index, x, self.y[index]


class RepeatedAugmentation(Sampler):
    """A repeated-augmentation sampler as DeiT's recipe and torchvision's references write one (RASampler): each
    index 3 times in an epoch's shuffled order (seeded by seed + epoch), dealt to the ranks in turn; no skip of its
    own: the Checkpointer gives it one."""

    def __init__(self, n: int, world: int, rank: int, repeats: int = 3, seed: int = 0):
        self.n, self.world, self.rank, self.repeats, self.seed, self.epoch = n, world, rank, repeats, seed, 0
        self.num_samples = -(-n * repeats // world)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        indices = order.repeat_interleave(self.repeats).tolist()
        indices += indices[:self.num_samples * self.world - len(indices)]
        return iter(indices[self.rank::self.world])

    def __len__(self) -> int:
        return self.num_samples


def worker(local_rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = distributed.init_process_group(local_rank, world_size)  # a GPU where test_gpu.py runs it
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)  # bitwise on a GPU also needs CUBLAS_WORKSPACE_CONFIG=:4096:8
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(16, 1)).to(device, torch.float32 if args.amp else torch.float64)
    # 2**18 overflows float16's gradients at first: steps are skipped, and the scale moves during the run
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**18, growth_interval=3, enabled=args.amp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = Augmented() if args.augment == "global" else seeded_dataset(Augmented(), seed=3)
    if args.augment == "numpy-and-owned":
        data = seeded_dataset(NumpyAndOwned(), seed=3)
    sampler = distributed.data_sampler(data, True, shuffle=True, seed=1)
    if args.sampler == "repeated":
        sampler = RepeatedAugmentation(len(data), distributed.get_world_size(), distributed.get_rank(), seed=1)
    loader = DataLoader(data, args.batch, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.persistent)
    torch.manual_seed(1234 + distributed.get_rank())  # dropout masks of each rank's own
    numpy = None
    if args.loop_draws:  # a mixup drawn from numpy's global generator and a flip from Python's, in the loop
        random.seed(99 + distributed.get_rank())
        with contextlib.suppress(ImportError):
            import numpy
            numpy.random.seed(77 + distributed.get_rank())
    trained, scales = {}, {}
    try:
        ckpt = Checkpointer(args.snapshot, model, optimizer, loader=loader, grad_accum=args.accum,
                            settings={"augment": args.augment}, state={"scaler": scaler}, check_every=1)
        ddp = model
        if distributed.get_world_size() > 1:
            ddp = DDP(model, find_unused_parameters=args.ddp == "find-unused")
            if args.ddp == "shared-memory":
                assert shared_memory_allreduce(ddp), "the shared-memory all-reduce did not take over"
        steps_here = 0
        for _ in ckpt.epochs(2):
            done = ckpt.epoch_steps * args.accum  # batches trained before a mid-epoch resume (the sampler skips them)
            batches = done + len(loader)
            for i, (indices, x, y) in enumerate(loader, start=done):
                indices, x, y = indices.to(device), x.to(device), y.to(device)
                if args.amp:
                    x, y = x.float(), y.float()
                if args.loop_draws:
                    lam = float(numpy.random.beta(0.4, 0.4)) if numpy is not None else 1.0
                    x = lam * x + (1 - lam) * x.flip(0)  # the mixup many loops draw with np.random.beta
                    x = -x if random.random() < 0.5 else x  # a flip from Python's random (RandomChoice, cutmix)
                rows = torch.cat([indices.double().unsqueeze(1), x], 1)
                gathered = distributed.all_gather(rows)  # same shape on every rank: equal batches
                group_start = i - i % args.accum  # this batch's accumulation group: its first batch,
                group = min(args.accum, batches - group_start)  # its size (an epoch's last may be short),
                last_of_group = i + 1 == group_start + group  # and whether this batch ends it
                with ddp.no_sync() if isinstance(ddp, DDP) and not last_of_group else contextlib.nullcontext():
                    with torch.autocast(device.type, torch.float16, enabled=args.amp):
                        loss = F.mse_loss(ddp(x), y) / group
                    scaler.scale(loss).backward()
                step = ckpt.steps + 1
                signals = distributed.get_rank() == min(1, world_size - 1)
                if signals and args.stop_mid_group and not last_of_group and steps_here + 1 == args.stop:
                    os.kill(os.getpid(), signal.SIGUSR1)  # the stop comes at the end of this step's group
                everything = gathered.flatten(0, 1)
                trained[step] = torch.cat([trained.get(step, everything[:0]), everything])
                if last_of_group:
                    if args.amp:
                        scales[step] = torch.tensor([scaler.get_scale(), scaler.state_dict()["_growth_tracker"]])
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    scaler.step(optimizer)  # the optimizer's step, unless the gradients overflowed
                    scaler.update()
                    optimizer.zero_grad()
                    steps_here += 1
                    if signals and not args.stop_mid_group and steps_here == args.stop:
                        os.kill(os.getpid(), signal.SIGUSR1)
                    ckpt.step()
        distributed.save_checkpoint({"model": {k: v.cpu() for k, v in model.state_dict().items()}}, args.out)
    finally:
        if distributed.is_primary():  # what this run trained, step by step, added to the earlier runs'
            add_to_log(args.out + ".steps", {step: rows[rows[:, 0].argsort()].cpu() for step, rows in trained.items()})
            if args.amp:  # the scale each step ran with, and the good steps counted towards its growth
                add_to_log(args.out + ".scales", scales)
        distributed.cleanup()


def add_to_log(path: str, steps: dict) -> None:
    torch.save({**(torch.load(path) if os.path.exists(path) else {}), **steps}, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot")
    p.add_argument("out")
    p.add_argument("nprocs", type=int)
    p.add_argument("batch", type=int)
    p.add_argument("stop", type=int)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--augment", choices=["global", "seeded", "numpy-and-owned"], default="global")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--stop-mid-group", action="store_true", help="signal during step STOP's group, not after it")
    p.add_argument("--ddp", choices=["plain", "find-unused", "shared-memory"], default="plain",
                   help="DDP(model); with find_unused_parameters=True; with shared_memory_allreduce")
    p.add_argument("--amp", action="store_true", help="float16 autocast, a GradScaler, clipping")
    p.add_argument("--sampler", choices=["data_sampler", "repeated"], default="data_sampler",
                   help="distributed.data_sampler, or a repeated-augmentation sampler of the script's own")
    p.add_argument("--loop-draws", action="store_true",
                   help="in the loop: a mixup from np.random.beta (where numpy is installed), a flip from random")
    args = p.parse_args()
    distributed.launch(worker, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
