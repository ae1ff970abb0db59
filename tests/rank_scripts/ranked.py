"""print_ranked from every rank (test_ddp.py): python ranked.py NPROCS."""
import sys
import distributed

def worker(local_rank, world_size):
    distributed.init_process_group(local_rank, world_size)
    rank = distributed.get_rank()
    distributed.print_ranked("é" * rank, "line", rank, sep="|")  # lines of unequal length
    distributed.cleanup()

if __name__ == "__main__":
    distributed.launch(worker, nprocs=int(sys.argv[1]))
