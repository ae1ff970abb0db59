"""Stopping on a signal and resuming exactly (checkpointer.Checkpointer), on real processes and signals.

A stop is exact when the resumed run ends with a model bitwise equal to an uninterrupted run's: the
same steps on the same batches, from the same state. The signals are real: a driver script runs
min_ddp (rank_scripts/min_ddp_driver.py) and, at the optimizer step a test chooses, one rank sends a signal to
itself (``STOP_AT``), as a scheduler's signal reaching one process of a job would. A loop of a user's own
(no epochs, no sampler) and a snapshot that only some ranks see use the Checkpointer directly.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import checkpointer
import conftest
import distributed
from harness import (MIN_DDP, SCRIPTS, assert_bitwise_equal, finish, run, run_min_ddp, signal_every_process,
                     signal_once_printed, start, start_ranks, wait_for_job)


# 2 epochs of 16 steps at world 2 (2048 samples, 64 per process), in float64; a stop is checked after every step.
FLAGS = ["--nprocs", "2", "--epochs", "2", "--batch-size", "64", "--seed", "3", "--log-every", "5",
         "--check-every", "1"]
SETTINGS = {"FLOAT64": "1", "TRAIN_SIZE": "2048"}
CODES = {"SIGTERM": 143, "SIGUSR1": 138, "SIGUSR2": 140}


def run_driver(tmp_path: Path, *flags: str, stop_at: str = "", timeout: float = 180) -> subprocess.CompletedProcess:
    """min_ddp's driver run in float64 on 2048 samples, stopped as ``stop_at`` says (rank:step:signal)."""
    return run_min_ddp(tmp_path, *flags, timeout=timeout, STOP_AT=stop_at, **SETTINGS)


def driver_command(tmp_path: Path, *flags: str) -> list[str]:
    return [sys.executable, str(MIN_DDP), *flags]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, str, str]:
    """The reference: the same run, never stopped (its final model, its last line less the speed, its output)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = run_driver(tmp, *FLAGS, "--save-model", str(tmp / "model.pt"))
    assert out.returncode == 0, out.stderr
    return distributed.load_checkpoint(tmp / "model.pt"), done_line(out.stdout), out.stdout


def done_line(stdout: str) -> str:
    return re.sub(r" samples_per_s=\d+", "", stdout.strip().splitlines()[-1])


# Each scenario: one STOP_AT per stopped run and what its stop line says; then a last run finishes. One
# chain of stops shares the reference and a final run: each stop must resume exactly for it to end bitwise.
SCENARIOS = {
    "at the first step, right after a resume, at an epoch's last step, twice in one epoch": [
        ("0:1:SIGUSR1", "SIGUSR1 after 0 epochs and 1 step"),            # at the first step, to rank 0
        ("1:1:SIGTERM", "SIGTERM after 0 epochs and 2 steps"),            # right after a resume, to rank 1
        ("0:14:SIGUSR2", "SIGUSR2 after 0 epochs and 16 steps"),          # at an epoch's last step
        ("1:3:SIGUSR1", "SIGUSR1 after 1 epoch and 3 steps"),            # twice within one epoch
        ("0:4:SIGTERM", "SIGTERM after 1 epoch and 7 steps")],
    "while one rank waits in the gradient all-reduce": [("1:5:SIGUSR1:late", "SIGUSR1 after 0 epochs and 8 steps")],
}
# No stop check after step 5: rank 1 goes straight on to step 6's gradient all-reduce and waits there.
EXTRA = {"while one rank waits in the gradient all-reduce": ["--check-every", "4"]}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_stop_on_a_signal_to_one_rank_resumes_to_the_bitwise_same_model(uninterrupted, tmp_path, scenario):
    """Every rank stops after the same step whichever rank got the signal, saves, and exits with 128 +
    the signal's number; running the same command again finishes the run exactly as if never stopped,
    to the same final metrics."""
    model, done, _ = uninterrupted
    flags = [*FLAGS, "--snapshot", str(tmp_path / "snap.pt"), "--save-model", str(tmp_path / "model.pt"),
             *EXTRA.get(scenario, [])]
    for stop_at, where in SCENARIOS[scenario]:
        out = run_driver(tmp_path, *flags, stop_at=stop_at)
        assert f"stopped by {where}; saved to {tmp_path / 'snap.pt'}" in out.stdout, out.stdout + out.stderr
        assert out.returncode == CODES[where.split()[0]], out.stderr
        assert "Traceback" not in out.stderr and "failed" not in out.stderr, out.stderr
        assert not (tmp_path / "model.pt").exists(), "a stopped run must not write the final model"
    out = run_driver(tmp_path, *flags)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")
    assert done_line(out.stdout) == done, "the resumed run must report the uninterrupted run's metrics"


@pytest.fixture(scope="module")
def stopped_at_step_7(tmp_path_factory) -> Path:
    """The snapshot of FLAGS's run stopped by SIGTERM to rank 0 after 0 epochs and 7 steps (global batch 128)."""
    tmp = tmp_path_factory.mktemp("stopped-at-7")
    assert run_driver(tmp, *FLAGS, "--snapshot", str(tmp / "snap.pt"), stop_at="0:7:SIGTERM").returncode == 143
    return tmp / "snap.pt"


