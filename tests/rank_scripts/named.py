"""A rank that prints its global rank, local rank and process name (test_launch.py): torchrun ... named.py."""
import os

import distributed


def worker(local_rank, world_size):
    distributed.init_process_group(local_rank, world_size, timeout=60)
    with open(f"/proc/{os.getpid()}/comm") as f:
        name = f.read().strip()
    distributed.print_ranked(f"local={local_rank} name={name}")
    distributed.cleanup()


if __name__ == "__main__":
    distributed.launch(worker)
