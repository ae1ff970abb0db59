"""shared_memory_allreduce.py: DDP's gradient mean through /dev/shm instead of gloo.

min_ddp turns it on (its banner says allreduce=shared-memory), so every multi-process min_ddp run
in this suite goes through it, and test_ddp.py's training properties draw "gloo" or
"shared-memory" for every example (N processes = 1 process, replicas bitwise equal). Here:
- for two ranks it is bitwise gloo's result, step after step (a + b is commutative, so the same
  rounding), with one bucket or one per parameter;
- it never hangs: a dead peer is named within seconds, a stalled one fails after the timeout;
- it leaves nothing in /dev/shm, and steps aside (returns False, gloo stays) when the ranks do not
  share one /dev/shm or it is too small. Those use real mount namespaces (unshare, as root).
"""
from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import SCRIPTS, build_model, cannot_run, examples, finish, start, start_ranks, task_train
from shared_memory_allreduce import shared_memory_allreduce


# Runs the rest of the command with its own, empty /dev/shm of the given size.
PRIVATE_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"']
WIDE = 4096  # Linear(4096, 8): 128 KiB of gradients, so 128 KiB of /dev/shm for two ranks


PRIVATE_SHM_UNAVAILABLE = cannot_run([*PRIVATE_SHM, "1M", "true"], "cannot mount a private /dev/shm")
needs_private_shm = pytest.mark.skipif(bool(PRIVATE_SHM_UNAVAILABLE), reason=str(PRIVATE_SHM_UNAVAILABLE))


def our_shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/distributed-py-grads-*"))


def job_script(tmp_path: Path) -> Path:
    return SCRIPTS / "shm_job.py"


def job_ranks(tmp_path: Path, behaviour: str, width: int, prefixes: list | None = None) -> list:
    """The job's two ranks, started by hand as torchrun would (no launcher watching over them)."""
    return start_ranks([str(job_script(tmp_path)), behaviour, str(width)], tmp_path, prefixes=prefixes)


# ---------------------------------------------------------------------------------------------
# The result: gloo's, bitwise
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=examples(30))
@given(kind=st.sampled_from(["mlp", "conv", "lm"]), width=st.integers(2, 6), batch=st.integers(1, 4),
       steps=st.integers(1, 4), optim=st.sampled_from(["sgd", "momentum", "adam"]),
       bucket_cap_mb=st.sampled_from([None, 1e-6]), model_seed=st.integers(0, 2**16),
       data_seed=st.integers(0, 2**16))
def test_two_rank_shared_memory_training_is_bitwise_gloo_training(pools, kind, width, batch, steps, optim,
                                                                   bucket_cap_mb, model_seed, data_seed):
    spec = {"kind": kind, "width": width, "batch": batch, "steps": steps, "optim": optim, "lr": 0.1,
            "model_seed": model_seed, "data_seed": data_seed, "shuffle": True, "epoch": 0, "accum": 1,
            "n": steps * batch * 2, "bucket_cap_mb": bucket_cap_mb}
    gloo = pools.run(2, task_train, {**spec, "allreduce": "gloo"})
    shm = pools.run(2, task_train, {**spec, "allreduce": "shared-memory"})
    for step in range(steps):
        for rank in range(2):
            assert torch.equal(shm[rank]["params"][step], gloo[rank]["params"][step]), \
                f"rank {rank}, step {step + 1}: shared memory != gloo"
    initial = torch.cat([p.detach().flatten() for p in build_model(kind, width, model_seed).parameters()])
    assert (shm[0]["params"][0] - initial).abs().max() > 1e-6, "the step must change the model"


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks_give_gloos_mean_to_rounding_and_bitwise_equal_replicas(pools, world):
    """One bucket per parameter, and a bias of 2 elements: some ranks own an empty chunk. The sum runs
    in rank order, gloo's in ring order, and a rank's own share is scaled by 1/world rather than divided
    (exact for world 4): in float64 a few ulps of gradients of order 1, times lr 0.1, per step: far
    inside 1e-13 after 3 steps, while a lost or misplaced chunk is off by about 1e-2."""
    spec = {"kind": "mlp", "width": 2, "batch": 2, "steps": 3, "optim": "momentum", "lr": 0.1,
            "model_seed": 3, "data_seed": 4, "shuffle": True, "epoch": 0, "accum": 1, "n": 3 * 2 * world,
            "bucket_cap_mb": 1e-6}
    gloo = pools.run(world, task_train, {**spec, "allreduce": "gloo"})
    shm = pools.run(world, task_train, {**spec, "allreduce": "shared-memory"})
    for step in range(spec["steps"]):
        for rank in range(world):
            assert torch.equal(shm[rank]["params"][step], shm[0]["params"][step]), f"rank {rank} != rank 0"
            torch.testing.assert_close(shm[rank]["params"][step], gloo[rank]["params"][step],
                                       rtol=1e-12, atol=1e-13)
    initial = torch.cat([p.detach().flatten() for p in build_model("mlp", 2, 3).parameters()])
    assert (shm[0]["params"][0] - initial).abs().max() > 1e-6, "the step must change the model"


