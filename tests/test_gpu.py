"""What only a GPU shows: nccl, CUDA tensors in every helper, snapshots on the GPU, failures under nccl.

    DDP_GPU_TESTS=1 python -m pytest -q tests/test_gpu.py   # on a machine with CUDA; the CPU suite hides the GPUs

NCCL refuses two ranks on one GPU, so with one GPU nccl runs as a world of one and the multi-rank
cases run under torchrun as gloo with CUDA tensors; the failure cases under nccl need two GPUs.
"""
from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distributed
from seeded_dataset import seeded_dataset
from sync_batchnorm import sync_batchnorm
from harness import MIN_DDP, SCRIPTS, assert_bitwise_equal, leftover_processes, run

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA device is visible (the CPU suite hides them): run "
                                "`DDP_GPU_TESTS=1 python -m pytest -q tests/test_gpu.py` on a machine with a GPU")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one device")



def torchrun_command(processes: int) -> list[str]:
    """This interpreter's torchrun (a bare `torchrun` from PATH may belong to another Python)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def no_core_dumps() -> None:
    """preexec_fn: a CUDA process NCCL's watchdog aborts would dump gigabytes of core."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def start_job(tmp_path, *args: str, torchrun: int = 0,
              timeout: float = 240) -> tuple[subprocess.CompletedProcess, str, float]:
    """Run the job (under torchrun with that many local ranks, else launch()); (result, marker, seconds). NCCL's
    watchdog waits a minute after a timeout to dump its flight recorder, unless told a shorter wait."""
    script = SCRIPTS / "gpu_job.py"
    marker = uuid.uuid4().hex
    command = [sys.executable, str(script), *args]
    if torchrun:
        command = [*torchrun_command(torchrun), str(script), *args]
    started = time.monotonic()
    out = run(command, tmp_path, {"DDP_TEST_MARKER": marker, "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000",
                                  "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "trace_")},
              timeout=timeout, preexec_fn=no_core_dumps)
    return out, marker, time.monotonic() - started


def test_min_ddp_spawns_one_nccl_rank_per_visible_gpu_and_learns():
    out = run([sys.executable, "min_ddp.py", "--epochs", "2", "--log-every", "1000"], timeout=300)
    assert out.returncode == 0, out.stderr
    backend = "nccl" if GPUS > 1 else "none"
    assert f"world={GPUS} backend={backend} allreduce={backend} device=cuda" in out.stdout, out.stdout
    done = re.search(r"done: world=(\d+) epochs=2 .* val_acc=([0-9.]+)", out.stdout)
    assert done and int(done.group(1)) == GPUS and float(done.group(2)) > 0.9, out.stdout


def test_min_ddp_snapshot_saves_and_resumes_on_the_gpu(tmp_path):
    """The saved generator states come back mapped to the GPU; set_rng_state takes CPU bytes only."""
    snapshot = str(tmp_path / "run.pt")
    first = run([sys.executable, "min_ddp.py", "--epochs", "1", "--log-every", "1000", "--snapshot", snapshot],
                timeout=300)
    assert first.returncode == 0, first.stderr
    resumed = run([sys.executable, "min_ddp.py", "--epochs", "2", "--log-every", "1000", "--snapshot", snapshot],
                  timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {snapshot} after 1 epoch" in resumed.stdout and "done:" in resumed.stdout, resumed.stdout


@pytest.mark.parametrize("backend, torchrun", [
    pytest.param("nccl", GPUS, id="nccl-a-rank-per-gpu"),     # a real NCCL group, also of one with one GPU
    pytest.param("gloo", 2, id="gloo-cuda-tensors-2-ranks"),  # ranks may share a GPU under gloo
])
def test_every_helper_works_with_cuda_and_cpu_tensors(tmp_path, backend, torchrun):
    out, marker, _ = start_job(tmp_path, backend, str(tmp_path / "s.pt"), torchrun=torchrun)
    assert out.returncode == 0, out.stderr
    world = torchrun
    assert [f"[rank {r}] on cuda:" in out.stdout for r in range(world)] == [True] * world, out.stdout
    assert "job ok" in out.stdout
    assert leftover_processes(marker) == []


@pytest.mark.parametrize("backend", [pytest.param("nccl", marks=two_gpus), "gloo"], ids=["nccl", "gloo-cuda-tensors"])
def test_slow_rank_names_the_late_rank_from_cuda_events(tmp_path, backend):
    """SlowRank on CUDA times the all-reduce's wait with events read once a window: rank 1, which starts each
    backward 50 ms late, is named with compute in each of the 3 windows, and the job ends cleanly."""
    out, marker, _ = start_job(tmp_path, backend, str(tmp_path / "s.pt"), "slow-rank", torchrun=2)
    assert out.returncode == 0, out.stderr
    lines = re.findall(r"^\[slow rank\] .*$", out.stdout, re.M)
    assert len(lines) == 3 and all("rank 1 (" in line and "its compute" in line for line in lines), out.stdout
    assert leftover_processes(marker) == []


def test_stop_signal_on_nccl_ranks_saves_mid_epoch_resume_is_bitwise(tmp_path):
    """Checkpointer under nccl: the stop check's all-reduce, every rank's CUDA RNG in the snapshot, and a
    mid-epoch resume on one rank per GPU that ends with the uninterrupted run's model: bitwise on 1 or 2 GPUs,
    within float32 rounding on 3 or more (the first step after the resume sums in another bucket layout).
    1024 samples per GPU: 16
    steps an epoch at any GPU count, so the stop after step 5 is in epoch 1 on 8 GPUs too."""
    def train(*flags: str, stop: str = "") -> subprocess.CompletedProcess:
        return run([*torchrun_command(GPUS), str(MIN_DDP), "--epochs", "2", "--batch-size", "64", "--log-every",
                    "1000", "--check-every", "1", *flags], tmp_path, {"TRAIN_SIZE": str(1024 * GPUS), "STOP_AT": stop},
                   timeout=300)
    straight = train("--save-model", str(tmp_path / "straight.pt"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    snapshot, model = str(tmp_path / "snap.pt"), str(tmp_path / "model.pt")
    stopped = train("--snapshot", snapshot, "--save-model", model, stop="0:5:SIGUSR1")
    assert "stopped by SIGUSR1 after 0 epochs and 5 steps; saved to" in stopped.stdout, stopped.stderr[-3000:]
    assert distributed.load_checkpoint(snapshot, map_location="cpu")["ranks"][0]["cuda_rng"] is not None
    resumed = train("--snapshot", snapshot, "--save-model", model)
    assert resumed.returncode == 0 and "after 0 epochs and 5 steps" in resumed.stdout, resumed.stderr[-3000:]
    final = distributed.load_checkpoint(model, map_location="cpu")
    straight = distributed.load_checkpoint(tmp_path / "straight.pt", map_location="cpu")
    if GPUS <= 2:
        assert_bitwise_equal(final, straight, "final model")
    else:  # NCCL's sum depends on DDP's bucket layout, which the resumed first step changes (README, checkpointer.py)
        for key in straight:
            torch.testing.assert_close(final[key], straight[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("more", [[], ["--amp"]], ids=["float64", "float16-autocast-gradscaler-clipping"])
def test_resume_with_cuda_dropout_and_augmentation_is_bitwise(tmp_path, more):
    """rank_scripts/random_loop.py on one GPU: dropout on CUDA (its Philox generator's state in the snapshot) and a
    random augmentation on the CPU, stopped mid-epoch and resumed: bitwise the uninterrupted run, with
    deterministic kernels (torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG, as the README says).
    Also as mixed precision trains on a GPU: float16 autocast, a CUDA GradScaler in the Checkpointer's state,
    gradients unscaled and clipped; every step runs with the uninterrupted run's scale and growth count."""
    def loop(snapshot: str, out: str, stop: int) -> subprocess.CompletedProcess:
        return run([sys.executable, str(SCRIPTS / "random_loop.py"), str(tmp_path / snapshot), str(tmp_path / out),
                    "1", "32", str(stop), "--dropout", "0.2", *more], tmp_path,
                   {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, timeout=300)
    assert loop("never.pt", "straight.pt", 0).returncode == 0
    stopped = loop("snap.pt", "resumed.pt", 5)
    assert stopped.returncode == 138 and "after 0 epochs and 5 steps" in stopped.stdout, stopped.stderr[-3000:]
    resumed = loop("snap.pt", "resumed.pt", 0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(torch.load(tmp_path / "resumed.pt.steps"), torch.load(tmp_path / "straight.pt.steps"))
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "resumed.pt", map_location="cpu"),
                         distributed.load_checkpoint(tmp_path / "straight.pt", map_location="cpu"), "final model")
    if more:  # a lost scaler state need not change the weights (the scale corrects itself): its own record does
        assert_bitwise_equal(torch.load(tmp_path / "resumed.pt.scales"), torch.load(tmp_path / "straight.pt.scales"),
                             "the GradScaler's (scale, growth tracker) at each step")


@two_gpus
def test_a_rank_that_raises_under_nccl_is_reported_with_its_own_exception(tmp_path):
    """The example's `finally: cleanup()` must not wait for NCCL work the peers never finish: the report
    is the rank's ValueError and traceback, not "killed by signal SIGABRT" a minute later. Rank 1 raises with an
    all-reduce in flight that no peer ever joins (they sleep): destroying the group would wait for it until the
    watchdog's abort after the job's 20-s timeout."""
    out, marker, _ = start_job(tmp_path, "nccl", str(tmp_path / "s.pt"), "raise", timeout=120)
    assert out.returncode != 0 and "SIGABRT" not in out.stderr, out.stderr[-3000:]
    assert "ValueError: root cause on rank 1" in out.stderr and "[rank 1] failed first" in out.stderr, out.stderr
    assert leftover_processes(marker) == []


@two_gpus
def test_hung_nccl_rank_fails_after_the_timeout_and_both_are_placed(tmp_path):
    """Rank 1 sleeps; rank 0's reduce() of a CUDA tensor returns at once and it blocks at .item(), until
    NCCL's watchdog aborts it (SIGABRT): faulthandler leaves its stacks, and the launcher's report says
    where each rank blocked, without claiming that rank 0 never reached the collective."""
    # timeout=20 s in the job; the flight recorder's dump waits 2 s (start_job), not its default minute.
    out, marker, seconds = start_job(tmp_path, "nccl", str(tmp_path / "s.pt"), "hang", timeout=300)
    assert out.returncode != 0
    assert seconds < 20 + 45, f"took {seconds:.0f} s"
    lines = (SCRIPTS / "gpu_job.py").read_text().splitlines()
    item = next(n for n, line in enumerate(lines, 1) if "reduce(torch.ones(1, device=device)).item()" in line)
    assert "Where each rank was when the collective timed out" in out.stderr, out.stderr[-3000:]
    assert f"rank 0: blocked outside a collective call, at gpu_job.py:{item} in worker" in out.stderr, \
        out.stderr[-3000:]
    assert "under nccl a rank waits for an earlier collective" in out.stderr
    assert f"NCCL's flight recorder wrote each rank's last collectives (pickles): {tmp_path / 'trace_'}0" in out.stderr
    assert leftover_processes(marker) == []


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def vectors() -> TensorDataset:
    gen = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(64, 5, generator=gen), torch.randint(3, (64,), generator=gen))


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_ddp_check_passes_on_a_gpu_machine():
    """Its pools are gloo CPU processes that see no GPU: no nccl, no two ranks on one device."""
    from ddp_check import assert_ddp_equivalent
    assert_ddp_equivalent(mlp, vectors, cross_entropy, world_sizes=(2,))


def test_seeded_dataset_leaves_the_training_loops_cuda_generator_alone():
    """With num_workers=0 every item is read in the training process: seeding it per item must not reseed the
    CUDA generator (dropout on the GPU), as torch.manual_seed would (it seeds every CUDA device)."""
    class Noise(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(2) + index

    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state()
    data = seeded_dataset(Noise(), seed=1)
    [data[i] for i in range(4)]
    assert torch.equal(torch.cuda.get_rng_state(), before), "reading items moved the CUDA generator"


def test_sync_batchnorm_on_a_gpu_is_torchs_own_syncbatchnorm():
    """On a GPU, sync_batchnorm hands the layers to torch's SyncBatchNorm (its CUDA kernels, nothing of ours)."""
    model = sync_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda())
    assert type(model[1]) is nn.SyncBatchNorm
    model(torch.randn(8, 4, device="cuda")).sum().backward()
    assert model[1].weight.grad is not None and model[1].num_batches_tracked.item() == 1
