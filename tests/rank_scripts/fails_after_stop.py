"""Rank 1 fails to save after a stop signal (test_stop.py): python fails_after_stop.py raise|die.

raise: its save raises an OSError (a full disk); die: it dies of SIGKILL while saving (the OOM killer).
"""
import os
import signal
import sys
import time

import checkpointer
import distributed


def worker(local_rank, world_size, how):
    distributed.init_process_group(local_rank, world_size)
    checkpointer.handle_stop_signals()
    distributed.barrier()  # every rank's handlers are in place before the test signals
    distributed.report_progress("its last snapshot: step 3, snap.pt")
    distributed.print_primary("ready")
    while not checkpointer.stop_requested():
        time.sleep(0.05)
    if distributed.get_rank() == 1 and how == "raise":
        raise OSError(28, "No space left on device")
    if distributed.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    raise checkpointer.Stopped(143)  # rank 0 saved and stops as asked


if __name__ == "__main__":
    distributed.launch(worker, sys.argv[1], nprocs=2)
