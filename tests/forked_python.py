"""Python processes forked from one that has imported torch already: how the suite starts most of its launchers.

`python script.py` spends 1-2 CPU-s in `import torch` before the script's first line, and the suite starts a few
hundred such processes on two cores. So a pytest process starts a server (this file, run as a script) for each
start-up environment it asks for twice; the server imports torch once and forks each process asked of it, as
launch()'s forkserver forks its ranks. The child sets up what a fresh `python script.py` (or `python -m module`;
`torchrun` is `python -m torch.distributed.run`, its agent forked, its workers fresh as always) would have: argv,
sys.path, working directory, environment, stdin/stdout/stderr, a session of its own where asked; imports min_ddp's
hooks (a sitecustomize) where its PYTHONPATH names them; and runs the script as __main__, an uncaught exception
printed from the script's frames on. The server relays its exit code; start() returns a Popen-like ForkedProcess.
Measured: 0.2-0.4 CPU-s a process instead of 1.3-1.6 (bench/BENCHMARKS.md).

Where a child could not be what a fresh interpreter is, harness.start() starts a fresh one: a start-up setting
(PYTHON*, TORCH*, OMP_*, locale, TMPDIR...) other than the server's; a sitecustomize other than the hooks (the
no-numpy tests' hides numpy from `import torch`); a torch whose import warns (no numpy installed: a forked child
would not print it). Different all the same: /proc shows the server's command line and first environment for the
child itself, not its own (what the child starts shows its own); it shares the server's hash seed; torchrun's usage
and argument errors name it run.py; and torch's own objects are frozen out of its garbage collections, as in
launch()'s ranks.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

# What Python, torch and OpenMP read when a process starts: a request whose value differs starts fresh. Not
# torch._dynamo's and torch._inductor's settings: `import torch` loads neither (the server checks), so they read
# the child's. (torch._inductor sets TORCHINDUCTOR_CACHE_DIR in the pytest process once it is loaded there.)
STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_", "GOMP_", "LD_", "MALLOC", "CUDA",
                    "LC_", "LANG", "TMPDIR", "TEMP", "TMP")
LOADED_IN_THE_CHILD = ("TORCHDYNAMO_", "TORCHINDUCTOR_")
HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_scripts", "min_ddp_hooks")
WARM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_scripts", "warm_forkserver")


# ---------------------------------------------------------------------------------------------
# The test's side
# ---------------------------------------------------------------------------------------------


def start(command: list[str], cwd: str, environ: dict[str, str], own_session: bool,
          **popen: Any) -> ForkedProcess | None:
    """``command`` forked from the server, or None where it must start as a fresh interpreter (see above)."""
    asked = [os.fspath(part) for part in command]
    command = _as_python(asked)
    if not _can_fork(command, environ, popen):
        return None
    server = _servers().get(_startup(environ))
    if server is None:
        return None
    files = {name: popen.get(name) for name in ("stdin", "stdout", "stderr")}
    ends = {}  # this process's ends of the pipes
    fds = []
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        target = files[name]
        if target == subprocess.PIPE:
            read, write = os.pipe()
            ends[name], theirs = (write, read) if name == "stdin" else (read, write)
            fds.append(theirs)
        elif target == subprocess.DEVNULL:
            fds.append(os.open(os.devnull, os.O_RDWR))
        elif target is None:
            fds.append(os.dup(number))
        else:
            fds.append(os.dup(target if isinstance(target, int) else target.fileno()))
    mine, status = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = json.dumps({"argv": command, "cwd": os.path.abspath(cwd), "env": environ, "own_session": own_session})
    try:
        with server.lock:
            socket.send_fds(server.control, [request.encode()], [*fds, status.fileno()])
    finally:
        for fd in fds:
            os.close(fd)
        status.close()
    return ForkedProcess(asked, mine, ends)


class ForkedProcess:
    """A process the server forked, as subprocess.Popen(text=True) shows one: args, pid, stdin, stdout, stderr,
    returncode, poll(), wait(), communicate(), send_signal(), terminate(), kill()."""

    def __init__(self, args: list[str], status: socket.socket, ends: dict[str, int]):
        self.args, self._status, self.returncode = args, status, None
        # Text files over this process's ends of the pipes, as Popen(text=True) makes them (open as long as it is).
        encoding = locale.getpreferredencoding(False)
        self.stdin, self.stdout, self.stderr = (
            open(ends[name], mode, encoding=encoding) if name in ends else None  # noqa: SIM115
            for name, mode in (("stdin", "w"), ("stdout", "r"), ("stderr", "r")))
        self._read: dict[str, list] | None = None  # what communicate() has read: stdout's and stderr's pieces
        self._readers: list[threading.Thread] = []
        reply = status.recv(64)
        if not reply:
            raise RuntimeError(f"forked_python's server did not start {args}")
        self.pid = int(reply)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._status.settimeout(timeout)
            try:
                reply = self._status.recv(64)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not reply:
                raise RuntimeError(f"forked_python's server ended before {self.args} did")
            self.returncode = int(reply)
            self._status.close()
        return self.returncode

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str | None, str | None]:
        """As Popen's: ``input`` to stdin, which is then closed; all of stdout and stderr once it exits. Callable
        again after TimeoutExpired (after a kill, say)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._read is None:
            self._read = {}
            if self.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    if input:
                        self.stdin.write(input)
                    self.stdin.close()
            for name in ("stdout", "stderr"):
                if getattr(self, name) is not None:
                    self._read[name] = []
                    reader = threading.Thread(target=_read_all, args=(getattr(self, name).buffer, self._read[name]),
                                              daemon=True)
                    reader.start()
                    self._readers.append(reader)
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._text("stdout"), self._text("stderr")

    def _text(self, name: str) -> str | None:
        if self._read is None or name not in self._read:
            return None
        text = b"".join(self._read[name]).decode(locale.getpreferredencoding(False))
        return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as Popen(text=True)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not a pid the system may have handed to another process since
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read_all(stream: Any, into: list) -> None:
    while chunk := stream.read1(65536):
        into.append(chunk)


