"""A rank started by hand, as a Kubernetes PyTorchJob or a user's script starts one (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT): it joins, all-reduces once and leaves (test_start.py).
TIMEOUT (seconds) replaces the default timeout; POSE_AS_TORCH poses as another torch install."""
import os
import torch
import distributed

def worker(local_rank, world_size):
    if os.environ.get("POSE_AS_TORCH"):
        torch.__version__ = os.environ["POSE_AS_TORCH"]  # what a host with another install reports
    distributed.init_process_group(local_rank, world_size, timeout=float(os.environ.get("TIMEOUT", 0)) or None)
    print(f"rank {distributed.get_rank()}: sum {distributed.reduce(torch.ones(1)).item():.0f}", flush=True)
    distributed.cleanup()

if __name__ == "__main__":
    distributed.launch(worker)