@pytest.mark.slow
def test_stop_snapshot_records_the_position_and_every_ranks_rng_and_metrics(stopped_at_step_7):
    state = distributed.load_checkpoint(stopped_at_step_7)
    assert (state["epoch"], state["epoch_steps"], state["steps"], state["global_batch"]) == (0, 7, 7, 128)
    assert [len(rank["rng"]) for rank in state["ranks"]] == [5056, 5056] and state["settings"]["--seed"] == 3
    assert [int(rank["state"]["unlogged"][2]) for rank in state["ranks"]] == [2 * 64, 2 * 64]  # steps 6 and 7


@pytest.mark.slow
@pytest.mark.parametrize("world, batch", [(1, "128"), (4, "32")])
def test_mid_epoch_stop_resumes_at_another_world_with_same_global_batch(uninterrupted, stopped_at_step_7,
                                                                                 tmp_path, world, batch):
    """Stopped at world 2 after step 7 (global batch 128), resumed at world 1 x 128 or 4 x 32: the same
    samples in every remaining step, so the final model equals the uninterrupted world-2 run's up to the
    order of the gradient sums (float64: rtol 1e-9; a skipped or repeated step moves it by >= 1e-3). At another
    world size the ranks' unlogged sums (steps 6 and 7) cannot be split, so every rank's start at zero: the first
    metrics line covers steps 8-10, 3 x 128 samples. Before, every rank kept rank 0's (the Checkpointer restores
    state in place, into the tensor min_ddp then "reset" with), and the line counted them world-size times."""
    model, _, _ = uninterrupted
    shutil.copy(stopped_at_step_7, tmp_path / "snap.pt")
    flags = [*FLAGS, "--snapshot", str(tmp_path / "snap.pt"), "--save-model", str(tmp_path / "model.pt")]
    flags[1], flags[flags.index("--batch-size") + 1] = str(world), batch
    out = run_driver(tmp_path, *flags)
    assert out.returncode == 0, out.stderr
    assert f"resumed from {tmp_path / 'snap.pt'} after 0 epochs and 7 steps (saved at world size 2)" in out.stdout
    assert f"done: world={world} epochs=2" in out.stdout
    first = next(line for line in out.stdout.splitlines() if line.startswith("[global]"))
    assert first.startswith("[global] epoch 1 step 10/16 ") and first.endswith("/384)"), first
    resumed = distributed.load_checkpoint(tmp_path / "model.pt")
    for key, value in model.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_mid_epoch_resume_at_another_global_batch_is_refused_with_a_fix(stopped_at_step_7,
                                                                                                    tmp_path):
    snap = str(shutil.copy(stopped_at_step_7, tmp_path / "snap.pt"))
    other = [*FLAGS, "--snapshot", snap]
    other[1], other[other.index("--batch-size") + 1] = "1", "64"
    out = run_driver(tmp_path, *other)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (f"min_ddp: the snapshot {snap} stopped after 0 epochs and 7 steps with a global batch (batch size x "
            "grad_accum x processes) of 128 samples, and this run's is 64: the rest of the epoch continues only "
            "with the same global batch: use at 1 process(es), batch size x grad_accum = 128 per process") in out.stderr


@pytest.mark.slow
def test_without_snapshot_a_stop_still_ends_every_rank_at_one_step(tmp_path):
    out = run_driver(tmp_path, *FLAGS, stop_at="1:2:SIGUSR2")
    assert out.returncode == 140, out.stderr
    assert "stopped by SIGUSR2 after 0 epochs and 2 steps; not saved (no snapshot path)" in out.stdout


@pytest.mark.slow
def test_snapshot_only_some_ranks_see_fails_every_rank_naming_the_fix(tmp_path):
    """Rank 0's node has the snapshot and rank 1's does not (node-local disks): resuming one and starting
    the other fresh would drift silently, so every rank fails, saying where the snapshot must be. The ranks are
    started by hand: a launcher would stop the second rank to fail before it could show its own error."""
    script = SCRIPTS / "node_local.py"
    one = run([sys.executable, str(script), str(tmp_path), "1"])
    assert one.returncode == 0 and (tmp_path / "node0" / "snap.pt").exists(), one.stderr
    for rank, (code, _, err) in enumerate(finish(start_ranks([str(script), str(tmp_path), "2"], tmp_path))):
        assert code == 1 and (f"the ranks found different snapshots at {tmp_path / f'node{rank}' / 'snap.pt'} (rank 0: "
                              "the snapshot of step 1; rank 1: no file): every rank must resume the same one. Put the "
                              "snapshot on a file system every node sees") in err, f"rank {rank}: {err}"


