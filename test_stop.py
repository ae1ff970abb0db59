"""Stopping on a signal and resuming mid-epoch exactly (issue 27), on real processes and signals.

A stop is exact when the resumed run ends with a model bitwise equal to an uninterrupted run's: the
same steps on the same batches, from the same state. The signals are real: a driver script runs
min_ddp and, at the optimizer step a test chooses, one rank sends a signal to itself (``STOP_AT``),
as a scheduler's signal reaching one process of a job would.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distributed
from harness import HERE, examples, task_sampler_skip
from test_snapshot import assert_bitwise_equal

# min_ddp with signals at chosen steps. STOP_AT="rank:step:SIGNAL[:late],...": after its step-th optimizer
# step of this run, that rank signals itself; ":late" sends it 0.3 s later while every other rank sleeps
# 0.6 s, so the signal lands while this rank waits inside the next step's gradient all-reduce.
# SLOW_FIRST_RUN=S: a SLURM job's first run sleeps S s after each step, so that SLURM's signal finds it
# training; a requeued run (SLURM_RESTART_COUNT=1) is not slowed.
DRIVER = textwrap.dedent('''
    import os, signal, sys, threading, time
    sys.path.insert(0, {repo!r})
    import min_ddp  # first: it silences torch's warning that numpy is missing
    import distributed
    from torch.optim.optimizer import register_optimizer_step_post_hook

    PLAN = [item.split(":") for item in os.environ.get("STOP_AT", "").split(",") if item]

    def after_step(optimizer, args, kwargs):
        optimizer.steps_here = getattr(optimizer, "steps_here", 0) + 1
        for rank, step, name, *late in PLAN:
            if int(step) != optimizer.steps_here:
                continue
            signum = getattr(signal, name)
            if int(rank) == distributed.get_rank():
                send = lambda: os.kill(os.getpid(), signum)
                threading.Timer(0.3, send).start() if late else send()
            elif late:
                time.sleep(0.6)

    register_optimizer_step_post_hook(after_step)
    if os.environ.get("SLOW_FIRST_RUN") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        register_optimizer_step_post_hook(lambda *args: time.sleep(float(os.environ["SLOW_FIRST_RUN"])))

    if __name__ == "__main__":
        min_ddp.main()
''')
# 2 epochs of 16 steps at world 2; a stop is checked after every step.
FLAGS = ["--nprocs", "2", "--epochs", "2", "--batch-size", "512", "--seed", "3", "--log-every", "5",
         "--check-every", "1"]
CODES = {"SIGTERM": 143, "SIGUSR1": 138, "SIGUSR2": 140}


def run_min_ddp(tmp_path: Path, *flags: str, stop_at: str = "", script: str = "driver.py",
                timeout: float = 180) -> subprocess.CompletedProcess:
    driver = tmp_path / "driver.py"
    if not driver.exists():
        driver.write_text(DRIVER.format(repo=HERE))
    return subprocess.run([sys.executable, str(tmp_path / script), *flags], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "STOP_AT": stop_at})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, str]:
    """The reference: the same run, never stopped (its final model, and its last line less the speed)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = run_min_ddp(tmp, *FLAGS, "--save-model", str(tmp / "model.pt"))
    assert out.returncode == 0, out.stderr
    return distributed.load_checkpoint(tmp / "model.pt"), done_line(out.stdout)


def done_line(stdout: str) -> str:
    return re.sub(r" samples_per_s=\d+", "", stdout.strip().splitlines()[-1])


