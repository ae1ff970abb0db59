"""On PYTHONPATH of the suite's launch() jobs whose ranks train (random_loop, own_loop, stream_loop; harness's
warm_ranks), for the suite's time, not the job's behaviour: launch()'s forkserver imports torch._dynamo, which each
rank's first optimizer imports (0.9 CPU-s a rank), so its ranks fork with it. Every other process of the job imports
nothing more. min_ddp's runs get the same from min_ddp_hooks."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
for entry in sys.path:  # a sitecustomize later on the path still runs
    if entry and os.path.abspath(entry) != here and os.path.isfile(os.path.join(entry, "sitecustomize.py")):
        import runpy
        runpy.run_path(os.path.join(entry, "sitecustomize.py"))
        break
if "multiprocessing.forkserver" in " ".join(sys.orig_argv):
    import distributed  # noqa: F401 (first, as in a rank: it imports torch.distributed.nn before any group)
    import torch._dynamo  # noqa: F401
