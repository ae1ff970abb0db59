"""Snapshots that never lose work: atomic save, weights-only load, bitwise resume, restarts.

Resume tests run min_ddp.py as a command (rank_scripts/min_ddp_driver.py; the mid-epoch stops are in
test_stop.py); the restart test uses real torchrun with --max-restarts; the crash test kills a real
saving process with SIGKILL at 100 random points.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distributed
from harness import (MIN_DDP, assert_bitwise_equal, build_model, cannot_run, run, run_min_ddp, task_save_ddp_state,
                     task_save_expecting_error)


EPOCHS = 3
SETTINGS = {"FLOAT64": "1", "TRAIN_SIZE": "2048"}  # float64: a resume at another world size compares to 1e-9


def train(tmp_path: Path, world: int, epochs: int, *flags: str) -> subprocess.CompletedProcess:
    """min_ddp as a command; the same global batch (128) at every world size."""
    out = run_min_ddp(tmp_path, "--nprocs", str(world), "--log-every", "100000", "--seed", "5", "--epochs",
                      str(epochs), "--batch-size", str(128 // world), *flags, **SETTINGS)
    assert out.returncode == 0, out.stderr
    return out


# ---------------------------------------------------------------------------------------------
# 1. Exact resume
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """World 2 trained straight through EPOCHS epochs: the snapshot of its end."""
    tmp = tmp_path_factory.mktemp("straight")
    train(tmp, 2, EPOCHS, "--snapshot", str(tmp / "straight.pt"))
    return distributed.load_checkpoint(tmp / "straight.pt")


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> Path:
    """The same run stopped after its first epoch (the snapshot at its end): each test resumes a copy."""
    tmp = tmp_path_factory.mktemp("one-epoch")
    train(tmp, 2, 1, "--snapshot", str(tmp / "snap.pt"))
    return tmp / "snap.pt"


@pytest.mark.slow
def test_stop_at_an_epochs_end_and_resume_equals_training_straight_through(straight, one_epoch, tmp_path):
    path = shutil.copy(one_epoch, tmp_path / "stopped.pt")
    assert distributed.load_checkpoint(path)["epoch"] == 1
    out = train(tmp_path, 2, EPOCHS, "--snapshot", str(path))
    assert f"resumed from {path} after 1 epoch (saved at world size 2)" in out.stdout
    resumed = distributed.load_checkpoint(path)
    assert_bitwise_equal(resumed["model"], straight["model"], "model")
    assert_bitwise_equal(resumed["optimizer"], straight["optimizer"], "optimizer")
    assert resumed["epoch"] == EPOCHS and resumed["optimizer"]["state"], "momentum buffers are saved"


def task_chunked_save(spec: dict) -> dict:
    """A Checkpointer saves per-rank state larger than the gather's chunk, and a fresh one resumes it. The ranks'
    tensors differ, and rank 1's is longer, so the two byte streams end in different chunks; every 16-MB chunk
    boundary falls inside a tensor, and the last chunk is partial. The model's Adam state also exceeds a chunk."""
    import checkpointer
    rank, path = distributed.get_rank(), spec["path"]
    stop_handlers = {signum: signal.getsignal(signum) for signum in distributed.STOP_SIGNALS}
    try:  # a Checkpointer records stop signals: the pool's worker gets its own handlers back after
        big = torch.randn(spec["floats"] + 1001 * rank, generator=torch.Generator().manual_seed(100 + rank))
        torch.manual_seed(0)  # the same model on both ranks, as DDP would make it
        model = torch.nn.Linear(2048, 2048)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 2048)).sum().backward()
        optimizer.step()
        checkpointer.Checkpointer(path, model, optimizer, batch_size=1,
                                  state={"big": big.clone(), "small": torch.tensor([rank])}).save()
        state = {"big": torch.zeros_like(big), "small": torch.tensor([-1])}
        resumed_model = torch.nn.Linear(2048, 2048)
        resumed = torch.optim.Adam(resumed_model.parameters())
        checkpointer.Checkpointer(path, resumed_model, resumed, batch_size=1, state=state)
        return {"big": torch.equal(state["big"], big), "small": state["small"].item(),
                "sum": big.double().sum().item(), "model": torch.equal(resumed_model.weight, model.weight),
                "adam": all(torch.equal(resumed.state_dict()["state"][0][k], optimizer.state_dict()["state"][0][k])
                            for k in ("exp_avg", "exp_avg_sq"))}
    finally:
        for signum, handler in stop_handlers.items():
            signal.signal(signum, handler)


