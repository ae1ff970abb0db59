"""A rank that prints what it was given (test_launch.py): python ranks.py (under srun, salloc or launch())."""
import torch
import distributed

def worker(local_rank, world_size):
    distributed.init_process_group(local_rank, world_size, timeout=60)
    distributed.print_ranked(f"mode={distributed.launch_mode()} world={world_size} "
                             f"threads={torch.get_num_threads()}")
    distributed.cleanup()

if __name__ == "__main__":
    distributed.launch(worker)
