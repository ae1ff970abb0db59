"""Rank 1 fails to save after a stop signal (test_stop.py): python fails_after_stop.py."""
import os
import sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpointer
import distributed

def worker(local_rank, world_size):
    distributed.init_process_group(local_rank, world_size)
    checkpointer.handle_stop_signals()
    distributed.barrier()  # every rank's handlers are in place before the test signals
    distributed.print_primary("ready")
    while not checkpointer.stop_requested():
        time.sleep(0.05)
    if distributed.get_rank() == 1:  # saving after the stop fails
        raise OSError(28, "No space left on device")
    raise checkpointer.Stopped(143)  # rank 0 saved and stops as asked

if __name__ == "__main__":
    distributed.launch(worker, nprocs=2)
