"""Every helper with CUDA and CPU tensors, then BEHAVIOUR (test_gpu.py):
python gpu_job.py BACKEND SNAPSHOT [BEHAVIOUR]."""
import sys
import time
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import checkpointer
import distributed
from slow_rank import SlowRank

def check(got, expected, device):
    assert got.device == device, (got.device, device)
    assert torch.equal(got.cpu(), expected), (got, expected)

def worker(local_rank, world_size, backend, snapshot, behaviour):
    device = distributed.init_process_group(local_rank, world_size, backend=backend, timeout=20)
    assert device.type == "cuda" and torch.distributed.get_backend() in (backend, "undefined"), device
    rank, world = distributed.get_rank(), distributed.get_world_size()
    for where in (device, torch.device("cpu")):
        check(distributed.reduce(torch.tensor([rank + 1.0], device=where)),
              torch.tensor([world * (world + 1) / 2]), where)
        check(distributed.reduce(torch.tensor(rank, device=where), "mean"),
              torch.tensor((world - 1) / 2, dtype=torch.float64), where)
        check(distributed.reduce(torch.tensor(True, device=where)), torch.tensor(world), where)
        check(distributed.reduce(torch.tensor(rank, dtype=torch.int16, device=where), "max"),
              torch.tensor(world - 1, dtype=torch.int16), where)
        check(distributed.all_gather(torch.tensor([rank, -rank], device=where)),
              torch.tensor([[r, -r] for r in range(world)]), where)
        strided = torch.arange(6.0, device=where).reshape(2, 3).T + rank  # NCCL refuses a non-contiguous tensor
        check(distributed.reduce(strided), torch.arange(6.0).reshape(2, 3).T * world + world * (world - 1) / 2, where)
        check(distributed.all_gather((torch.arange(6.0, device=where).reshape(3, 2) + rank)[:, 0]),
              torch.stack([torch.tensor([0.0, 2.0, 4.0]) + r for r in range(world)]), where)
    distributed.print_ranked(f"on {device}")
    state = {"weights": torch.full((3,), float(rank), device=device), "steps": torch.arange(3),
             "rng": torch.get_rng_state()}
    distributed.save_checkpoint(state, snapshot)
    loaded = distributed.load_checkpoint(snapshot)
    check(loaded["weights"], torch.zeros(3), device)   # the primary's, mapped to this rank's GPU
    check(loaded["steps"], torch.arange(3), device)
    torch.set_rng_state(loaded["rng"].cpu())            # generator states go back to the CPU
    model, kept = torch.nn.Linear(2, 1).to(device), {"cpu": torch.ones(2), "gpu": torch.ones(2, device=device)}
    checkpointer.Checkpointer(snapshot + ".ckpt", model, batch_size=1, state=kept).save()
    kept = {"cpu": torch.zeros(2), "gpu": torch.zeros(2, device=device)}
    checkpointer.Checkpointer(snapshot + ".ckpt", model, batch_size=1, state=kept)  # restores kept in place
    check(kept["cpu"], torch.ones(2), torch.device("cpu"))         # each tensor where the user keeps it
    check(kept["gpu"], torch.ones(2), device)
    adam = torch.optim.Adam(model.parameters())          # a resumed Adam keeps its step counters on the CPU,
    model(torch.ones(1, 2, device=device)).sum().backward()  # as a fresh one does (else foreach Adam syncs)
    adam.step()
    checkpointer.Checkpointer(snapshot + ".adam", model, adam, batch_size=1).save()
    resumed = torch.optim.Adam(model.parameters())
    checkpointer.Checkpointer(snapshot + ".adam", model, resumed, batch_size=1)
    where = lambda opt: [(k, v.device) for s in opt.state.values() for k, v in sorted(s.items())]  # noqa: E731
    assert where(resumed) == where(adam) and ("step", torch.device("cpu")) in where(adam), where(resumed)
    if behaviour == "raise" and rank == 1:               # with NCCL work in flight that no peer ever joins:
        torch.distributed.all_reduce(torch.ones(1, device=device), async_op=True)  # destroying would wait for it
        raise ValueError("root cause on rank 1")
    if behaviour == "raise":
        time.sleep(3600)                                 # until the launcher stops this rank
    if behaviour == "hang" and rank == 1:
        time.sleep(3600)
    if behaviour == "slow-rank":                         # on the device's clock: rank 1 starts each backward late
        ddp = DDP(torch.nn.Linear(256, 256).to(device), device_ids=[device])
        watch = SlowRank(ddp, every=4)
        for x in watch.batches([torch.randn(64, 256, device=device)] * 13):
            loss = ddp(x).square().mean()
            time.sleep(0.05 if rank == 1 else 0.0)
            loss.backward()
    distributed.reduce(torch.ones(1, device=device)).item()
    distributed.print_primary("job ok")
    distributed.cleanup()

def main(local_rank, world_size, backend, snapshot, behaviour):
    try:
        worker(local_rank, world_size, backend, snapshot, behaviour)
    finally:
        distributed.cleanup()                            # as the example does: must not hide the error

if __name__ == "__main__":
    distributed.launch(main, sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "ok")