def test_per_rank_state_beyond_one_gather_chunk_resumes_bitwise(pools, tmp_path):
    """2 ranks, each with about 40 MB of its own state (three 16-MB chunks, the last partial, boundaries inside
    the tensor, the ranks' streams of different lengths) and a model whose Adam state exceeds a chunk: saved
    and resumed at the same world size, every rank gets its own state back bitwise, and the weights too."""
    import checkpointer
    floats = 10 << 20  # 40 MB of float32
    assert 2 * checkpointer._CHUNK < 4 * floats < 3 * checkpointer._CHUNK, "the sizes no longer span 3 chunks"
    results = pools.run(2, task_chunked_save, {"path": str(tmp_path / "snap.pt"), "floats": floats}, timeout=120)
    for rank, found in enumerate(results):
        assert found["big"], f"rank {rank}'s 40-MB state did not come back bitwise"
        assert found["small"] == rank, f"rank {rank} got rank {found['small']}'s state"
        assert found["model"] and found["adam"], f"rank {rank}: the weights or Adam's state differ"
    assert results[0]["sum"] != results[1]["sum"], "the ranks' states must differ for the test to mean anything"


def task_load_memory(spec: dict) -> dict:
    """load_checkpoint of a large snapshot on every rank: this rank's anonymous memory (RssAnon) above what it held
    before, at its peak during the load (polled every millisecond) and after reading every value."""
    import threading

    def anonymous_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024

    before, peak, loading = anonymous_mb(), [0.0], threading.Event()

    def poll() -> None:
        while not loading.is_set():
            peak[0] = max(peak[0], anonymous_mb())
            time.sleep(0.001)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        state = distributed.load_checkpoint(spec["path"], map_location="cpu")
        total = state["weights"].sum().item()  # every page read
    finally:
        loading.set()
        poller.join()
    return {"peak": peak[0] - before, "after": anonymous_mb() - before, "sum": total}


@pytest.mark.slow
def test_ranks_resuming_a_large_snapshot_share_its_pages(pools, tmp_path):
    """2 ranks load a 1 GB snapshot: each rank's anonymous memory stays under a quarter of it, because both map
    the file's pages instead of each holding a private copy (8 ranks of a 48-GB snapshot would need 384 GB).
    Before (no mmap), each rank held about 1024 MB."""
    path = tmp_path / "snap.pt"
    torch.save({"weights": torch.ones(256 << 20)}, path)  # 1 GiB of float32
    for rank, found in enumerate(pools.run(2, task_load_memory, {"path": str(path)}, timeout=120)):
        assert found["sum"] == 256 << 20
        assert found["peak"] < 256 and found["after"] < 256, f"rank {rank}: {found} MB of anonymous memory"


