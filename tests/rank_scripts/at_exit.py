"""No gloo thread may outlive cleanup() into interpreter shutdown (test_launch.py): started by hand as torchrun would.

The rank trains a DDP model that is still alive at cleanup() and in a reference cycle, with gc disabled so only
cleanup()'s own collection runs; a handler registered first (so it runs last at exit) lists the gloo threads left."""
import atexit
import gc
import glob
from pathlib import Path
import torch
import distributed
from torch.nn.parallel import DistributedDataParallel as DDP

def gloo_threads():  # registered first, so it runs last at exit: just before the interpreter finalizes
    names = [Path(comm).read_text().strip() for comm in glob.glob("/proc/self/task/*/comm")]
    print("gloo threads at exit:", sorted(name for name in names if "gloo" in name), flush=True)

def worker(local_rank, world_size):
    distributed.init_process_group(local_rank, world_size)
    model = torch.nn.Linear(4, 1)
    ddp, optimizer = DDP(model), torch.optim.SGD(model.parameters(), lr=0.1)
    cycle = [ddp]
    cycle.append(cycle)  # garbage in a reference cycle keeps the model until a collection
    for _ in range(2):
        loss = ddp(torch.randn(8, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    distributed.print_primary("ranks:", distributed.reduce(1).item())
    distributed.cleanup()  # with the DDP model alive here, as in the module docstring

if __name__ == "__main__":
    gc.disable()  # whether a collection happens to run before exit depends on allocations: here none does
    atexit.register(gloo_threads)
    distributed.launch(worker)