def test_a_model_that_is_not_ddp_is_rejected_naming_its_type():
    with pytest.raises(TypeError, match=r"got: Linear.*DDP\(model\)"):
        shared_memory_allreduce(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_launch_uses_shared_memory_and_gives_gloos_mean(tmp_path):
    before = our_shm_files()
    [(code, out, err)] = finish([start([sys.executable, str(job_script(tmp_path)), "ok", str(WIDE)], tmp_path)])
    assert code == 0, err
    assert "rank 0 hooked=True" in out and "rank 1 hooked=True" in out
    assert out.count("exact=True replicas_equal=True") == 2, out
    assert our_shm_files() <= before, "the /dev/shm file is unlinked once every rank has mapped it"


# ---------------------------------------------------------------------------------------------
# Never a hang
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dead_peer_is_named_within_seconds_instead_of_a_hang(tmp_path):
    before = our_shm_files()
    procs = job_ranks(tmp_path, "die", 8)
    (code0, out0, err0), (code1, _, _) = finish(procs)
    assert code1 == 3
    assert code0 != 0 and "exact=" not in out0
    assert f"peer rank 1 (pid {procs[1].pid}) exited before the gradient all-reduce" in err0, err0
    assert our_shm_files() <= before, "nothing left in /dev/shm after a crash"


@pytest.mark.slow
def test_stalled_peer_fails_after_the_timeout_naming_it(tmp_path):
    procs = job_ranks(tmp_path, "stall", 8)
    try:
        code0, _, err0 = finish(procs[:1])[0]
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert code0 != 0
    assert "timed out after 0:00:01 waiting for ranks [1] at the gradient all-reduce" in err0, err0


# ---------------------------------------------------------------------------------------------
# Steps aside when it cannot work: gloo stays, the mean is the same
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_private_shm
def test_ranks_that_do_not_share_dev_shm_keep_gloo(tmp_path):
    """Rank 1 sees another /dev/shm, as on another host or in another container."""
    results = finish(job_ranks(tmp_path, "ok", 8, prefixes=[[], [*PRIVATE_SHM, "1M"]]))
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank} hooked=False" in out and "exact=True replicas_equal=True" in out, out


@pytest.mark.slow
@needs_private_shm
def test_a_dev_shm_too_small_for_the_gradients_keeps_gloo(tmp_path):
    command = [*PRIVATE_SHM, "64k", sys.executable, str(job_script(tmp_path)), "ok", str(WIDE)]
    [(code, out, err)] = finish([start(command, tmp_path)])
    assert code == 0, err
    assert "rank 0 hooked=False" in out and "rank 1 hooked=False" in out, out
    assert out.count("exact=True replicas_equal=True") == 2, out
