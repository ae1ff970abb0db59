"""min_ddp.py run as a command with the suite's settings (harness.run_min_ddp): python min_ddp_driver.py FLAGS.

min_ddp.py run as a command (`python min_ddp.py FLAGS`), with the suite's settings. It adds
`--train-size $TRAIN_SIZE` (fewer samples) and puts min_ddp_hooks/ on PYTHONPATH as sitecustomize, which
every Python process of the run (the launcher, its forkserver whose forks are the ranks, torchrun's and
srun's workers) imports first: FLOAT64=1 (torch's default dtype, so the data and the model: tight tolerances),
and STOP_AT="rank:step:SIGNAL[:late],...": after its step-th optimizer step of this run, that rank signals
itself; ":late" sends it 0.3 s later while every other rank sleeps 0.6 s, so the signal lands while this rank
waits inside the next step's gradient all-reduce.
START_METHOD: multiprocessing's default start method inside each rank (forkserver: Python 3.14's).
CRASH_AT="rank:step": under torchrun's first attempt, that rank dies (exit 17) after that optimizer step.
SLOW_FIRST_RUN=S: a SLURM job's first run sleeps S s after each step, so that SLURM's signal finds it
training; a requeued run (SLURM_RESTART_COUNT=1) is not slowed.
For the suite's time, not the run's behaviour: multiprocessing's resource tracker is left without torch, and
launch()'s forkserver also imports torch._dynamo, which each rank's first optimizer imports (0.9 CPU-s a rank), as
warm_forkserver/ does for random_loop's, own_loop's and stream_loop's; test_launch's ranks (its failures, hangs
and stops), torchrun's and srun's import it as a user's do.
harness.start() runs what command() returns directly (forked_python.py), without this process in between.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HOOKS = os.path.join(HERE, "min_ddp_hooks")


def command(flags: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment this driver runs min_ddp.py with, given its own."""
    repo = os.path.dirname(os.path.dirname(HERE))  # tests/rank_scripts/ -> the repository
    path = os.pathsep.join(p for p in (HOOKS, repo, environ.get("PYTHONPATH")) if p)
    size = ["--train-size", environ["TRAIN_SIZE"]] if environ.get("TRAIN_SIZE") else []
    return [sys.executable, os.path.join(repo, "min_ddp.py"), *flags, *size], {**environ, "PYTHONPATH": path}


if __name__ == "__main__":
    argv, env = command(sys.argv[1:], dict(os.environ))
    os.execve(sys.executable, argv, env)