class _Server:
    def __init__(self, startup: tuple):
        """The server for processes that start with these settings (_startup()); else this process's environment,
        without what a request adds (a test's marker in the server's would make it one of that test's processes)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        environ = {name: value for name, value in os.environ.items() if not name.startswith(STARTUP_PREFIXES)}
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                        env={**environ, **dict(startup)}, pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.control, self.lock = mine, threading.Lock()
        self.serving = mine.recv(64) == b"ready"  # not where its torch warned at import, or it failed

    def close(self) -> None:
        self.control.close()  # its end reads EOF: it exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


class _Servers:
    """This pytest process's servers, one per start-up environment (the pytest process's own changes: min_ddp.py
    imported here sets PYTHONWARNINGS), each started at the second request for it: one seen once stays fresh."""

    def __init__(self):
        self._servers: dict[tuple, _Server] = {}
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> _Server | None:
        with self._lock:
            if key not in self._seen:
                self._seen.add(key)
                return None
            if key not in self._servers:
                self._servers[key] = _Server(key)
                atexit.register(self._servers[key].close)
            server = self._servers[key]
        return server if server.serving else None


@functools.cache
def _servers() -> _Servers:
    return _Servers()


def _startup(environ: dict[str, str]) -> tuple:
    """What of ``environ`` a process reads as it starts; of PYTHONPATH, this process's (what a request adds to)."""
    read = [(name, value) for name, value in environ.items() if name.startswith(STARTUP_PREFIXES)
            and not name.startswith(LOADED_IN_THE_CHILD) and name != "PYTHONPATH"]
    return (*sorted(read), ("PYTHONPATH", os.environ.get("PYTHONPATH", "")))


