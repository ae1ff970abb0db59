"""What a worker sees of the main module (test_launch.py): a setting at module level, changed under the main guard."""
import os
import threading
import time
if os.environ.get("WITH_NUMPY"):
    import numpy  # noqa: F401                     # most users' environments: BLAS threads at import
import distributed

max_iters = 40                                     # nanoGPT keeps its config as module globals

def worker(local_rank, world_size, passed):
    line = f"rank {local_rank}: global max_iters={max_iters}, passed max_iters={passed}\n"
    os.write(1, line.encode())                     # one write: the two ranks' lines never interleave

if __name__ == "__main__":
    if os.environ.get("WITH_THREAD"):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    max_iters = 99                                 # a setting changed here reaches workers as an argument only
    distributed.launch(worker, max_iters, nprocs=2)