# Each scenario: one STOP_AT per stopped run and what its stop line says; then a last run finishes.
SCENARIOS = {
    "at step 0, signal to rank 0": [("0:1:SIGUSR1", "SIGUSR1 after batch 1 of epoch 1")],
    "mid-epoch, signal to rank 1": [("1:7:SIGTERM", "SIGTERM after batch 7 of epoch 1")],
    "at an epoch's last step": [("0:16:SIGUSR2", "SIGUSR2 after batch 16 of epoch 1")],
    "twice within one epoch": [("1:3:SIGUSR1", "SIGUSR1 after batch 3 of epoch 2"),
                               ("0:4:SIGTERM", "SIGTERM after batch 7 of epoch 2")],
    "right after a resume": [("0:20:SIGTERM", "SIGTERM after batch 4 of epoch 2"),
                             ("1:1:SIGUSR1", "SIGUSR1 after batch 5 of epoch 2")],
    "while one rank waits in the gradient all-reduce": [("1:5:SIGUSR1:late", "SIGUSR1 after batch 8 of epoch 1")],
}
# No stop check after step 5: rank 1 goes straight on to step 6's gradient all-reduce and waits there.
EXTRA = {"while one rank waits in the gradient all-reduce": ["--check-every", "4"]}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_stop_on_a_signal_to_one_rank_resumes_to_the_bitwise_same_model(uninterrupted, tmp_path, scenario):
    """Every rank stops after the same step whichever rank got the signal, saves, and exits with 128 +
    the signal's number; running the same command again finishes the run exactly as if never stopped."""
    model, done = uninterrupted
    flags = [*FLAGS, "--snapshot", str(tmp_path / "snap.pt"), "--save-model", str(tmp_path / "model.pt"),
             *EXTRA.get(scenario, [])]
    stops = SCENARIOS[scenario]
    if scenario == "twice within one epoch":  # both stops inside epoch 2: first a whole epoch 1
        stops = [("0:16:SIGUSR2", "SIGUSR2 after batch 16 of epoch 1"), *stops]
    for stop_at, where in stops:
        out = run_min_ddp(tmp_path, *flags, stop_at=stop_at)
        assert f"stopped by {where}; saved to {tmp_path / 'snap.pt'}" in out.stdout, out.stdout + out.stderr
        assert out.returncode == CODES[where.split()[0]], out.stderr
        assert "Traceback" not in out.stderr and "failed" not in out.stderr, out.stderr
        assert not (tmp_path / "model.pt").exists(), "a stopped run must not write the final model"
    out = run_min_ddp(tmp_path, *flags)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")
    assert done_line(out.stdout) == done, "the resumed run must report the uninterrupted run's metrics"


def test_stop_snapshot_records_the_position_samples_seen_and_every_ranks_rng(tmp_path):
    out = run_min_ddp(tmp_path, *FLAGS, "--snapshot", str(tmp_path / "snap.pt"), stop_at="1:7:SIGUSR1")
    assert out.returncode == 138, out.stderr
    state = distributed.load_checkpoint(tmp_path / "snap.pt")
    assert (state["epoch"], state["batches"], state["samples_seen"]) == (0, 7, 7 * 512 * 2)
    assert len(state["rng"]) == 2 and state["stats"].shape == (2, 3)


def test_mid_epoch_resume_with_another_world_size_or_batch_is_a_clear_error(tmp_path):
    """The rest of an epoch is split over the ranks as it began; at an epoch's end either may change."""
    snap = str(tmp_path / "snap.pt")
    out = run_min_ddp(tmp_path, *FLAGS, "--snapshot", snap, stop_at="0:3:SIGTERM")
    assert out.returncode == 143, out.stderr
    other = [*FLAGS, "--snapshot", snap]
    other[other.index("--nprocs") + 1], other[other.index("--batch-size") + 1] = "1", "1024"
    out = run_min_ddp(tmp_path, *other)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert ("inside epoch 1, which must end as it began): the process count: 2 there, 1 here; --batch-size: "
            "512 there, 1024 here. Use its settings") in out.stderr, out.stderr


def test_without_snapshot_a_stop_still_ends_every_rank_at_one_step(tmp_path):
    out = run_min_ddp(tmp_path, *FLAGS, stop_at="1:2:SIGUSR2")
    assert out.returncode == 140, out.stderr
    assert "stopped by SIGUSR2 after batch 2 of epoch 1; not saved (no --snapshot)" in out.stdout


