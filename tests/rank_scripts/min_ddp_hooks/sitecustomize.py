"""The suite's hooks in every Python process of a min_ddp run (see min_ddp_driver.py): FLOAT64, STOP_AT,
START_METHOD, CRASH_AT, SLOW_FIRST_RUN."""
import multiprocessing
import functools
import os
import runpy
import signal
import sys
import threading
import time
import warnings
here = os.path.dirname(os.path.abspath(__file__))
for entry in sys.path:  # a sitecustomize later on the path (the no-numpy tests') still runs
    if entry and os.path.abspath(entry) != here and os.path.isfile(os.path.join(entry, "sitecustomize.py")):
        runpy.run_path(os.path.join(entry, "sitecustomize.py"))
        break
warnings.filterwarnings("ignore", "Failed to initialize NumPy")
# multiprocessing's resource tracker, a fresh interpreter that each launch() starts, never trains: without
# torch it starts in 0.04 CPU-s instead of 1.4 (39 of them in a suite run: 56 CPU-s).
if "multiprocessing.resource_tracker" not in " ".join(sys.orig_argv):
    import torch
    import distributed
    from torch.optim.optimizer import register_optimizer_step_post_hook
    if "multiprocessing.forkserver" in " ".join(sys.orig_argv):
        # launch()'s forkserver, whose forks are the ranks: each rank's first optimizer imports torch._dynamo, 0.9
        # CPU-s; imported here once (after distributed, as in a rank), a run's ranks share it: the suite's time.
        import torch._dynamo  # noqa: F401

    if os.environ.get("FLOAT64"):
        torch.set_default_dtype(torch.float64)
    PLAN = [item.split(":") for item in os.environ.get("STOP_AT", "").split(",") if item]

    def after_step(optimizer, args, kwargs):
        optimizer.steps_here = getattr(optimizer, "steps_here", 0) + 1
        for rank, step, name, *late in PLAN:
            if int(step) != optimizer.steps_here:
                continue
            signum = getattr(signal, name)
            if int(rank) == distributed.get_rank():
                send = functools.partial(os.kill, os.getpid(), signum)  # bound now: the loop goes on to other entries
                if late:
                    threading.Timer(0.3, send).start()
                else:
                    send()
            elif late:
                time.sleep(0.6)

    register_optimizer_step_post_hook(after_step)
    if os.environ.get("START_METHOD"):  # e.g. forkserver, Python 3.14's default: set in the rank, as it would be
        init = distributed.init_process_group
        def forced(*args, **kwargs):
            multiprocessing.set_start_method(os.environ["START_METHOD"], force=True)
            return init(*args, **kwargs)
        distributed.init_process_group = forced
    if os.environ.get("CRASH_AT") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank, step = map(int, os.environ["CRASH_AT"].split(":"))
        def crash(optimizer, *args):
            if distributed.get_rank() == rank and optimizer.steps_here == step:
                # Said first: torchrun reports whichever rank's failure it sees first, often the peer's.
                print(f"CRASH_AT: rank {rank} exits with 17 after step {step}", file=sys.stderr, flush=True)
                os._exit(17)
        register_optimizer_step_post_hook(crash)
    if os.environ.get("SLOW_FIRST_RUN") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        register_optimizer_step_post_hook(lambda *args: time.sleep(float(os.environ["SLOW_FIRST_RUN"])))
