"""A warm start for the `python -m orchestrator[.MODULE]` processes the tests start (test infrastructure).

Why: a study's process spends about 3 CPU-s importing MLflow (3.17 imports its GenAI modules, pandas and
FastAPI from `import mlflow`), SciPy, Hydra and matplotlib before its first line runs, and the suite and
the fault campaign start some two hundred of them on CI's two cores (docs/testing.md).

What: one process per test process, the "zygote" (`python tests/warm.py SOCKET`), imports those libraries
once and then forks a child per request. The child becomes the command it is asked for: argv, working
directory, environment, standard streams (their file descriptors are passed over the socket), a session
of its own if asked, then it runs the module with runpy as `python -m` does, and ends as the command ends
(the orchestrator's own end: run/fast_exit.py). The pid a test holds is the orchestrator's own: signals, the
lease's holder, pid files and `ps` read as they do with exec. Its parent is the zygote, which reaps it
and sends the exit status back.

What differs from exec, and when it runs cold instead (`subprocess.Popen`):
- the interpreter started, and the libraries were imported, under the zygote's environment: a request
  whose environment differs in a variable read at start-up or import (`IMPORT_TIME_ENV`), or that uses a
  Popen option not listed in `WARM_OPTIONS`, runs cold;
- exit handlers the preloaded libraries registered at import would run after the orchestrator's fast
  exit, so never (MLflow's ends a fluent run, which the orchestrator never starts; paramiko's joins its
  threads, which the fast exit ends anyway);
- /proc/PID/environ shows the zygote's start-up environment (the process's own, and what it starts, is
  the request's), and a traceback printed with the whole stack (Hydra's) starts at the zygote's frame;
- `HEISENHUNT_TEST_COLD=1` runs every one cold. The tests of the command's own start (its help, the
  wheel, a terminal under pexpect, the README's commands) always start it cold.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "orchestrator"  # `python -m` of it or of one of its modules
# what a study's process imports that costs (measured with `python -X importtime`): the libraries, and the
# orchestrator's own modules that import them, but not `orchestrator.__main__`, which runpy runs anew
PRELOAD = (
    "mlflow",
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "scipy.stats",
    "matplotlib.pyplot",
    "hydra",
    "omegaconf",
    "paramiko",
    "aiohttp",
    "rich",
    "orchestrator.arm",
    "orchestrator.config.load",
    "orchestrator.config.plan",
    "orchestrator.tracking.read",
    "orchestrator.tracking.write",
    "orchestrator.report.pipeline",
    "orchestrator.report.console",
    "orchestrator.remote",
    "orchestrator.run.pool",
    "hydra_plugins.heisenhunt_sweeper.study_sweeper",
    # the sim's roles and the real router in front of them, as tests/sim/simkit.py starts them
    "orchestrator.sim.server",
    "orchestrator.sim.router",
)
# read when the interpreter starts or a preloaded library is imported (PYTHONUNBUFFERED is not: the
# child's standard streams are built for the request's); the orchestrator sets MLFLOW_CONFIGURE_LOGGING
# before it imports MLflow, so the zygote does too
IMPORT_TIME_ENV = ("PYTHON", "MLFLOW_", "AIOHTTP_", "NUMPY_", "OPENBLAS_", "OMP_", "MKL_", "MPL", "LD_")
# ... but for these, which the library reads at each use, never at import (MLflow's HTTP retries:
# mlflow/utils/rest_utils.py and store/artifact/http_artifact_repo.py read them per request; the team-server
# tests set them, and ran cold for it)
READ_AT_USE_ENV = ("MLFLOW_HTTP_REQUEST_",)
ZYGOTE_DEFAULTS = {"MLFLOW_CONFIGURE_LOGGING": "false"}
WARM_OPTIONS = frozenset(
    {
        "cwd",
        "env",
        "stdin",
        "stdout",
        "stderr",
        "text",
        "universal_newlines",
        "start_new_session",
        "process_group",
    }
)
COLD_ENV = "HEISENHUNT_TEST_COLD"


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment a started interpreter has already read."""
    env = {**ZYGOTE_DEFAULTS, **env}
    return {
        k: v
        for k, v in env.items()
        if k.startswith(IMPORT_TIME_ENV) and not k.startswith(READ_AT_USE_ENV) and k != "PYTHONUNBUFFERED"
    }