def test_signal_to_the_launcher_is_forwarded_and_workers_save_before_it_dies_of_it(uninterrupted, tmp_path):
    """`kill -TERM <launcher>`: the workers get it, stop at a step and save; then the launcher dies of
    SIGTERM (143), reporting no failure; the rerun finishes bitwise equal."""
    model, done = uninterrupted
    flags = [*FLAGS, "--snapshot", str(tmp_path / "snap.pt"), "--save-model", str(tmp_path / "model.pt")]
    (tmp_path / "driver.py").write_text(DRIVER.format(repo=HERE))
    code, out, err = signal_once_printed([sys.executable, str(tmp_path / "driver.py"), *flags, "--log-every", "1"],
                                         tmp_path, "[global] epoch 1 step 1/16", lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == -signal.SIGTERM, err
    assert "stopped by SIGTERM" in out and "Traceback" not in err and "failed" not in err, err
    assert run_min_ddp(tmp_path, *flags).returncode == 0
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


def signal_once_printed(command: list[str], cwd: Path, line: str, send: Callable[[int], None],
                        timeout: float = 60) -> tuple[int, str, str]:
    """Run ``command``; once it prints ``line``, ``send(its pid)``; then (exit code, stdout, stderr)."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert line in wait_for_line(proc, line), f"{command} never printed {line!r}"
        send(proc.pid)
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line or not line:
            return line
    raise TimeoutError(f"no line with {text!r} within {timeout} s")


SLOW_SAVE = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, {repo!r})
    import torch
    import distributed

    def worker(local_rank, world_size, path):
        distributed.init_process_group(local_rank, world_size)
        distributed.save_checkpoint({{"version": 1}}, path)
        distributed.stop_requested()  # the handlers are in place before the test signals
        print("saved version 1", flush=True)
        while not distributed.stop_requested():
            time.sleep(0.05)
        save = torch.save
        torch.save = lambda *a, **k: (save(*a, **k), time.sleep(60))  # a save slower than the grace
        distributed.save_checkpoint({{"version": 2}}, path)

    if __name__ == "__main__":
        distributed.launch(worker, sys.argv[1], nprocs=2, grace=1.0)
''')


def test_save_slower_than_the_launchers_grace_leaves_the_previous_snapshot_whole(tmp_path):
    script, path = tmp_path / "slow.py", tmp_path / "snap.pt"
    script.write_text(SLOW_SAVE.format(repo=HERE))
    code, out, err = signal_once_printed([sys.executable, str(script), str(path)], tmp_path, "saved version 1",
                                         lambda pid: os.kill(pid, signal.SIGUSR1), timeout=30)  # grace 1 s, save 60 s
    assert code == -signal.SIGUSR1, err
    assert distributed.load_checkpoint(path) == {"version": 1}


@pytest.mark.skipif(not shutil.which("torchrun"), reason="torchrun is not on PATH")
def test_torchrun_agent_sigterm_reaches_the_workers_which_save_before_its_30_s(uninterrupted, tmp_path):
    model, done = uninterrupted
    snap = tmp_path / "snap.pt"
    flags = [*FLAGS[2:], "--snapshot", str(snap), "--save-model", str(tmp_path / "model.pt")]
    (tmp_path / "driver.py").write_text(DRIVER.format(repo=HERE))
    code, out, err = signal_once_printed(["torchrun", "--standalone", "--nproc_per_node=2", str(tmp_path / "driver.py"),
                                          *flags, "--log-every", "1"], tmp_path, "[global] epoch 1 step 2/16",
                                         lambda pid: os.kill(pid, signal.SIGTERM))
    assert "stopped by SIGTERM" in out, out + err
    assert distributed.load_checkpoint(snap)["batches"] > 0
    out = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", str(tmp_path / "driver.py"), *flags],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


def test_dataloader_workers_survive_a_signal_to_the_whole_process_group(uninterrupted, tmp_path):
    """SLURM and shells signal every process of the job: with --workers 2 the loader workers must
    not die of it before the ranks finish their step and save."""
    model, done = uninterrupted
    flags = [*FLAGS, "--workers", "2", "--snapshot", str(tmp_path / "snap.pt"),
             "--save-model", str(tmp_path / "model.pt")]
    (tmp_path / "driver.py").write_text(DRIVER.format(repo=HERE))
    code, out, err = signal_once_printed([sys.executable, str(tmp_path / "driver.py"), *flags, "--log-every", "1"],
                                         tmp_path, "[global] epoch 1 step 2/16", lambda pid: os.killpg(pid, signal.SIGUSR1))
    assert "stopped by SIGUSR1" in out and "Traceback" not in err, err
    assert run_min_ddp(tmp_path, *flags).returncode == 0
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


# --- On the real local SLURM (bash .ci/slurm up) -------------------------------------------------
SBATCH = textwrap.dedent('''\
    #!/bin/bash
    #SBATCH --ntasks=2 --cpus-per-task=1 --requeue --open-mode=append
    srun --kill-on-bad-exit=1 {python} driver.py {flags}
''')


def sbatch(tmp_path: Path, *options: str, slow_first_run: float) -> str:
    """Submit min_ddp as a 2-task batch job that may be requeued; its id."""
    flags = [*FLAGS[2:], "--snapshot", "snap.pt", "--save-model", "model.pt", "--log-every", "1"]
    (tmp_path / "driver.py").write_text(DRIVER.format(repo=HERE))
    (tmp_path / "job.sbatch").write_text(SBATCH.format(python=sys.executable, flags=" ".join(flags)))
    out = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", "--output=slurm.out", *options,
                          str(tmp_path / "job.sbatch")], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "SLOW_FIRST_RUN": str(slow_first_run)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def wait_for_job(job: str, timeout: float = 240) -> dict[str, str]:
    """Wait until SLURM no longer lists the job (a requeued job is listed while it waits); its fields."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            raise TimeoutError(f"job {job} still listed after {timeout} s")
        time.sleep(1)
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def test_sbatch_signal_before_the_time_limit_saves_requeues_once_and_resumes_bitwise(slurm, uninterrupted,
                                                                                     tmp_path):
    """`--time=2 --signal=USR1@50 --requeue`: slurmctld checks every 30 s and signals at its first check
    with at most 50 + 30 s left, so USR1 reaches the srun step 40 to 70 s into the run (with --time=1 it
    came at once, before min_ddp had installed its handlers, and killed it); every rank saves, the
    primary requeues the job, and the rerun resumes and finishes with the uninterrupted run's model."""
    model, done = uninterrupted
    info = wait_for_job(sbatch(tmp_path, "--time=2", "--signal=USR1@50", slow_first_run=3))  # 96 s of steps
    log = (tmp_path / "slurm.out").read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log
    assert log.count("; saved to snap.pt; requeued") == 1 and "stopped by SIGUSR1 after batch" in log, log
    assert "resumed from snap.pt" in log and "Traceback" not in log, log
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")
    assert done_line(log) == done


def test_scancel_saves_and_is_not_requeued(slurm, uninterrupted, tmp_path):
    """`scancel JOB` is SIGTERM to every task: they save and the job ends CANCELLED, never requeued
    (although it was submitted with --requeue); the same command resumes it bitwise."""
    model, done = uninterrupted
    job = sbatch(tmp_path, slow_first_run=0.5)
    log, deadline = tmp_path / "slurm.out", time.monotonic() + 120
    while "[global] epoch 1 step 2/16" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"job {job} never reached step 2"
        time.sleep(0.2)
    subprocess.run(["scancel", job], check=True, timeout=30)
    info = wait_for_job(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log.read_text()
    assert "stopped by SIGTERM after batch" in log.read_text() and "requeued" not in log.read_text()
    rerun = ["srun", "-n", "2", "-c", "1", sys.executable, "driver.py", *FLAGS[2:], "--snapshot", "snap.pt",
             "--save-model", "model.pt"]
    out = subprocess.run(rerun, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "resumed from snap.pt" in out.stdout, out.stderr
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "model.pt"), model, "final model")


def test_without_scontrol_a_due_requeue_is_named_and_exits_75_for_requeue_exit(slurm, tmp_path):
    """In a container without scontrol the requeue cannot be asked for: min_ddp says so and every rank
    exits 75 (EX_TEMPFAIL), the code slurm.conf's RequeueExit=75 requeues on."""
    (tmp_path / "driver.py").write_text(DRIVER.format(repo=HERE))
    env = {**os.environ, "STOP_AT": "1:3:SIGUSR1", "PATH": str(Path(sys.executable).parent)}  # no scontrol
    out = subprocess.run([shutil.which("srun"), "-n", "2", "-c", "1", sys.executable, "driver.py", *FLAGS[2:],
                          "--snapshot", "snap.pt"], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 75, out.stderr
    assert "stopped by SIGUSR1 after batch 3 of epoch 1; saved to snap.pt; could not requeue" in out.stdout
    assert re.search(r"requeue: scontrol is not on PATH here, so job \d+ is not requeued", out.stderr), out.stderr


# --- The sampler that starts mid-epoch ---------------------------------------------------------
@settings(max_examples=examples(10), deadline=None)
@given(n=st.integers(1, 40), world=st.sampled_from([1, 2]), shuffle=st.booleans(), pad=st.booleans(),
       seed=st.integers(0, 3), epoch=st.integers(0, 3), batch=st.integers(1, 5), data=st.data())
def test_set_epoch_skip_continues_the_same_order_and_never_loads_the_skipped(pools, n, world, shuffle, pad, seed,
                                                                                epoch, batch, data):
    share = -(-n // world) if pad else n // world  # the smallest rank's share
    skip = data.draw(st.integers(0, share), label="skip")
    spec = {"n": n, "shuffle": shuffle, "pad": pad, "seed": seed, "epoch": epoch, "skip": skip, "batch": batch}
    if pad and n < world:
        return  # data_sampler refuses it (tested elsewhere)
    for rank, got in enumerate(pools.run(world, task_sampler_skip, spec)):
        assert got["resumed"] == got["whole"][skip:], f"rank {rank}: not the rest of the same order"
        assert got["len"] == len(got["whole"]) - skip
        assert got["loaded"] == got["resumed"], f"rank {rank}: loaded {got['loaded']}, a skipped sample among them"
        assert got["next_len"] == len(got["whole"]), "the next set_epoch must start whole"


def test_set_epoch_skip_beyond_this_ranks_share_is_an_error_naming_it():
    sampler = distributed.data_sampler(list(range(10)), True, shuffle=True)
    with pytest.raises(ValueError, match=r"skip must be between 0 and this rank's share of 10 samples, got: 11"):
        sampler.set_epoch(0, skip=11)
