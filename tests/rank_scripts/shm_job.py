"""shared_memory_allreduce's job (test_shared_memory.py): python shm_job.py BEHAVIOUR WIDTH.

Under RANK/WORLD_SIZE (started by the test as torchrun would) the worker runs here; without, launch() starts 2."""
import os
import sys
import time
import torch
import distributed
from shared_memory_allreduce import shared_memory_allreduce
from torch.nn.parallel import DistributedDataParallel as DDP

def local_grad(rank, width):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 8)
    torch.manual_seed(rank)
    model(torch.randn(4, width)).square().sum().backward()
    return model.weight.grad

def worker(local_rank, world_size, behaviour, width):
    distributed.init_process_group(local_rank, world_size, timeout=60)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(width, 8))
    hooked = shared_memory_allreduce(model, timeout=1.0)
    rank = distributed.get_rank()
    print(f"rank {rank} hooked={hooked}", flush=True)
    if rank == 1 and behaviour == "die":
        os._exit(3)
    if rank == 1 and behaviour == "stall":
        time.sleep(60)
    torch.manual_seed(rank)
    model(torch.randn(4, width)).square().sum().backward()
    grads = distributed.all_gather(model.module.weight.grad)
    mean = local_grad(0, width) / 2 + local_grad(1, width) / 2  # what DDP's gloo all-reduce gives
    print(f"rank {rank} exact={torch.equal(grads[rank], mean)} "
          f"replicas_equal={torch.equal(grads[0], grads[1])}", flush=True)
    distributed.cleanup()

if __name__ == "__main__":
    behaviour, width = sys.argv[1], int(sys.argv[2])
    if "RANK" in os.environ:
        worker(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), behaviour, width)
    else:
        distributed.launch(worker, behaviour, width, nprocs=2)