def _as_python(command: list[str]) -> list[str]:
    """`torchrun ...` as `python -m torch.distributed.run ...`, which torch documents as the same program (its
    console script imports that module's main and calls it), where that script is the one beside this Python."""
    if command[:1] == ["torchrun"] and os.path.isfile(os.path.join(os.path.dirname(sys.executable), "torchrun")):
        return [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    return command


def _can_fork(command: list[str], environ: dict[str, str], popen: dict) -> bool:
    if sys.platform != "linux":  # the suite's other platforms start every process fresh
        return False
    if len(command) < 2 or command[0] != sys.executable or set(popen) - {"stdin", "stdout", "stderr"}:
        return False
    if command[1] == "-m":
        if len(command) < 3:
            return False
    elif command[1].startswith("-") or not command[1].endswith(".py"):
        return False
    added = _added_path(environ.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", ""))
    if added is None:
        return False
    customized = [entry for entry in added if os.path.isfile(os.path.join(entry, "sitecustomize.py"))]
    return customized in ([], [HOOKS], [WARM])  # WARM acts in a forkserver only, never in a forked script


def _added_path(path: str, server_path: str) -> list[str] | None:
    """The entries ``path`` puts before the server's PYTHONPATH, or None if it does not end with it."""
    entries, theirs = path.split(os.pathsep) if path else [], server_path.split(os.pathsep) if server_path else []
    if entries[len(entries) - len(theirs):] != theirs:
        return None
    return entries[:len(entries) - len(theirs)]


# ---------------------------------------------------------------------------------------------
# The server's side
# ---------------------------------------------------------------------------------------------


def _serve(control: socket.socket) -> dict | None:
    """Fork a child for each request on ``control``, then send its pid and later its exit code on the status socket
    that came with the request. Returns the request in each child; None in the server when the test's side closes
    ``control``."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that a child's exit writes to wake_write
    children: dict[int, socket.socket] = {}
    # A selector, not select(): the descriptors come from a pytest worker that may hold over 1,024 of them.
    waiting = selectors.DefaultSelector()
    waiting.register(control, selectors.EVENT_READ)
    waiting.register(wake_read, selectors.EVENT_READ)
    while True:
        ready = [key.fileobj for key, _ in waiting.select()]
        if wake_read in ready:
            os.read(wake_read, 4096)
        while children:  # reap every child that has exited
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            with contextlib.suppress(OSError):
                children[pid].send(str(os.waitstatus_to_exitcode(status)).encode())
            children.pop(pid).close()
        if control not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
        if not message:  # the pytest process has ended: so does what it started here
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return None
        request = json.loads(message)
        stdio, status = fds[:3], socket.socket(fileno=fds[3])
        # Python >= 3.12 warns of a fork with threads running (`import torch` starts one), as it would at
        # launch()'s forkserver: the child runs no code of that thread.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for sock in (control, *children.values()):
                sock.close()
            os.close(wake_read)
            os.close(wake_write)
            status.close()
            for number, fd in enumerate(stdio):
                os.dup2(fd, number)
                os.close(fd)
            return request
        for fd in stdio:
            os.close(fd)
        status.send(str(pid).encode())
        children[pid] = status


def _become(request: dict) -> dict:
    """In the forked child: what `python script.py ARGS` (or `python -m module ARGS`) would have set up; then run it."""
    import multiprocessing.process
    import runpy
    import site
    import tempfile

    argv, cwd = request["argv"], request["cwd"]
    if request["own_session"]:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter sets it over SIG_DFL
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None
    multiprocessing.process.ORIGINAL_DIR = cwd  # what spawn and forkserver children find the script by
    multiprocessing.process.current_process().authkey = os.urandom(32)
    added = _added_path(os.environ.get("PYTHONPATH", ""), SERVER_PYTHONPATH)
    if argv[1] == "-m":
        first = cwd
    else:
        first = os.path.dirname(os.path.realpath(argv[1]))
    sys.path[:] = [*added, *sys.path[1:]]
    site.removeduppaths()  # as at start, before the script's directory goes first
    sys.path.insert(0, first)
    sys.argv, sys.orig_argv = argv[1:] if argv[1] != "-m" else argv[2:], argv
    sys.excepthook = _script_frames_only
    if HOOKS in added:
        import sitecustomize  # noqa: F401 (what Python imports at start when PYTHONPATH has it)
    if argv[1] == "-m":
        return runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return runpy.run_path(os.path.abspath(argv[1]), run_name="__main__")


def _script_frames_only(kind: type, value: BaseException, tb: Any) -> None:
    """An uncaught exception's traceback from the script's frames on, as a fresh interpreter prints it."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    sys.__excepthook__(kind, value.with_traceback(tb), tb)  # Python prints the exception's own traceback


if __name__ == "__main__":
    SERVER_PYTHONPATH = os.environ.get("PYTHONPATH", "")
    _control = socket.socket(fileno=int(sys.argv[1]))
    with warnings.catch_warnings(record=True) as _warned:  # what `import torch` would print, filtered as usual
        import torch  # noqa: F401 (what every child would otherwise import itself)
    # A warning (no numpy installed) each fresh `import torch` would print and a forked child would not; or
    # torch._dynamo loaded, whose settings a child's environment could no longer change: serve nothing.
    if _warned or "torch._dynamo" in sys.modules or "torch._inductor" in sys.modules:
        sys.exit(0)
    gc.freeze()  # torch's objects live as long as each child: no collection of a child need scan them
    _control.send(b"ready")
    _request = _serve(_control)
    if _request is not None:
        del _control, _warned
        # What the script left, kept to this process's end as a fresh interpreter keeps its __main__'s.
        _script_globals = _become(_request)
