"""forked_python.py: a process the suite forks from a torch-importing server looks, to the script it runs, as a fresh
`python script.py` does: the same probe run both ways prints the same, exits the same and fails the same."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import forked_python
from harness import HERE, SCRIPTS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="forked_python.py forks on Linux only")]

PROBE = '''
import multiprocessing.spawn, os, signal, sys, tempfile
import torch
print("argv", sys.argv, sys.orig_argv[1:])
print("path", sys.path[:4])
print("file", __file__, __name__, __spec__)
print("cwd", os.getcwd(), tempfile.gettempdir())
print("env", os.environ.get("PROBE"), os.environ.get("PYTHONPATH"))
print("sigint", signal.getsignal(signal.SIGINT), "own session", os.getsid(0) == os.getpid())
print("spawn main", multiprocessing.spawn.get_preparation_data("x").get("init_main_from_path"))
print("stdin", sys.stdin.read())
print("float64" if torch.get_default_dtype() == torch.float64 else "float32", torch.get_num_threads(), flush=True)
how = sys.argv[1]
if how == "raise":
    def inner():
        raise ValueError("from the probe")
    inner()
elif how == "exit":
    sys.exit(3)
elif how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
'''


def both_ways(tmp_path: Path, how: str, env: dict, own_session: bool, runner: tuple = (sys.executable,)) -> tuple:
    """(fresh, forked) results of the probe run by ``runner``: (exit code, stdout, stderr) each."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    environ = {**os.environ, "PROBE": how, **env}
    command = [*runner, str(script), how]
    results = []
    fresh = subprocess.Popen(command, cwd=tmp_path, env=environ, text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=own_session,
                             preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if own_session else None)
    out, err = fresh.communicate("typed in", timeout=60)
    results.append((fresh.returncode, out, err))
    forked = None
    for _ in range(2):  # a server starts at the second request for its start-up environment
        forked = forked_python.start(command, str(tmp_path), environ, own_session, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if forked is not None:
            break
    assert isinstance(forked, forked_python.ForkedProcess), "the second request was not forked"
    out, err = forked.communicate("typed in", timeout=60)
    results.append((forked.returncode, out, err))
    return tuple(results)


@pytest.mark.parametrize("how, code", [("ok", 0), ("exit", 3), ("raise", 1), ("kill", -signal.SIGKILL)])
def test_a_forked_script_prints_exits_and_fails_as_a_fresh_one(tmp_path, how, code):
    """argv, sys.path, __file__/__name__, working and temporary directories, environment, SIGINT's handler, the
    main script multiprocessing's children would import, stdin: printed alike; sys.exit's code, an uncaught
    exception's traceback (the script's frames only) and a death by signal: alike."""
    fresh, forked = both_ways(tmp_path, how, {}, own_session=False)
    assert forked == fresh
    assert fresh[0] == code


def test_a_forked_script_in_its_own_session_with_the_hooks_is_as_a_fresh_one(tmp_path):
    """own_session (a session of its own, SIGINT's default handler); min_ddp's hooks on PYTHONPATH (FLOAT64=1: their
    sitecustomize sets float64 before the script runs); OMP_NUM_THREADS, read as torch loads (a server of its own)."""
    hooks = str(SCRIPTS / "min_ddp_hooks")
    env = {"PYTHONPATH": os.pathsep.join([hooks, HERE, os.environ["PYTHONPATH"]]), "FLOAT64": "1",
           "OMP_NUM_THREADS": "1"}
    fresh, forked = both_ways(tmp_path, "ok", env, own_session=True)
    assert forked == fresh
    assert "float64 1" in fresh[1] and "own session True" in fresh[1], fresh


def test_another_sitecustomize_or_a_shorter_path_starts_fresh(tmp_path):
    """A sitecustomize other than the hooks (the no-numpy one hides numpy from `import torch`), a PYTHONPATH without
    the server's entries, or `python -c`: no fork can be what a fresh interpreter is; start() says None, asked twice."""
    (tmp_path / "sitecustomize.py").write_text("")
    command = [sys.executable, str(tmp_path / "probe.py")]
    for env in ({"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])}, {"PYTHONPATH": ""}):
        for _ in range(2):
            assert forked_python.start(command, str(tmp_path), {**os.environ, **env}, False) is None, env
    for _ in range(2):
        assert forked_python.start([sys.executable, "-c", "pass"], str(tmp_path), dict(os.environ), False) is None


def test_torchrun_forked_runs_and_fails_its_worker_as_a_fresh_one(tmp_path):
    """`torchrun` comes forked as `python -m torch.distributed.run`: its worker (the probe, a fresh process either
    way) prints the same, and its sys.exit(3) ends the run alike, torchrun's exit code 1 (stderr holds the run's
    random ids and ports: not compared)."""
    fresh, forked = both_ways(tmp_path, "exit", {}, own_session=False,
                              runner=("torchrun", "--standalone", "--nproc_per_node=1"))
    assert forked[:2] == fresh[:2]
    assert fresh[0] == 1 and "argv" in fresh[1], fresh


def test_a_server_started_past_1024_descriptors_still_forks(tmp_path):
    """A long run's pytest worker can hold over 1,024 descriptors when it starts a server for a new start-up
    environment: the server's sockets then have numbers select() refuses ("filedescriptor out of range", seen as a
    test's setup error). It waits with a selector: the script runs and exits as it would."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open descriptors is {hard}: cannot hold 1,100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        script = tmp_path / "hello.py"
        script.write_text("print('hello from past 1024')\n")
        environ = {**os.environ, "PYTHONHASHSEED": "1024"}  # a start-up environment of its own: a new server
        forked = None
        for _ in range(2):  # a server starts at the second request for its start-up environment
            forked = forked_python.start([sys.executable, str(script)], str(tmp_path), environ, False,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            if forked is not None:
                break
        assert isinstance(forked, forked_python.ForkedProcess), "the second request was not forked"
        out, err = forked.communicate(timeout=60)
        assert (forked.returncode, out) == (0, "hello from past 1024\n"), err
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
