"""Each rank keeps its snapshot on its own node's disk (test_stop.py): python node_local.py DIR NPROCS."""
import os
import sys
import torch
import checkpointer
import distributed

def worker(local_rank, world_size, directory):
    distributed.init_process_group(local_rank, world_size)
    model = torch.nn.Linear(2, 1)
    path = os.path.join(directory, f"node{distributed.get_rank()}", "snap.pt")  # each rank's local disk
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        ckpt = checkpointer.Checkpointer(path, model, batch_size=1, check_every=1)
        ckpt.step()
        ckpt.save()
    finally:
        distributed.cleanup()

if __name__ == "__main__":
    distributed.launch(worker, sys.argv[1], nprocs=int(sys.argv[2]))