@pytest.mark.slow
def test_ranks_finding_snapshots_of_different_steps_all_fail(tmp_path, stop_signals_restored):
    """Node-local disks with a snapshot each, left by different runs or stops: rank 0's of step 1, rank 1's of
    step 2. Agreeing on whether each found one is not enough: they would resume from different steps and drift
    silently until a hang. Every rank fails, naming both and a shared file system."""
    for rank, steps in ((0, 1), (1, 2)):
        path = tmp_path / f"node{rank}" / "snap.pt"
        path.parent.mkdir()
        ckpt = checkpointer.Checkpointer(path, torch.nn.Linear(2, 1), batch_size=1)
        ckpt.steps = steps
        ckpt.save()
    for rank, (code, _, err) in enumerate(finish(start_ranks([str(SCRIPTS / "node_local.py"), str(tmp_path), "2"],
                                                             tmp_path))):
        assert code == 1 and (f"the ranks found different snapshots at {tmp_path / f'node{rank}' / 'snap.pt'} (rank 0: "
                              "the snapshot of step 1; rank 1: the snapshot of step 2): every rank must resume the "
                              "same one. Put the snapshot on a file system every node sees") in err, \
            f"rank {rank}: {err}"


@pytest.mark.slow
def test_a_snapshot_holding_a_setting_this_run_does_not_give_is_refused(tmp_path, stop_signals_restored):
    """A snapshot whose run had a setting the resuming script no longer passes (it dropped --warmup, or it is
    another script's snapshot at the same path) is another run's: refused, naming the setting, in a loop of the
    user's own and in min_ddp, as a setting whose value differs is."""
    path = tmp_path / "run.pt"
    checkpointer.Checkpointer(path, torch.nn.Linear(2, 1), batch_size=64,
                              settings={"--seed": 0, "--lr": 0.01, "--train-size": 16384, "--warmup": 100}).save()
    with pytest.raises(ValueError, match=r"belongs to another run: --warmup: 100 there, not given here"):
        checkpointer.Checkpointer(path, torch.nn.Linear(2, 1), batch_size=64,
                                  settings={"--seed": 0, "--lr": 0.01, "--train-size": 16384})
    out = run([sys.executable, "min_ddp.py", "--nprocs", "1", "--epochs", "1", "--snapshot", str(path)], timeout=120)
    assert out.returncode == 1, out.stderr
    assert f"min_ddp: the snapshot {path} belongs to another run: --warmup: 100 there, not given here" in out.stderr


@pytest.mark.slow
def test_signal_to_the_launcher_reaches_workers_which_save_first(uninterrupted, tmp_path):
    """`kill -TERM <launcher>`: the workers get it, stop at a step and save; then the launcher dies of
    SIGTERM (143), reporting no failure; the rerun finishes bitwise equal."""
    model, done, _ = uninterrupted
    flags = [*FLAGS, "--snapshot", str(tmp_path / "snap.pt"), "--save-model", str(tmp_path / "model.pt")]
    code, out, err, _ = signal_once_printed(driver_command(tmp_path, *flags, "--log-every", "1"), tmp_path,
                                            "[global] epoch 1 step 1/16", lambda pid: os.kill(pid, signal.SIGTERM),
                                            SETTINGS)
    assert code == -signal.SIGTERM, err
    assert "stopped by SIGTERM" in out and "Traceback" not in err and "failed" not in err, err
    assert run_driver(tmp_path, *flags).returncode == 0
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


@pytest.mark.slow
def test_save_slower_than_the_grace_is_killed_reported_and_not_a_clean_stop(tmp_path):
    """SIGUSR1 to the launcher, grace 1 s, a save of 60 s: the launcher kills the ranks, says which and what they
    had saved, and exits 1, not 138 as a stop that saved would; the previous snapshot is still whole. Before, it
    died of the signal like a clean stop, and a job script or a requeue could not tell."""
    script, path = SCRIPTS / "slow_save.py", tmp_path / "snap.pt"
    code, out, err, _ = signal_once_printed([sys.executable, str(script), str(path)], tmp_path, "saved version 1",
                                            lambda pid: os.kill(pid, signal.SIGUSR1), SETTINGS, then=30)
    assert code == 1, err
    assert "WorkerFailed: rank(s) [0, 1] had not exited 1 s after SIGUSR1 and were killed: what they did since " \
           "their last snapshot is lost (rank 0: saved version 1; rank 1: saved version 1)" in err, err
    assert distributed.load_checkpoint(path) == {"version": 1}


