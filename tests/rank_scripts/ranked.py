"""print_ranked from every rank (test_ddp.py): python ranked.py NPROCS."""
import sys
import distributed as dist

def worker(local_rank, world_size):
    dist.init_process_group(local_rank, world_size)
    dist.print_ranked("é" * dist.get_rank(), "line", dist.get_rank(), sep="|")  # lines of unequal length
    dist.cleanup()

if __name__ == "__main__":
    dist.launch(worker, nprocs=int(sys.argv[1]))
