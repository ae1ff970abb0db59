"""pytest's side of the suite: Hypothesis profiles, the worker pools and the local SLURM, shared by every test.

The models, data, tasks and process helpers the tests use are in harness.py.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import tempfile
import warnings

# torch's notice, where numpy is missing (a fresh machine, as CI's first run), that it could not load it.
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

# The suite proves DDP on CPU processes: where GPUs are visible they are hidden from it and from every process
# it starts (else ranks would take nccl), unless DDP_GPU_TESTS=1 asks for test_gpu.py, which then runs alone.
GPU_TESTS = os.environ.get("DDP_GPU_TESTS") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Run inside a cluster job (sbatch, srun --pty) or a torchrun rank, the suite would hand its jobs the shell's job:
# a test's min_ddp would take itself for one of its srun tasks, and a stop test's requeue would requeue the
# job running pytest. Every process it starts sees the environment of a plain shell instead; its own SLURM jobs
# get theirs from sbatch and srun.
LAUNCHER_PREFIXES = ("SLURM_", "SRUN_", "SBATCH_", "SALLOC_", "TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT")
for name in [name for name in os.environ if (name.startswith(LAUNCHER_PREFIXES) and name != "SLURM_CONF")
             or name in LAUNCHER_VARS]:
    del os.environ[name]
# A plain shell's buffering in every process the suite starts: PYTHONUNBUFFERED (many containers set it) leaves C's
# stdout unbuffered too, and torch 2.8-2.10's gloo then writes its connection line piece by piece, the ranks' pieces
# interleaved mid-line; buffered, each such line is one write, which harness.job_output takes out whole.
os.environ.pop("PYTHONUNBUFFERED", None)
# What the suite's failures and kills leave in the temporary directory (ddp_check's traceback files, hang reports'
# stacks, torchrun's and SIGKILLed launchers' directories) goes into one directory per pytest process, which it
# removes at its end. Short: a forkserver's socket below it stays within AF_UNIX's 107 bytes.
SUITE_TMPDIR = tempfile.mkdtemp(prefix="ddp-suite-")
os.environ["TMPDIR"] = SUITE_TMPDIR
tempfile.tempdir = None  # this process, too, reads TMPDIR again
atexit.register(shutil.rmtree, SUITE_TMPDIR, ignore_errors=True)
ROOT = os.path.dirname(os.path.abspath(__file__))
collect_ignore = [os.path.join(folder, name) for folder in (".", "tests")
                  for name in os.listdir(os.path.join(ROOT, folder))
                  if name.startswith("test_") and name.endswith(".py") and GPU_TESTS and name != "test_gpu.py"]
# Every process a test starts (ranks, launchers, torchrun's and srun's workers) imports the library and the suite's
# helpers by name, as pytest.ini's pythonpath lets the tests themselves.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH"))
                                           if p)

import pytest
from hypothesis import HealthCheck, settings

import distributed
from ddp_check import WorkerPools, worker_pools
from harness import PROFILE, run

# Hypothesis profiles: CI is derandomized (same examples every run); dev explores 5x more.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    # libcst (pulled in by a plugin on some machines) warns about its own imports: not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:libcst.*")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(scope="session")
def pools() -> WorkerPools:
    """ddp_check's pools: one harness for the user-facing check and this suite."""
    return worker_pools()


def slurm_unavailable() -> str | None:
    """Why SLURM tests cannot run here, or None when a local cluster answers."""
    if not shutil.which("srun"):
        return "srun is not installed (CI installs SLURM with `bash .ci/slurm up`)"
    out = run(["sinfo", "-h", "-o", "%T"], timeout=30)
    # A node busy with another test file's job (pytest.ini runs two at a time) is up: jobs queue for it.
    if out.returncode != 0 or not re.search(r"idle|mix|alloc|completing", out.stdout):
        return f"no SLURM node is up (sinfo: {out.stdout.strip() or out.stderr.strip()}); run `bash .ci/slurm up`"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_unavailable()
    if reason and os.environ.get("DDP_SLURM_REQUIRED") == "1":  # .ci/run brought SLURM up: its tests must run
        pytest.fail(f"DDP_SLURM_REQUIRED=1 but SLURM is not usable: {reason}")
    if reason:
        print(f"\nSKIPPING SLURM TESTS: {reason}")
        pytest.skip(reason)


@pytest.fixture
def stop_signals_restored():
    """A Checkpointer in the test's own process takes the stop signals: pytest's handling comes back after."""
    before = {signum: signal.getsignal(signum) for signum in distributed.STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)
