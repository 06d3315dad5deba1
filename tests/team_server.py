"""A team's MLflow tracking server for tests: a real PostgreSQL (Debian's packages, `initdb` + `pg_ctl` on
loopback, a data dir of its own) and a real `mlflow server` over it, its artifact store on a path of its
own (`--artifacts-destination`: clients upload through the server, as on a shared host). Started and
stopped by the fixtures in tests/test_team_server.py; the server can be restarted on the same port, over
the same database, mid-study.

Both take a while to start on a 2-core machine (the first MLflow start migrates the schema), so each start
is timed (tests/services.py): `.ci/run` prints the times.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.services import record_service_start

# MLflow's server also starts job consumers (its GenAI jobs) that poll for work: none needed here
SERVER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}


def postgres_bin() -> Path | None:
    """The newest PostgreSQL server binaries Debian installed (postgresql-NN), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as Debian's `postgres` user."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextlib.contextmanager
def postgres(port: int) -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1:`port` with an empty database `mlflow`; yields its SQLAlchemy URI.
    Its data dir is made under /tmp (the `postgres` user cannot enter pytest's tmp_path) and removed."""
    bin_dir = postgres_bin()
    assert bin_dir is not None, "PostgreSQL is not installed (apt-get install postgresql)"
    root = Path(tempfile.mkdtemp(prefix="hh-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, log = root / "data", root / "postgres.log"
    began = time.monotonic()
    run = lambda *argv: subprocess.run(_as_postgres([str(a) for a in argv]), check=True, capture_output=True)  # noqa: E731
    try:
        run(bin_dir / "initdb", "-D", data, "-U", "heisenhunt", "--auth=trust", "-E", "UTF8")
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        run(bin_dir / "pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "-o", options, "start")
        run(bin_dir / "createdb", "-h", "127.0.0.1", "-p", port, "-U", "heisenhunt", "mlflow")
        record_service_start("postgresql", time.monotonic() - began)
        yield f"postgresql+psycopg2://heisenhunt@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class MlflowServer:
    """`mlflow server` over `backend` on 127.0.0.1:`port`, in a process group of its own (its uvicorn
    workers go with it); `stop` and `start` again keep the port and the stores."""

    backend: str
    artifacts: Path
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> None:
        argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend]
        argv += [
            "--artifacts-destination",
            str(self.artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            # one uvicorn worker (4 by default, each importing MLflow's server: seconds of CPU on a
            # 2-core CI machine at every start); it serves requests concurrently all the same
            "--workers",
            "1",
        ]
        began = time.monotonic()
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ | SERVER_ENV,
                start_new_session=True,
            )
        _wait_until(
            self.healthy, timeout, lambda: f"mlflow server did not come up:\n{self.log.read_text()[-3000:]}"
        )
        self.starts.append(time.monotonic() - began)
        record_service_start("mlflow server", self.starts[-1])

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Down at once (SIGKILL: a crash, not a shutdown), the whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=30)


def _wait_until(ready: Callable[[], bool], timeout: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(why())
        time.sleep(0.3)


@contextlib.contextmanager
def team_server(root: Path, free_port: Callable[[], int]) -> Iterator[MlflowServer]:
    """PostgreSQL and an `mlflow server` over it, both on free loopback ports; stopped at the end."""
    with postgres(free_port()) as backend:
        server = MlflowServer(backend, root / "artifacts", free_port(), root / "mlflow-server.log")
        try:
            server.start()
            yield server
        finally:
            server.stop(signal.SIGTERM)