def cold_reason(argv: Sequence[str], options: Mapping[str, Any], zygote_env: Mapping[str, str]) -> str | None:
    """Why this command must start cold, or None when a fork of the zygote runs it as exec would."""
    if os.environ.get(COLD_ENV, "").strip() not in ("", "0"):
        return f"{COLD_ENV} is set"
    if len(argv) < 3 or list(argv[:2]) != [sys.executable, "-m"] or argv[2].split(".")[0] != PACKAGE:
        return f"not `python -m {PACKAGE}[.MODULE]` on this interpreter"
    extra = set(options) - WARM_OPTIONS
    if extra:
        return f"Popen options {sorted(extra)}"
    env = options.get("env")
    if import_time_env(os.environ if env is None else env) != import_time_env(zygote_env):
        return "its environment differs in a variable read at start-up"
    return None


# --- the zygote ---------------------------------------------------------------------------------------


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _die_with_parent() -> None:
    """The zygote ends with the test process that started it (Linux's parent-death signal)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve(path: str) -> None:
    _die_with_parent()
    os.environ.update({k: v for k, v in ZYGOTE_DEFAULTS.items() if k not in os.environ})
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the path appears once the zygote can fork: a client waits for it
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                _fork_one(listener, selector)
            else:  # a child's pidfd: it ended
                pid, conn = key.data
                selector.unregister(key.fileobj)
                os.close(key.fd)
                _, status, usage = os.wait4(pid, 0)
                # its CPU and that of what it reaped: a cold start's parent would count it (tests/conftest.py)
                cpu = usage.ru_utime + usage.ru_stime
                with contextlib.suppress(OSError):
                    _send(conn, {"status": status, "cpu_s": cpu})
                conn.close()


def _fork_one(listener: socket.socket, selector: selectors.BaseSelector) -> None:
    conn, _ = listener.accept()
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        while not data.endswith(b"\n"):  # a long environment arrives in pieces
            more = conn.recv(1 << 16)
            if not more:
                raise EOFError("the request ended early")
            data += more
        request = json.loads(data)
    except (OSError, ValueError, EOFError):
        conn.close()
        return
    set_up_r, set_up_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # the child keeps none of the zygote's sockets or pidfds, nor its siblings' connections
        for key in list(selector.get_map().values()):
            with contextlib.suppress(OSError):
                os.close(key.fd)
            if key.data is not None:
                key.data[1].close()
        selector.close()
        conn.close()
        os.close(set_up_r)
        _become(request, fds, set_up_w)  # never returns
    os.close(set_up_w)
    for fd in fds:
        os.close(fd)
    # as Popen returns once the child has exec'd: the pid once the child is the command (its directory,
    # session, streams), or the error that stopped it (a missing directory: Popen's FileNotFoundError)
    failed = b""
    while chunk := os.read(set_up_r, 4096):
        failed += chunk
    os.close(set_up_r)
    if failed:
        errno, _, message = failed.decode().partition("\0")
        _send(conn, {"errno": int(errno), "error": message})
        os.waitpid(pid, 0)
        conn.close()
        return
    _send(conn, {"pid": pid})
    selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))


def _standard_streams(unbuffered: bool) -> tuple[IO[str], IO[str], IO[str]]:
    """sys.stdin, stdout and stderr as the interpreter builds them at start (a terminal's output is line
    buffered, stderr always; PYTHONUNBUFFERED writes through), on the request's descriptors 0-2."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors

    def stream(fd: int, write: bool) -> IO[str]:
        raw = io.FileIO(fd, "w" if write else "r", closefd=False)
        buffered = raw if (write and unbuffered) else (io.BufferedWriter if write else io.BufferedReader)(raw)
        line = write and not unbuffered and (fd == 2 or os.isatty(fd))
        return io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else errors,
            line_buffering=line,
            write_through=write and unbuffered,
        )

    return stream(0, False), stream(1, True), stream(2, True)


