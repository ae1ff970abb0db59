"""A save slower than the launcher's grace (test_stop.py): python slow_save.py SNAPSHOT."""
import sys
import time
import torch
import checkpointer
import distributed

def worker(local_rank, world_size, path):
    distributed.init_process_group(local_rank, world_size)
    distributed.save_checkpoint({"version": 1}, path)
    checkpointer.handle_stop_signals()
    distributed.barrier()  # every rank's handlers are in place before the test signals
    distributed.report_progress("saved version 1")
    print("saved version 1", flush=True)
    while not checkpointer.stop_requested():
        time.sleep(0.05)
    save = torch.save
    torch.save = lambda *a, **k: (save(*a, **k), time.sleep(60))  # a save slower than the grace
    distributed.save_checkpoint({"version": 2}, path)

if __name__ == "__main__":
    distributed.launch(worker, sys.argv[1], nprocs=2, grace=1.0)