@pytest.mark.slow
def test_snapshot_from_two_processes_resumes_on_one_with_the_same_global_batch(straight, one_epoch, tmp_path):
    """2 x 64 -> 1 x 128 continues the same run, not bitwise (the reduction order changes): float64, to
    the suite's rtol = atol = 1e-9 (float32 drifts ~1e-4 over 3 epochs)."""
    path = shutil.copy(one_epoch, tmp_path / "moved.pt")
    train(tmp_path, 1, EPOCHS, "--snapshot", str(path))
    moved = distributed.load_checkpoint(path)
    for key, tensor in straight["model"].items():
        torch.testing.assert_close(moved["model"][key], tensor, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_resume_that_changes_the_run_is_refused_naming_each_setting(one_epoch, tmp_path):
    """A resume with another seed, lr or dataset would silently train another run; one line, no traceback."""
    path = shutil.copy(one_epoch, tmp_path / "snap.pt")
    refused = run_min_ddp(tmp_path, "--nprocs", "1", "--epochs", "2", "--seed", "6", "--lr", "0.5", "--snapshot",
                          str(path), **{**SETTINGS, "TRAIN_SIZE": "1024"})
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip() == (f"min_ddp: the snapshot {path} belongs to another run: --seed: 5 there, 6 here; "
                                      "--lr: 0.01 there, 0.5 here; --train-size: 2048 there, 1024 here. Continue it "
                                      "with its settings, or use another path. "
                                      "May change on resume: anything else (epochs, logging, loader workers...), and "
                                      "the processes and batch size per process (mid-epoch keeping the global batch)")
    # At an epoch's end these may change, the global batch included.
    train(tmp_path, 1, 2, "--batch-size", "32", "--log-every", "7", "--timeout", "60", "--snapshot", str(path))


@pytest.mark.slow
def test_snapshot_of_another_model_is_a_clear_error(one_epoch, tmp_path):
    path = shutil.copy(one_epoch, tmp_path / "other.pt")
    state = distributed.load_checkpoint(path)
    state["model"] = {"weight": torch.zeros(3, 3)}
    distributed.save_checkpoint(state, path)
    out = run_min_ddp(tmp_path, "--epochs", "2", "--seed", "5", "--snapshot", str(path), **SETTINGS)
    assert out.returncode == 1 and "holds another model or optimizer than this script builds" in out.stderr, out.stderr


def test_snapshot_loads_into_a_plain_model_without_wrapper_prefixes(pools, tmp_path):
    path = tmp_path / "ddp.pt"
    pools.run(2, task_save_ddp_state, {"path": str(path)})
    state = distributed.load_checkpoint(path)
    assert not any(k.startswith("module.") for k in state["model"])
    build_model("mlp", 4, 0).load_state_dict(state["model"])  # strict: every key matches

    compiled = torch.compile(build_model("mlp", 4, 0))
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    distributed.save_checkpoint({"model": compiled.state_dict()}, path)
    build_model("mlp", 4, 0).load_state_dict(distributed.load_checkpoint(path)["model"])
    assert distributed.unwrap(compiled) is compiled._orig_mod


# ---------------------------------------------------------------------------------------------
# 2. Fault-tolerant restart under torchrun
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_snapshot_bitwise(straight, tmp_path):
    """Rank 1 dies (os._exit) in epoch 2 of torchrun's first attempt; the restart resumes after epoch 1."""
    flags = ["--log-every", "50", "--seed", "5", "--epochs", str(EPOCHS), "--batch-size", "64",
             "--snapshot", str(tmp_path / "snap.pt")]
    out = run(["torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=1", str(MIN_DDP), *flags], tmp_path,
              {**SETTINGS, "CRASH_AT": "1:20"}, timeout=300)  # rank 1 after step 20: epoch 2
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "after 1 epoch" in out.stdout, "the restart must resume"
    assert "CRASH_AT: rank 1 exits with 17 after step 20" in out.stderr, "the injected fault must have happened"
    assert_bitwise_equal(distributed.load_checkpoint(tmp_path / "snap.pt")["model"], straight["model"], "model")


# ---------------------------------------------------------------------------------------------
# 3. A crash during save leaves the old file or the new one
# ---------------------------------------------------------------------------------------------


def versioned_state(version: int) -> dict:
    return {"version": version, "payload": torch.full((4 * 1024 * 1024,), float(version))}  # 16 MB


def save_in_child(state: dict, path: Path) -> int:
    pid = os.fork()
    if pid == 0:  # the child: save, then leave without running the parent's cleanup
        try:
            distributed.save_checkpoint(state, path)
        finally:
            os._exit(0)
    return pid


def wait_for(pid: int, timeout: float = 60) -> None:
    """waitpid with a deadline: a child stuck after fork fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the saving child did not finish within {timeout} s")
        time.sleep(0.005)


@pytest.mark.slow
def test_sigkill_at_100_random_points_during_save_never_corrupts_the_snapshot(tmp_path):
    """A child saving a 16 MB snapshot over the last one is SIGKILLed 100 times at a random moment: the file
    always loads, as the old version or the new one, never a mix."""
    path = tmp_path / "snap.pt"
    distributed.save_checkpoint(versioned_state(0), path)
    started = time.perf_counter()
    wait_for(save_in_child(versioned_state(1), path))
    window = 1.2 * (time.perf_counter() - started)  # from the start to past the rename, at first
    rng, current, outcomes = random.Random(0), 1, {"old": 0, "new": 0}
    for _ in range(100):
        pid = save_in_child(versioned_state(current + 1), path)
        time.sleep(rng.uniform(0, window))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        state = distributed.load_checkpoint(path)  # must always load
        assert state["version"] in (current, current + 1)
        assert torch.equal(state["payload"], torch.full_like(state["payload"], float(state["version"])))
        renamed = state["version"] == current + 1
        outcomes["new" if renamed else "old"] += 1
        # A kill after the rename shortens the window, one before lengthens it: the kills keep landing on both
        # sides of the rename however long a save takes now (a loaded machine once made 96 of 100 land after).
        window = window / 1.1 if renamed else window * 1.1
        current = state["version"]
    assert min(outcomes.values()) >= 5, f"kills should land both before and after the rename: {outcomes}"


# ---------------------------------------------------------------------------------------------
# 4. A crafted snapshot cannot run code
# ---------------------------------------------------------------------------------------------


class _Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_snapshot_whose_pickle_runs_code_is_refused(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"model": {}, "x": _Exploit(str(marker))}, path)
    with pytest.raises(Exception, match="refusing to load .*evil.pt"):
        distributed.load_checkpoint(path)
    assert not marker.exists(), "loading must not run the payload"
    # Control: the file really is an exploit when loaded the unsafe way.
    run([sys.executable, "-c", f"import torch; torch.load({str(path)!r}, weights_only=False)"])
    assert marker.exists()


def test_unloadable_state_is_refused_at_save_time(tmp_path):
    import argparse
    with pytest.raises(TypeError, match=r"state\['args'\] is a Namespace"):
        distributed.save_checkpoint({"args": argparse.Namespace(lr=1)}, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


# ---------------------------------------------------------------------------------------------
# 5. Corrupt files and disk errors: clear errors, nothing lost
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_snapshot_is_an_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "snap.pt"
    distributed.save_checkpoint(versioned_state(1), path)
    data = path.read_bytes()
    garbage = random.Random(0).randbytes(4096)  # fixed: a random first byte could be pickle's GLOBAL opcode
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": garbage, "empty": b""}[damage])
    with pytest.raises(RuntimeError, match=rf"(?s)cannot load the snapshot {re.escape(str(path))}: it is corrupt or "
                                           r"truncated \(.*\); restore a good copy or delete it to start fresh"):
        distributed.load_checkpoint(path)


@pytest.mark.slow
def test_two_jobs_saving_to_one_path_each_leave_a_whole_snapshot(tmp_path):
    """Two jobs given the same --snapshot: with one fixed PATH.tmp, one job's rename took the other's
    file away, and that save failed with "No such file or directory". Each save now has its own."""
    path, states, pids = tmp_path / "snap.pt", {1: versioned_state(1), 2: versioned_state(2)}, []
    for version in (1, 2):  # the states are built here: a parallel op in a forked child can hang
        pid = os.fork()
        if pid == 0:  # a child: ten saves, exit code 1 if any failed
            code = 1
            try:
                for _ in range(10):
                    distributed.save_checkpoint(states[version], path)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    deadline, codes = time.monotonic() + 120, {}
    while len(codes) < 2 and time.monotonic() < deadline:
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG) if pid not in codes else (0, 0)
            codes.update({pid: os.waitstatus_to_exitcode(status)} if done else {})
        time.sleep(0.01)
    for pid in set(pids) - set(codes):
        os.kill(pid, signal.SIGKILL)
    assert sorted(codes.values()) == [0, 0], codes
    state = distributed.load_checkpoint(path)
    assert state["version"] in (1, 2) and torch.equal(state["payload"], states[state["version"]]["payload"])
    assert list(tmp_path.glob("*.tmp")) == [], "a save left its temporary file behind"


def test_missing_snapshot_means_a_fresh_start(tmp_path):
    assert distributed.load_checkpoint(tmp_path / "nothing.pt") is None


def test_missing_parent_directory_is_a_clear_error(tmp_path):
    path = tmp_path / "no" / "such" / "snap.pt"
    with pytest.raises(OSError, match="cannot write the snapshot .*check the directory exists"):
        distributed.save_checkpoint({"x": torch.ones(1)}, path)


STRACE_UNAVAILABLE = cannot_run(["strace", "-f", "--seccomp-bpf", "-o", "/dev/null", "-e", "trace=fsync", "true"],
                                "strace cannot trace here")


# A save makes two fsync calls: the temporary file's, then the directory's after the rename. strace
# makes one of them fail as a filesystem would: EINVAL where a directory cannot be synced (an SMB share
# under WSL, vboxsf), EIO for a real I/O error.
@pytest.mark.slow
@pytest.mark.skipif(bool(STRACE_UNAVAILABLE), reason=str(STRACE_UNAVAILABLE))
@pytest.mark.parametrize("fails, error, saved", [("directory", "EINVAL", True), ("directory", "EIO", False),
                                                 ("file", "EINVAL", False)])
def test_unsyncable_directory_still_saves_other_sync_errors_fail(tmp_path, fails, error, saved):
    path = tmp_path / "snap.pt"
    distributed.save_checkpoint(versioned_state(1), path)
    save = f"import distributed, torch; distributed.save_checkpoint({{'version': 2}}, {str(path)!r})"
    inject = f"inject=fsync:error={error}:when={2 if fails == 'directory' else 1}"
    # --seccomp-bpf stops the process at fsync only: traced at every syscall, torch's import took 3x longer.
    out = run(["strace", "-f", "--seccomp-bpf", "-o", "/dev/null", "-e", "trace=fsync", "-e", inject, sys.executable,
               "-c", save], timeout=120)
    assert (out.returncode == 0) == saved, out.stderr
    assert saved or f"cannot write the snapshot ({os.strerror(getattr(errno, error))})" in out.stderr, out.stderr
    # Never a half-written file: the new snapshot once renamed (even if the directory's sync then
    # failed), else the previous one.
    assert distributed.load_checkpoint(path)["version"] == (1 if fails == "file" else 2)


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only file system (root ignores permission bits): a tmpfs remounted ro."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        run(["umount", "-l", str(mount)], timeout=30)


@pytest.mark.slow
def test_read_only_directory_keeps_the_previous_snapshot(read_only_dir, pools):
    path = read_only_dir / "snap.pt"
    distributed.save_checkpoint(versioned_state(1), path)
    run(["mount", "-o", "remount,ro", str(read_only_dir)], timeout=30, check=True)
    with pytest.raises(OSError, match="Read-only file system"):
        distributed.save_checkpoint(versioned_state(2), path)
    assert distributed.load_checkpoint(path)["version"] == 1
    # In a real job every rank gets the error; none waits forever for the primary.
    messages = pools.run(2, task_save_expecting_error, {"path": str(path)}, timeout=60)
    assert all("cannot write the snapshot" in m for m in messages), messages
    # min_ddp refuses such a path before training, not after hours of it.
    out = run([sys.executable, "min_ddp.py", "--snapshot", str(read_only_dir / "run.pt")])
    assert out.returncode == 2 and f"{read_only_dir} is missing or read-only" in out.stderr, out.stderr


def mapped_files() -> str:
    with open(f"/proc/{os.getpid()}/maps") as f:
        return f.read()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/maps")
def test_a_resume_keeps_no_tensor_of_the_snapshot_mapped(tmp_path, stop_signals_restored):
    """A resume maps the snapshot (its pages shared by the ranks of a node) but keeps nothing of it mapped past the
    restore: before, Adam's state (its step counts and moments, kept by load_state_dict as given) and the user's
    state pointed into the file, so the space of a snapshot the next save replaced stayed held (on NFS a hidden
    .nfs file of its size) for the rest of the run."""
    import checkpointer
    path = tmp_path / "run.pt"
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    state = {"ema": torch.zeros(64), "new": None}
    checkpointer.Checkpointer(path, model, optimizer, batch_size=1, state={"ema": torch.ones(64), "new": torch.ones(3)}
                              ).save()
    resumed = torch.optim.Adam(model.parameters())
    ckpt = checkpointer.Checkpointer(path, model, resumed, batch_size=1, state=state)
    assert resumed.state_dict()["state"][0]["step"].item() == 1 and state["new"].tolist() == [1.0] * 3
    assert str(path) not in mapped_files(), "a tensor of the snapshot is still mapped after the restore"
    ckpt.save()  # replaces the file: its old pages must be free to go
    assert str(path) not in mapped_files()