def _set_up(request: dict, fds: list[int]) -> None:
    """The child becomes the process Popen would have started: its session or group, standard streams,
    directory, environment, argv and title."""
    if request["new_session"]:
        os.setsid()
    if request["process_group"] is not None:
        os.setpgid(0, request["process_group"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    with contextlib.suppress(ImportError):
        # `ps` shows the command, not the zygote's (set before the environment changes: setproctitle
        # takes the memory of the process's first argv and environment for the title)
        import setproctitle

        setproctitle.setproctitle(" ".join(request["argv"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin, sys.stdout, sys.stderr = _standard_streams(bool(request["env"].get("PYTHONUNBUFFERED")))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = [request["argv"][0], *request["argv"][3:]]
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _become(request: dict, fds: list[int], set_up: int) -> None:
    try:
        _set_up(request, fds)
    except OSError as e:
        os.write(set_up, f"{e.errno or 0}\0{e}".encode())
        os._exit(255)
    os.close(set_up)
    code = 1
    try:
        # what `python -m` runs, in a __main__ module of its own (not the zygote's), the module itself not
        # imported yet (as from a shell: runpy would warn of a module preloaded here)
        module = request["argv"][2]
        sys.modules["__main__"] = types.ModuleType("__main__")
        if not hasattr(sys.modules.get(module), "__path__"):  # (a package runs its __main__, never preloaded)
            sys.modules.pop(module, None)
        runpy._run_module_as_main(module)  # type: ignore[attr-defined]
        code = 0
    except SystemExit as e:
        from orchestrator.run.fast_exit import exit_code

        code = exit_code(e.code)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        # as the interpreter prints it: from `python -m`'s own frames on, not this function's
        sys.excepthook(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
    finally:
        # the interpreter's own end: threads joined, exit handlers (the orchestrator's fast exit ends the
        # process there), streams flushed
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


# --- the client ---------------------------------------------------------------------------------------


class Zygote:
    """This process's zygote, started at its first use; stopped when this process ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dir = ""  # its socket and log, made when it starts
        self.env = {**os.environ, **ZYGOTE_DEFAULTS}

    @property
    def path(self) -> str:
        return os.path.join(self._dir, "sock")

    def ready(self, timeout: float = 60.0) -> bool:
        with self._lock:
            if self._proc is None:
                self._dir = tempfile.mkdtemp(prefix="hh-zygote-")
                self._proc = subprocess.Popen(
                    # run as a script: its sys.path[0] is tests/, so the package is imported from where
                    # the installation says, as a cold `python -m orchestrator` from any directory does
                    [sys.executable, __file__, self.path],
                    cwd=REPO,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=open(os.path.join(self._dir, "zygote.log"), "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                )
                atexit.register(self.stop)
            deadline = time.monotonic() + timeout
            while not os.path.exists(self.path):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            return True

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


_ZYGOTE: Zygote | None = None
_CPU = [0.0]  # CPU seconds of the warm children that ended, and of what they reaped
_CPU_LOCK = threading.Lock()


def _count_cpu(seconds: float) -> None:
    with _CPU_LOCK:
        _CPU[0] += seconds


def children_cpu_s() -> float:
    """CPU seconds of this process's warm children that have ended (and of the processes they reaped):
    what RUSAGE_CHILDREN counts of a cold start, which the zygote reaps here instead."""
    with _CPU_LOCK:
        return _CPU[0]


_ZYGOTE_LOCK = threading.Lock()  # the campaign's episodes ask from several threads at once


def zygote() -> Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None:
            _ZYGOTE = Zygote()
        return _ZYGOTE


def _fd(value: Any, default: int, stack: contextlib.ExitStack) -> int:
    """The descriptor a Popen stream argument names (None: this process's own)."""
    if value is None:
        return default
    if value == subprocess.DEVNULL:
        return stack.enter_context(_closing_fd(os.open(os.devnull, os.O_RDWR)))
    if isinstance(value, int):
        return value
    return value.fileno()


@contextlib.contextmanager
def _closing_fd(fd: int):
    try:
        yield fd
    finally:
        os.close(fd)


def _reply(conn: socket.socket, timeout: float | None) -> bytes | None:
    """The zygote's next line (its replies are short, one at a time), b"" if it closed, None if none came
    within `timeout`."""
    line = b""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([conn], [], [], left)
        if not ready:
            if line:  # a reply half read is finished however long it takes
                deadline = None
                continue
            return None
        chunk = conn.recv(1)
        if not chunk:
            return b""
        line += chunk
    return line


class WarmProcess:
    """What `subprocess.Popen` gives for a forked orchestrator: pid, the stdout and stderr pipes, poll,
    wait, communicate, send_signal, terminate, kill, returncode (negative: the signal that ended it)."""

    def __init__(
        self, argv: Sequence[str], conn: socket.socket, pid: int, stdout: IO | None, stderr: IO | None
    ) -> None:
        self.args = list(argv)
        self.pid = pid
        self.stdin = None
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._conn = conn
        self._lock = threading.Lock()
        self._readers: dict[str, tuple[threading.Thread, list]] = {}

    def _status(self, timeout: float | None) -> int | None:
        """The exit status once the zygote has sent it; waits up to `timeout` (None: for ever) without
        holding the lock, so that another thread's poll() is never held up by a wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self.returncode is not None:
                    return self.returncode
                line = _reply(self._conn, 0.0)
                if line is not None:
                    # the zygote gone (killed with the test run) without a word: the child's end is unknown
                    reply = json.loads(line) if line else {}
                    status = reply.get("status")
                    _count_cpu(reply.get("cpu_s", 0.0))
                    self.returncode = (
                        os.waitstatus_to_exitcode(status) if status is not None else -signal.SIGKILL
                    )
                    self._conn.close()
                    return self.returncode
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile by another thread's read
                select.select([self._conn], [], [], 0.2 if left is None else min(left, 0.2))

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Both pipes read to their end (a thread each, kept across a timeout, as Popen keeps what it
        read), then the exit status."""
        assert input is None, "a warm orchestrator takes no input"
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                got: list = []
                reader = threading.Thread(target=lambda s=stream, g=got: g.append(s.read()), daemon=True)
                reader.start()
                self._readers[name] = (reader, got)
        for reader, _ in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = []
        for name in ("stdout", "stderr"):
            stream, read = getattr(self, name), self._readers.get(name)
            out.append(read[1][0] if read and read[1] else None)
            if stream is not None:
                stream.close()
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may be another process's now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(argv: Sequence[str], **options: Any) -> subprocess.Popen | WarmProcess:
    """`subprocess.Popen(argv, **options)`, forked from a warm zygote where that runs it as exec would
    (module doc), else started cold."""
    z = zygote()
    if cold_reason(argv, options, z.env) is not None or not z.ready():
        return subprocess.Popen(argv, **options)
    ours: dict[str, int] = {}  # the read ends of the pipes asked for
    with contextlib.ExitStack() as stack:
        fds = []
        for name, default in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
            value = options.get(name)
            if value == subprocess.PIPE and name != "stdin":
                read_end, write_end = os.pipe()
                ours[name] = read_end
                fds.append(stack.enter_context(_closing_fd(write_end)))
            elif value == subprocess.STDOUT and name == "stderr":
                fds.append(fds[1])
            else:
                fds.append(_fd(value, default, stack))
        request = {
            "argv": list(argv),
            "cwd": os.fspath(options.get("cwd") or os.getcwd()),
            "env": dict(os.environ if options.get("env") is None else options["env"]),
            "new_session": bool(options.get("start_new_session")),
            "process_group": options.get("process_group"),
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(z.path)
            data = json.dumps(request).encode() + b"\n"
            sent = socket.send_fds(conn, [data[: 1 << 16]], fds)
            conn.sendall(data[sent:])
            reply = json.loads(_reply(conn, 30.0) or b"")
        except (OSError, ValueError):  # no zygote to answer: cold
            reply = None
        if reply is None or "pid" not in reply:
            conn.close()
            for fd in ours.values():
                os.close(fd)
            if reply is not None:  # the child could not become the command: as Popen raises it
                raise OSError(reply["errno"], reply["error"])
            return subprocess.Popen(argv, **options)
        pid = reply["pid"]
    mode = "r" if options.get("text") or options.get("universal_newlines") else "rb"
    streams = {name: open(fd, mode) for name, fd in ours.items()}  # noqa: SIM115
    return WarmProcess(argv, conn, pid, streams.get("stdout"), streams.get("stderr"))


def run(argv: Sequence[str], timeout: float | None = None, capture_output: bool = False, **options: Any):
    """`subprocess.run` over `popen`: a CompletedProcess (the child killed at the timeout, as run does)."""
    if capture_output:
        options["stdout"] = options["stderr"] = subprocess.PIPE
    proc = popen(argv, **options)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