@pytest.mark.slow
@pytest.mark.parametrize("how, reported", [
    ("raise", "OSError: [Errno 28] No space left on device"),
    ("die", "rank 1 was killed by signal SIGKILL (the OOM killer sends SIGKILL: check memory, e.g. dmesg) "
            "(its last snapshot: step 3, snap.pt)")])
def test_a_rank_that_fails_after_a_stop_signal_is_the_root_cause_not_the_signal(tmp_path, how, reported):
    """SIGTERM to the launcher, then rank 1 fails to save, raising or killed: the launcher reports rank 1 and
    exits 1, instead of dying of SIGTERM in silence while the user believes the snapshot was written."""
    script = SCRIPTS / "fails_after_stop.py"
    code, out, err, _ = signal_once_printed([sys.executable, str(script), how], tmp_path, "ready",
                                            lambda pid: os.kill(pid, signal.SIGTERM), SETTINGS)
    assert code == 1, err
    assert reported in err, err


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("torchrun"), reason="torchrun is not on PATH")
def test_torchrun_agent_forwards_stop_signals_and_workers_save_in_time(uninterrupted,
                                                                                                   tmp_path):
    """SIGTERM reaches the workers through torchrun's agent as is. USR1 (SLURM's early warning) only with the
    --signals-to-handle that checkpointer.py's docstring gives (torch 2.10 or newer: older agents lack the flag):
    by default the agent dies of it and its workers with it, nothing saved."""
    model, done, _ = uninterrupted
    snap = tmp_path / "snap.pt"
    flags = [*FLAGS[2:], "--snapshot", str(snap), "--save-model", str(tmp_path / "model.pt")]
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2"]
    stops = [("[global] epoch 1 step 2/16", signal.SIGTERM, [])]
    if torch.__version__ >= (2, 10):
        usr1 = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
        stops.append(("[global] epoch 2 step 2/16", signal.SIGUSR1, [usr1]))
    for line, signum, agent_flags in stops:
        code, out, err, _ = signal_once_printed([*torchrun, *agent_flags, str(MIN_DDP), *flags, "--log-every",
                                                 "1"], tmp_path, line, lambda pid, signum=signum: os.kill(pid, signum),
                                                SETTINGS)
        assert f"stopped by {signum.name}" in out, out + err
        assert distributed.load_checkpoint(snap)["epoch_steps"] > 0
    out = run([*torchrun, str(MIN_DDP), *flags], tmp_path, SETTINGS, timeout=180)
    assert out.returncode == 0, out.stderr
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


SMALL_BATCHES = [*FLAGS[:-2], "--batch-size", "16", "--check-every", "100"]  # the later --batch-size wins


@pytest.fixture(scope="module")
def uninterrupted_small_batches(tmp_path_factory) -> dict:
    """2 epochs of 64 steps (batch 16): the stop check at --check-every 100 comes in epoch 2."""
    tmp = tmp_path_factory.mktemp("small-batches")
    out = run_driver(tmp, *SMALL_BATCHES, "--save-model", str(tmp / "model.pt"))
    assert out.returncode == 0, out.stderr
    return distributed.load_checkpoint(tmp / "model.pt")


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["", "forkserver"], ids=["platform-default", "forkserver-as-python-3.14"])
def test_dataloader_workers_survive_a_signal_to_every_process_of_the_job(uninterrupted_small_batches, tmp_path,
                                                                          start_method):
    """SLURM signals every process of a job step: with --workers 2 the loader workers must not die of it,
    though the ranks keep fetching batches for 98 more steps until the check at step 100. Under a forkserver
    (Python 3.14's default) they are its children: its death would end them."""
    flags = [*SMALL_BATCHES, "--workers", "2", "--snapshot", str(tmp_path / "snap.pt"),
             "--save-model", str(tmp_path / "model.pt")]
    code, out, err, _ = signal_once_printed(driver_command(tmp_path, *flags, "--log-every", "1"), tmp_path,
                                            "[global] epoch 1 step 2/64", signal_every_process(signal.SIGUSR1),
                                            {**SETTINGS, "START_METHOD": start_method})
    assert "stopped by SIGUSR1 after 1 epoch and 36 steps" in out and code == -signal.SIGUSR1, err
    assert "Traceback" not in err, err
    flags[flags.index("--workers") + 1] = "0"  # the resume needs no loader workers: the stop was the test
    assert run_driver(tmp_path, *flags).returncode == 0
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), uninterrupted_small_batches, "final model")


# --- On the real local SLURM (bash .ci/slurm up) -------------------------------------------------
SBATCH = textwrap.dedent('''\
    #!/bin/bash
    #SBATCH --ntasks=2 --cpus-per-task=1 --requeue --open-mode=append
    srun --kill-on-bad-exit=1 {command}
''')


