"""A user's own loop as nanoGPT writes it (test_stop.py): python own_loop.py SNAPSHOT OUT STOP.

No epochs, no sampler, random batches from each rank's RNG, an iteration counter and the best loss so far;
rank 1 signals itself before step STOP (0: never)."""
import os, signal, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import checkpointer
import distributed

def worker(local_rank, world_size, path, out, stop):
    distributed.init_process_group(local_rank, world_size)
    torch.manual_seed(1337 + distributed.get_rank())  # nanoGPT: each rank draws its own batches
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    state = {"best_loss": float("inf"), "loss_sum": 0.0, "losses": torch.zeros(3, dtype=torch.float64),
             "scheduler": scheduler}
    try:
        ckpt = checkpointer.Checkpointer(path, model, optimizer, state=state, check_every=1)
        ddp = DDP(model)
        while ckpt.steps < 30:
            x = torch.randn(16, 8, dtype=torch.float64)
            loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            mean = distributed.reduce(loss.detach(), "mean").item()
            state["best_loss"], state["loss_sum"] = min(state["best_loss"], mean), state["loss_sum"] + mean
            state["losses"] = torch.cat([state["losses"][1:], loss.detach().view(1)])
            if ckpt.steps + 1 == stop and distributed.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            ckpt.step()
        distributed.save_checkpoint({"model": model.state_dict(), "best": state["best_loss"],
                                     "sum": state["loss_sum"], "losses": state["losses"]}, out)
    finally:
        distributed.cleanup()

if __name__ == "__main__":
    distributed.launch(worker, sys.argv[1], sys.argv[2], int(sys.argv[3]), nprocs=2)
