"""A launcher that used OpenMP threads before launch() (test_launch.py): python openmp.py."""
import torch

import distributed


def worker(local_rank, world_size):
    x = torch.randn(512, 512)
    print(f"rank {local_rank}: {torch.get_num_threads()} threads, {float((x @ x).sum()):.0f}", flush=True)


if __name__ == "__main__":
    torch.randn(512, 512) @ torch.randn(512, 512)  # starts the launcher's OpenMP threads
    distributed.launch(worker, nprocs=2)