def sbatch(tmp_path: Path, *options: str, slow_first_run: float, env: dict[str, str] | None = None) -> str:
    """Submit min_ddp as a 2-task batch job that may be requeued, with ``env`` added to the job's; its id."""
    flags = [*FLAGS[2:], "--snapshot", "snap.pt", "--save-model", "model.pt", "--log-every", "1"]
    (tmp_path / "job.sbatch").write_text(SBATCH.format(command=" ".join(driver_command(tmp_path, *flags))))
    env = {**SETTINGS, "SLOW_FIRST_RUN": str(slow_first_run), **(env or {})}
    out = run(["sbatch", "--parsable", f"--chdir={tmp_path}", "--output=slurm.out", *options,
               str(tmp_path / "job.sbatch")], env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


TIME_LIMIT_TEST = "test_sbatch_signal_before_time_limit_saves_requeues_once_resumes"


@pytest.fixture(scope="module", autouse=True)
def time_limit_job(request, tmp_path_factory) -> tuple[Path, str] | None:
    """The time-limit test's job (its folder and id), submitted as this file starts when that test is to run:
    most of its minute is waiting for slurmctld's 30-s check, and the file's other tests run meanwhile instead
    of a core idling. Cancelled at the file's end if its test did not wait it out."""
    wanted = any(item.path == request.path and item.name == TIME_LIMIT_TEST for item in request.session.items)
    if not wanted or conftest.slurm_unavailable():
        yield None
        return
    tmp = tmp_path_factory.mktemp("time-limit")
    slow_scontrol = {"PATH": f"{SCRIPTS / 'slow_scontrol'}{os.pathsep}{os.environ['PATH']}",
                     "REAL_SCONTROL": shutil.which("scontrol")}
    job = sbatch(tmp, "--time=2", "--signal=USR1@70", slow_first_run=3, env=slow_scontrol)  # 96 s of steps
    yield tmp, job
    run(["scancel", job], timeout=30)  # nothing to do once it ended


@pytest.mark.slow
def test_sbatch_signal_before_time_limit_saves_requeues_once_resumes(slurm, uninterrupted, time_limit_job):
    """`--time=2 --signal=USR1@70 --requeue`: slurmctld checks every 30 s and signals at its first check
    with at most 70 + 30 s left, so USR1 reaches the srun step 20 to 50 s into the run, long after the
    Checkpointer installed its handlers (a few seconds in; with --time=1 it came at once and killed the
    job); every rank saves, the primary requeues the job, and the rerun resumes and finishes with the
    uninterrupted run's model. scontrol is slow to exit there (rank_scripts/slow_scontrol): SLURM ends the job's
    processes on the requeue before it has, as on a busy node, and the requeue must still read as done. The job
    was submitted as this file started (time_limit_job)."""
    model, done, _ = uninterrupted
    tmp_path, job = time_limit_job
    info = wait_for_job(job)
    log = (tmp_path / "slurm.out").read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log
    assert log.count("; saved to snap.pt; requeued") == 1, log
    assert re.search(r"stopped by SIGUSR1 after \d+ epochs? and \d+ steps?;", log), log
    assert "resumed from snap.pt" in log and "Traceback" not in log, log
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")
    assert done_line(log) == done


@pytest.mark.slow
def test_scancel_saves_and_is_not_requeued(slurm, uninterrupted, tmp_path):
    """`scancel JOB` is SIGTERM to every task: they save and the job ends CANCELLED, never requeued
    (although it was submitted with --requeue); the same command resumes it bitwise."""
    model, done, _ = uninterrupted
    job = sbatch(tmp_path, slow_first_run=0.5)
    log, deadline = tmp_path / "slurm.out", time.monotonic() + 120
    while "[global] epoch 1 step 2/16" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"job {job} never reached step 2"
        time.sleep(0.2)
    run(["scancel", job], timeout=30, check=True)
    info = wait_for_job(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log.read_text()
    text = log.read_text()
    assert re.search(r"stopped by SIGTERM after \d+ epochs? and \d+ steps?;", text) and "requeued" not in text, text
    rerun = ["srun", "-n", "2", "-c", "1", *driver_command(tmp_path, *FLAGS[2:]), "--snapshot", "snap.pt",
             "--save-model", "model.pt"]
    out = run(rerun, tmp_path, SETTINGS, timeout=180)
    assert out.returncode == 0 and "resumed from snap.pt" in out.stdout, out.stderr
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


@pytest.mark.slow
def test_without_scontrol_a_due_requeue_is_named_and_exits_75_for_requeue_exit(slurm, tmp_path):
    """In a container without scontrol the requeue cannot be asked for: min_ddp says so and every rank
    exits 75 (EX_TEMPFAIL), the code slurm.conf's RequeueExit=75 requeues on."""
    env = {**SETTINGS, "STOP_AT": "1:3:SIGUSR1", "PATH": str(Path(sys.executable).parent)}  # no scontrol
    out = run([shutil.which("srun"), "-n", "2", "-c", "1", *driver_command(tmp_path, *FLAGS[2:]), "--snapshot",
               "snap.pt"], tmp_path, env, timeout=180)
    assert out.returncode == 75, out.stderr
    assert "stopped by SIGUSR1 after 0 epochs and 3 steps; saved to snap.pt; could not requeue" in out.stdout
    assert re.search(r"requeue: scontrol is not on PATH here, so job \d+ is not requeued", out.stderr), out.stderr


def test_a_requeue_answered_before_slurm_ends_scontrol_reads_as_done(tmp_path, monkeypatch):
    """SLURM ends every process of the job once it requeues it, scontrol too; on a busy node that can be before
    scontrol has exited. Here scontrol gets that SIGTERM (from itself) after answering: requeue() still returns
    True. (The time-limit test shows the same with SLURM's own signal.)"""
    fake = tmp_path / "scontrol"
    # bash, as scontrol, keeps the signal mask it is started with (dash clears it)
    fake.write_text("#!/bin/bash\necho \"$@\" > asked\nkill -TERM $$\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    assert checkpointer.requeue() is True
    assert (tmp_path / "asked").read_text() == "requeue 41\n"


@pytest.mark.parametrize("signum, restarts, requeued", [(signal.SIGUSR1, 1, True), (signal.SIGUSR1, 2, False),
                                                       (signal.SIGTERM, 0, False)],
                         ids=["warning-after-1-requeue", "warning-after-2-requeues", "scancel"])
def test_a_stop_requeues_only_at_the_warning_and_below_max_requeues(tmp_path, monkeypatch, stop_signals_restored,
                                                                   signum, restarts, requeued):
    """Under SLURM's variables, with a scontrol stand-in that records what it is asked, max_requeues=2: the time
    limit's warning (USR1) after progress requeues a job SLURM restarted once, not one it restarted twice (2
    requeues in all); scancel's SIGTERM never requeues (the job was cancelled). Every case saves and stops with
    128 + the signal. These run wherever the suite does, SLURM up or not."""
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/bash\necho \"$@\" >> asked\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    ckpt = checkpointer.Checkpointer(tmp_path / "run.pt", torch.nn.Linear(1, 1), batch_size=1, max_requeues=2,
                                     check_every=1)
    os.kill(os.getpid(), signum)  # recorded by the Checkpointer's handler
    with pytest.raises(checkpointer.Stopped) as stopped:
        ckpt.step()
    assert stopped.value.code == 128 + signum
    assert (tmp_path / "asked").exists() == requeued
    assert distributed.load_checkpoint(tmp_path / "run.pt")["steps"] == 1


def test_save_every_counts_the_runs_steps_across_epochs(tmp_path, stop_signals_restored):
    """save_every=3 over epochs of 4 steps: a snapshot after the run's steps 3 and 6 (and at each epoch's end), so
    that a hard kill loses at most 3 steps; counted within each epoch, steps 6 and 8 would save nothing new."""
    data = TensorDataset(torch.arange(8.0))
    loader = DataLoader(data, batch_size=2, sampler=distributed.data_sampler(data, shuffle=False))
    path = tmp_path / "run.pt"
    ckpt = checkpointer.Checkpointer(path, torch.nn.Linear(1, 1), loader=loader, save_every=3, save_interval=0,
                                     check_every=1000)
    saved = []  # the snapshot's step after each of the run's steps
    for _ in ckpt.epochs(2):
        for _ in loader:
            ckpt.step()
            saved.append(distributed.load_checkpoint(path)["steps"] if path.exists() else None)
    assert saved == [None, None, 3, 3, 4, 6, 6, 6], saved


@pytest.mark.parametrize("kwargs, message", [
    ({"check_every": 0}, "check_every must be an integer >= 1, got: 0"),
    ({"grad_accum": 2.0}, "grad_accum must be an integer >= 1, got: 2.0"),
    ({"save_every": -1}, "save_every must be an integer >= 0, got: -1"),
    ({"settings": {"args": object()}},
     r"settings\['args'\] is a object, which torch.load\(weights_only=True\) refuses"),
    ({"state": {"args": argparse.Namespace()}}, r"Checkpointer: state\['args'\] is a Namespace"),  # not at a save
    ({"env": {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}}, "no process group yet; construct it after "
                                                                  r"distributed.init_process_group\(\)"),
    ({"path": "/no/such/dir/run.pt", "batch_size": 4},
     "cannot write snapshots to /no/such/dir/run.pt: its directory is missing"),
    ({"path": "run.pt"}, r"an iteration loop \(no loader=\) needs batch_size=, the samples each rank trains on"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got: 0"),
    ({"loader": DataLoader(list(range(4)), batch_size=2), "batch_size": 3},
     r"batch_size=3 but loader.batch_size=2; leave batch_size out when you pass a loader"),
    ({"save_interval": -1}, "save_interval must be a number of seconds >= 0, got: -1"),
])
def test_checkpointer_refuses_bad_arguments_before_it_takes_the_stop_signals(kwargs, message, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    for name, value in kwargs.pop("env", {}).items():
        monkeypatch.setenv(name, value)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        checkpointer.Checkpointer(kwargs.pop("path", None), torch.nn.Linear(2, 1), **kwargs)
    assert signal.getsignal(signal.SIGTERM) is before, "a refused Checkpointer must leave the signals alone"


def test_save_without_a_snapshot_path_is_an_error_naming_it(stop_signals_restored):
    ckpt = checkpointer.Checkpointer(None, torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"Checkpointer.save: this Checkpointer has no snapshot path \(path=None\)"):
        ckpt.save()


def test_restored_state_keeps_each_tensors_device(tmp_path, stop_signals_restored):
    """load_checkpoint maps a snapshot onto this rank's GPU; a tensor the user keeps elsewhere (a CPU counter on
    a GPU machine) must come back there. Without a GPU, the 'meta' device stands in for 'elsewhere'."""
    path, model = tmp_path / "run.pt", torch.nn.Linear(2, 1)
    checkpointer.Checkpointer(path, model, batch_size=1, state={"kept": torch.ones(2), "nested": {"n": torch.ones(1)},
                                                 "listed": [torch.ones(1)], "pair": (torch.ones(1), 1),
                                                 "count": 3}).save()
    meta = lambda n: torch.empty(n, device="meta")  # noqa: E731
    state = {"kept": meta(2), "nested": {"n": meta(1)}, "listed": [meta(1)], "pair": (meta(1), 0), "count": 0}
    checkpointer.Checkpointer(path, model, batch_size=1, state=state)
    kept = [state["kept"], state["nested"]["n"], state["listed"][0], state["pair"][0]]
    assert [tensor.device.type for tensor in kept] == ["meta"] * 4
    assert state["count"] == 3 and state["pair"][1] == 1 and isinstance(state["pair"], tuple)


@pytest.mark.parametrize("saved, resumed", [(False, True), (True, False)])
def test_a_gradscaler_resumed_with_another_setting_is_a_settings_error(tmp_path, stop_signals_restored, saved,
                                                                        resumed):
    """A snapshot saved with a disabled GradScaler resumed with an enabled one raised torch's bare "The source
    state dict is empty"; the reverse was silently ignored. Both name the difference and the fix."""
    path, model = tmp_path / "run.pt", torch.nn.Linear(2, 1)
    checkpointer.Checkpointer(path, model, batch_size=1,
                              state={"scaler": torch.amp.GradScaler("cpu", enabled=saved)}).save()
    was, now = ("enabled" if saved else "disabled"), ("enabled" if resumed else "disabled")
    with pytest.raises(ValueError, match=rf"state\['scaler'\] of a GradScaler that was {was}, and this run's is "
                                         rf"{now}: resume with the same mixed-precision setting"):
        checkpointer.Checkpointer(path, model, batch_size=1,
                                  state={"scaler": torch.amp.GradScaler("cpu", enabled=resumed)})


class EpochOrder(torch.utils.data.Sampler):
    """A sampler of a user's own, as a repeated-augmentation sampler is written: each index 2 times, in an order
    drawn from a generator seeded by (seed, epoch); no skip of its own."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch))
        return iter(order.repeat_interleave(2).tolist())

    def __len__(self) -> int:
        return 2 * self.n


@pytest.mark.parametrize("wrap", ["torch's DistributedSampler", "data_sampler in a batch_sampler", "own sampler"])
def test_checkpointer_resumes_mid_epoch_with_any_epoch_ordered_sampler(tmp_path, wrap, stop_signals_restored):
    """ckpt.epochs() calls set_epoch on the loader's sampler also when it is torch's own, batched by a
    batch_sampler, or the user's own; a mid-epoch snapshot resumes the same epoch's order after the samples done
    (their indices skipped, nothing loaded), and the next epoch is whole. No loader cannot continue it: refused,
    not silently redone."""
    data = TensorDataset(torch.arange(16))
    if wrap == "torch's DistributedSampler":
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    elif wrap == "own sampler":
        sampler = EpochOrder(16)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    else:
        sampler = distributed.data_sampler(data, True, shuffle=True)
        loader = DataLoader(data, batch_sampler=BatchSampler(sampler, batch_size=4, drop_last=False))
    expected, kind = [], type(sampler)  # what the sampler gives when its epoch is set by hand
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected.append(list(sampler))
    ckpt = checkpointer.Checkpointer(tmp_path / "run.pt", torch.nn.Linear(1, 1), loader=loader)
    got = [torch.cat([x for x, in loader]).tolist() for _ in ckpt.epochs(3)]
    assert got == expected and expected[0] != expected[1], got
    ckpt.epoch, ckpt.epoch_steps = 1, 2
    ckpt.save()
    with pytest.raises(ValueError, match=r"stopped mid-epoch, and only a loader with a sampler and a batch size"):
        next(checkpointer.Checkpointer(tmp_path / "run.pt", torch.nn.Linear(1, 1), batch_size=4).epochs(3))
    resumed = checkpointer.Checkpointer(tmp_path / "run.pt", torch.nn.Linear(1, 1), loader=loader)
    got = [(epoch, len(loader), torch.cat([x for x, in loader]).tolist()) for epoch in resumed.epochs(3)]
    rest = expected[1][8:]
    assert got == [(1, len(rest) // 4, rest), (2, len(expected[2]) // 4, expected[2])], got
    assert type(pickle.loads(pickle.dumps(sampler))) is kind, "pickled or copied, the user's own class comes back"


def test_checkpointer_refuses_a_sampler_that_draws_anew_every_pass(tmp_path, stop_signals_restored):
    """DataLoader(shuffle=True)'s RandomSampler draws a new order at every pass from the global generator: a
    snapshot saved mid-epoch could not resume where it stopped, so a Checkpointer with a snapshot path refuses it at
    construction, naming the fix, and leaves the global generator as it was. Without a path it is accepted."""
    data = TensorDataset(torch.arange(16))
    loader, model = DataLoader(data, batch_size=4, shuffle=True), torch.nn.Linear(1, 1)
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"the loader's sampler \(RandomSampler\) draws a new order at every pass.*"
                                         r"distributed\.data_sampler\(data, shuffle=True\).*set_epoch\(epoch\)"):
        checkpointer.Checkpointer(tmp_path / "run.pt", model, loader=loader)
    assert torch.equal(torch.get_rng_state(), before)
    assert not (tmp_path / "run.pt").exists()
    checkpointer.Checkpointer(None, torch.nn.Linear(1, 1), loader=loader)


# --- The sampler that starts mid-epoch ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
def test_stop_requested_alone_installs_handlers_and_every_rank_answers(tmp_path, launcher):
    """A loop written to stop_requested()'s contract: it asks at every step boundary and never calls
    handle_stop_signals(). SIGUSR1 to rank 1 alone: the first call installed the handlers, so rank 1 lives, and
    every rank's next answer is SIGUSR1. Before, the first call raised "the stop signals are not handled here"."""
    if launcher == "torchrun" and not shutil.which("torchrun"):
        pytest.skip("torchrun is not on PATH")
    starter = {"launch": [sys.executable], "torchrun": ["torchrun", "--standalone", "--nproc_per_node=2"]}[launcher]
    proc = start([*starter, str(SCRIPTS / "asks_to_stop.py"), str(tmp_path)], tmp_path)
    deadline = time.monotonic() + 180
    while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)) and proc.poll() is None:
        assert time.monotonic() < deadline, "the ranks never asked"
        time.sleep(0.1)
    if proc.poll() is None:
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGUSR1)
    [(code, out, err)] = finish([proc])
    assert code == 0, err
    for rank in (0, 1):
        assert f"rank {rank} answered SIGUSR1" in out, out + err


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("pgrep") or sys.platform != "linux", reason="needs pgrep on Linux")
def test_a_rank_is_found_by_its_process_name_and_signalled(tmp_path):
    """launch()'s ranks show the forkserver's command line, so `ps | grep train.py` finds only the launcher; each
    rank is named <script>:r<rank>, and the README's `pgrep -o -x <script>:r1` finds rank 1 (the oldest of
    that name: its loader workers inherit it). Signalled that way, every rank answers. The script runs as a copy
    named pgrep_finds.py: another test's asks_to_stop job may run beside this one (pytest-xdist), and be older."""
    script = tmp_path / "pgrep_finds.py"
    shutil.copy(SCRIPTS / "asks_to_stop.py", script)
    proc = start([sys.executable, str(script), str(tmp_path)], tmp_path)
    deadline = time.monotonic() + 180
    while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)) and proc.poll() is None:
        assert time.monotonic() < deadline, "the ranks never asked"
        time.sleep(0.1)
    found = run(["pgrep", "-o", "-x", "pgrep_finds:r1"], timeout=30)
    if proc.poll() is None and found.returncode == 0:
        os.kill(int(found.stdout), signal.SIGUSR1)
    elif proc.poll() is None:
        proc.kill()  # found nothing to signal: the job would run until finish() called it a hang
    [(code, out, err)] = finish([proc])
    assert found.stdout.strip() == (tmp_path / "rank1.pid").read_text(), f"pgrep found {found.stdout!r}"
    assert code == 0 and "rank 0 answered SIGUSR1" in out and "rank 1 answered SIGUSR1" in out, out + err
