"""A user's own iteration loop on a Checkpointer, as nanoGPT writes it (rank_scripts/own_loop.py): no epochs, no
sampler, per-rank random batches, a Generator and a tensor of the user's in `state`. Stops and resumes bitwise,
at its own cadence whatever a step takes, refuses another global batch, gives new ranks random states of their
own, finishes once, and bounds what a hard kill loses.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch


import checkpointer
import distributed
from harness import SCRIPTS, assert_bitwise_equal, at_once, signal_once_printed, start, warm_ranks


OWN_LOOP = SCRIPTS / "own_loop.py"


def start_own_loop(tmp_path: Path, snapshot: str, out: str, *flags: str) -> subprocess.Popen:
    return start([sys.executable, str(OWN_LOOP), str(tmp_path / snapshot), str(tmp_path / out), *flags], tmp_path,
                 env=warm_ranks())


def own_loop(tmp_path: Path, snapshot: str, out: str, *flags: str) -> subprocess.CompletedProcess:
    return at_once([start_own_loop(tmp_path, snapshot, out, *flags)], timeout=120)[0]


@pytest.fixture(scope="module")
def stopped_at_12(tmp_path_factory) -> Path:
    """An uninterrupted run (straight.pt) and a snapshot of the same loop stopped after 12 steps (snap.pt)."""
    tmp = tmp_path_factory.mktemp("own-loop")
    straight, stopped = at_once([start_own_loop(tmp, "never.pt", "straight.pt"),
                                 start_own_loop(tmp, "snap.pt", "unused.pt", "--stop", "12", "--check-every", "1")])
    assert straight.returncode == 0, straight.stderr
    assert stopped.returncode == 138, stopped.stderr
    assert "stopped by SIGUSR1 after 12 steps; saved to" in stopped.stdout, stopped.stdout
    return tmp


@pytest.fixture(scope="module")
def resumed(stopped_at_12) -> dict[int, tuple[subprocess.CompletedProcess, Path]]:
    """The snapshot resumed at world 2 x 16 and at 4 x 8 (the same global batch), each from a copy, at once."""
    started = {}
    for world, batch in ((2, 16), (4, 8)):
        directory = stopped_at_12 / f"world{world}"
        directory.mkdir()
        (directory / "snap.pt").write_bytes((stopped_at_12 / "snap.pt").read_bytes())
        started[world] = (start_own_loop(directory, "snap.pt", "resumed.pt", "--nprocs", str(world), "--batch",
                                         str(batch)), directory)
    results = at_once([proc for proc, _ in started.values()])
    return {world: (result, directory)
            for (world, (_, directory)), result in zip(started.items(), results, strict=True)}


@pytest.mark.slow
def test_own_iteration_loop_stops_resumes_bitwise_then_finishes_once(stopped_at_12, resumed):
    """The model, AdamW's state, each rank's generator (its next random batch), and the user's state (the best
    loss, a sum, the LR scheduler's position, a Generator, and a tensor the loop updates through its own name,
    restored in place) come back: bitwise the uninterrupted run. The finished snapshot says so: the same
    command run again (a requeue after the end) trains no step."""
    result, directory = resumed[2]
    assert result.returncode == 0, result.stderr
    assert f"resumed from {directory / 'snap.pt'} after 12 steps (saved at world size 2)" in result.stdout
    assert "trained 18 iterations" in result.stdout
    expected = distributed.load_checkpoint(stopped_at_12 / "straight.pt")
    assert_bitwise_equal(distributed.load_checkpoint(directory / "resumed.pt"), expected, "final model and state")
    again = own_loop(directory, "snap.pt", "again.pt")
    assert again.returncode == 0 and "after 30 steps" in again.stdout and "trained 0 iterations" in again.stdout, \
        again.stdout


@pytest.mark.slow
def test_own_loop_resumed_at_4_gives_every_rank_its_own_batches(resumed):
    """Resumed at world 4 with the same global batch (4 x 8 = 2 x 16): ranks 0 and 1 keep their generators, and
    ranks 2 and 3 get states of their own from the snapshot and their rank, never rank 0's (every rank drawing
    rank 0's batches would train on one batch 4 times)."""
    result, _ = resumed[4]
    assert result.returncode == 0, result.stderr
    first = re.search(r"first batches: (.*)", result.stdout).group(1).split()
    assert len(set(first)) == 4, result.stdout


def test_an_iteration_loop_resumed_at_another_global_batch_is_refused(tmp_path, stop_signals_restored):
    """Stopped at 2 x 16 (a snapshot of global batch 32), resumed at 1 x 16: half the global batch, which the
    loop would take silently. The Checkpointer knows it from batch_size= (an iteration loop must give it)."""
    ckpt = checkpointer.Checkpointer(tmp_path / "snap.pt", torch.nn.Linear(2, 1), batch_size=32)
    ckpt.step()
    ckpt.save()  # one process of 32: the global batch of 2 x 16
    with pytest.raises(ValueError, match=r"with a global batch \(batch size x grad_accum x processes\) of 32 "
                                         r"samples, and this run's is 16: .*at 1 process\(es\), batch size x "
                                         r"grad_accum = 32 per process"):
        checkpointer.Checkpointer(tmp_path / "snap.pt", torch.nn.Linear(2, 1), batch_size=16)


@pytest.mark.slow
def test_slow_steps_at_the_default_cadence_stop_and_save_within_the_grace(tmp_path):
    """Steps of 0.3 s and check_every left alone: the ranks time their steps and check about once a second, so
    SIGTERM to the launcher at iteration 5 stops them a few steps later, saved. Before, the check came every 100
    steps (30 s here): the launcher SIGKILLed the ranks after its grace, unsaved, and exited as a clean stop."""
    command = [sys.executable, str(OWN_LOOP), str(tmp_path / "snap.pt"), str(tmp_path / "out.pt"), "--sleep", "0.3",
               "--iters", "200"]
    code, out, err, _ = signal_once_printed(command, tmp_path, "iteration 5",
                                            lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == -signal.SIGTERM, err
    stopped = int(re.search(r"stopped by SIGTERM after (\d+) steps?; saved to", out).group(1))
    assert 5 <= stopped <= 12, out
    assert distributed.load_checkpoint(tmp_path / "snap.pt")["steps"] == stopped


@pytest.mark.slow
def test_a_hard_kill_loses_at_most_the_save_interval(tmp_path):
    """An iteration loop saves every save_interval seconds by itself (default 30 min; 1 s here, steps of 0.05 s):
    SIGKILL to the whole job after 40 iterations leaves a snapshot at most about a second old, and the same
    command resumes from it. Before, an iteration loop saved nothing until it stopped."""
    command = [sys.executable, str(OWN_LOOP), str(tmp_path / "snap.pt"), str(tmp_path / "out.pt"), "--sleep", "0.05",
               "--iters", "1000", "--save-interval", "1"]
    code, out, err, _ = signal_once_printed(command, tmp_path, "iteration 40",
                                            lambda pid: os.killpg(pid, signal.SIGKILL))
    assert code == -signal.SIGKILL
    saved = distributed.load_checkpoint(tmp_path / "snap.pt")["steps"]
    assert 10 <= saved <= 40, saved
    resumed = own_loop(tmp_path, "snap.pt", "out.pt", "--iters", str(saved + 2))
    assert resumed.returncode == 0 and f"after {saved} step" in resumed.stdout, resumed.stderr
