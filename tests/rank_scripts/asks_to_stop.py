"""A loop written to stop_requested()'s contract (test_stop.py): it asks at every step boundary and never calls
handle_stop_signals(). Each rank writes its pid to DIR/rankN.pid once it has asked; a stop signal to one rank is
answered on every rank. python asks_to_stop.py DIR (under launch() or torchrun)."""
import os
import sys
import time
import checkpointer
import distributed

def worker(local_rank, world_size, directory):
    distributed.init_process_group(local_rank, world_size)
    steps = 0
    while (signum := checkpointer.stop_requested()) is None:
        if steps == 0:  # the handlers are in place from the first answer on
            path = os.path.join(directory, f"rank{distributed.get_rank()}.pid")
            with open(f"{path}.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(f"{path}.tmp", path)  # the test polls for it: it never sees it empty
        steps += 1
        time.sleep(0.05)
    print(f"rank {distributed.get_rank()} answered {signum.name} after {steps} steps", flush=True)
    distributed.cleanup()

if __name__ == "__main__":
    distributed.launch(worker, sys.argv[1], nprocs=2)
