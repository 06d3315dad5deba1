"""Shared fixtures: free loopback ports, Hydra compose of the shipped config with test-local paths."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import importlib.util
import os
import random
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from orchestrator.config.load import CONF_DIR, load_job
from orchestrator.config.plan import ArmPlan, plan_arm
from orchestrator.config.schema import JobConf
from tests import warm
from tests.repo_hygiene import (  # noqa: F401 - pytest hooks: a session that leaves a stray fails
    pytest_sessionfinish,
    pytest_sessionstart,
)
from tests.shared_runs import default_run, factorial_run  # noqa: F401 - fixtures: studies two files judge

_ISSUED: set[int] = set()
# Ports are drawn below Linux's ephemeral range (32768-60999), where the kernel never hands out the local
# port of an outgoing connection, and each pytest-xdist worker draws from its own slice of it, so two
# workers never pick the same free port before either has bound it.
_PORTS = range(10000, 32000)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_SLICE = len(_PORTS) // _WORKERS
_MINE = range(_PORTS.start + _WORKER * _SLICE, _PORTS.start + (_WORKER + 1) * _SLICE)


def report_json(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """report.json's content as `analysis.analyse(...)` gives it (`result.to_json`), for tests that read
    the report as the JSON it is written as."""
    from orchestrator.analysis import analyse
    from orchestrator.analysis.result import to_json

    return to_json(analyse(*args, **kwargs))


def sweep_logs(sweep_dir: Path) -> str:
    """Every log record of a sweep, as its log files keep them (the terminal shows the progress and the
    verdict; orchestrator/report/console.py): the sweep's own, then each job's."""
    files = [sweep_dir / "multirun.log", *sorted(sweep_dir.glob("*/__main__.log"))]
    return "".join(f.read_text() for f in files if f.is_file())


@contextlib.contextmanager
def cpu_hogs(per_cpu: int) -> Iterator[list[subprocess.Popen]]:
    """`per_cpu` busy loops pinned to each CPU this process may use; killed (by pid) on exit."""
    cpus = sorted(os.sched_getaffinity(0)) * per_cpu
    code = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code, str(cpu)]) for cpu in cpus]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(timeout=10)


def free_port() -> int:
    """A loopback port nothing listens on now, never the same one twice in a test session (in any of
    its workers): two servers of one deployment given the same port would answer each other's health
    checks."""
    while True:
        port = random.choice(_MINE)
        if port in _ISSUED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ISSUED.add(port)
        return port


# How long each test of more than a few seconds took in a whole run (wall seconds, beside the others):
# written from a run's timeline by `python scripts/test_timeline.py TIMELINE --write-durations FILE`
DURATIONS = Path(__file__).with_name("durations.tsv")
# a test the file does not know yet (a new one): a slow one is guessed long, any other short
_GUESS_S = {True: 20.0, False: 0.1}
_GROUP_SUFFIX = re.compile(r"@[^\]\[/]+$")  # pytest-xdist's `@group` after a grouped test's id


def plain_nodeid(nodeid: str) -> str:
    """A test's id without the `@group` pytest-xdist appends under --dist loadgroup."""
    return _GROUP_SUFFIX.sub("", nodeid)


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, nodeid = line.split("\t", 1)
            out[nodeid] = float(seconds)
    return out


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first (their durations in a recent run, tests/durations.tsv), so that the run
    ends with short ones on every worker: a long run left to the end would run alone while the other
    workers idle. The `alone` tests last: each waits for the tests running beside it to end, which at
    the end of the run are short ones."""
    order_items(items, read_durations())


def order_items(items: list, known: dict[str, float]) -> None:
    """Sorts `items` longest first by `known` (test id -> seconds; one it does not know: 20 s if slow,
    else short), `alone` ones last. A module kept on one worker (`xdist_group`) goes out as one unit,
    at the place of its first test (--dist loadgroup, --no-loadscope-reorder): its tests are placed by
    the whole group's time."""

    def group(item) -> str | None:
        mark = item.get_closest_marker("xdist_group")
        return None if mark is None else (mark.args[0] if mark.args else mark.kwargs.get("name", "default"))

    def seconds(item) -> float:
        guess = _GUESS_S[item.get_closest_marker("slow") is not None]
        return known.get(plain_nodeid(item.nodeid), guess)

    groups: dict[str, float] = {}
    for item in items:
        if (name := group(item)) is not None:
            groups[name] = groups.get(name, 0.0) + seconds(item)

    def key(item) -> tuple[bool, float]:
        name = group(item)
        expected = seconds(item) if name is None else groups[name]
        return item.get_closest_marker("alone") is not None, -expected

    items.sort(key=key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With HEISENHUNT_TEST_TIMELINE set, each test's worker, start and end (epoch seconds), CPU seconds
    and id, one line per test appended to that file: where a run's time went (scripts/test_timeline.py).
    The CPU is the test process's and that of the processes it waited for (an orchestrator it ran);
    servers started detached are reaped by others and not counted."""
    path = os.environ.get("HEISENHUNT_TEST_TIMELINE")
    started, cpu = time.time(), _cpu_s()
    yield
    # a test held at the gate before an `alone` one (machine_share) starts when the gate lets it in: the
    # wait is the worker's idle time, not the test's (tests/durations.tsv orders the next runs by it)
    started += getattr(item, "_gate_wait_s", 0.0)
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        with open(path, "a") as f:
            f.write(f"{worker}\t{started:.2f}\t{time.time():.2f}\t{_cpu_s() - cpu:.2f}\t{item.nodeid}\n")


def _cpu_s() -> float:
    """User and system CPU seconds of this process and its reaped children, the warm ones included (the
    zygote reaps those: tests/warm.py)."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + warm.children_cpu_s()


@contextlib.contextmanager
def machine_share(lock_dir: Path, alone: bool, patience_s: float = 120.0) -> Iterator[None]:
    """A readers-writer lock over the pytest-xdist workers of one run (flock on two files in `lock_dir`):
    any number of tests share the machine; an `alone` test waits until none runs, and none starts until
    it ends. Every test passes the gate; an `alone` one keeps it closed while it waits and runs, so the
    tests that keep starting on the other workers cannot hold it off for ever. An `alone` test that has
    waited `patience_s` runs anyway, with a warning: a process a test forked and left running holds that
    test's share (flock is per open file, and a fork shares it) for as long as it lives."""
    with open(lock_dir / "gate.lock", "a") as gate, open(lock_dir / "machine.lock", "a") as machine:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if alone:
            deadline = time.monotonic() + patience_s
            while not _try_flock(machine, fcntl.LOCK_EX):
                if time.monotonic() > deadline:
                    message = f"ran beside other tests: {lock_dir} stayed shared {patience_s} s"
                    warnings.warn(message, stacklevel=3)
                    break
                time.sleep(0.05)
        else:
            fcntl.flock(machine, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases both locks


def _try_flock(file, operation: int) -> bool:
    try:
        fcntl.flock(file, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@pytest.fixture(autouse=True)
def _share_the_machine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, an `alone` test runs with no other test beside it (`machine_share`). Autouse
    and function-scoped: set up before, and torn down after, the test's own servers."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # the workers' base temp dirs share one parent, made for this run
    asked = time.time()
    with machine_share(
        tmp_path_factory.getbasetemp().parent, request.node.get_closest_marker("alone") is not None
    ):
        request.node._gate_wait_s = time.time() - asked
        yield


def script_module(path: str, name: str) -> types.ModuleType:
    """A script of the repository (under bench/ or scripts/, which are no packages) imported as module
    `name` and registered in sys.modules, where its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_MIGRATING = threading.Lock()
# where the run's one migrated store lives: set by the first process of a run (the controller, under
# pytest-xdist, before its workers start) and inherited by its workers, which share the store in it
_TEMPLATE_DIR_ENV = "HEISENHUNT_TEST_MLFLOW_TEMPLATE_DIR"


def pytest_configure(config: pytest.Config) -> None:
    if _TEMPLATE_DIR_ENV not in os.environ:
        os.environ[_TEMPLATE_DIR_ENV] = tempfile.mkdtemp(prefix="hh-mlflow-template-")
        config.add_cleanup(functools.partial(shutil.rmtree, os.environ[_TEMPLATE_DIR_ENV], True))


def _migrated_store() -> Path:
    """One MLflow sqlite store per test run, created by MLflow itself (every schema migration run) in the
    first process that needs it; the others (pytest-xdist's workers) wait for it and share it."""
    with _MIGRATING:  # threads that ask at once (the campaign test's episodes) wait for the one migration
        return _migrate_once()


@functools.cache
def _migrate_once() -> Path:
    if _TEMPLATE_DIR_ENV in os.environ:
        folder = Path(os.environ[_TEMPLATE_DIR_ENV])
    else:  # a bench script's process, outside pytest: a store of its own, gone with it
        folder = Path(tempfile.mkdtemp(prefix="hh-mlflow-template-"))
        atexit.register(shutil.rmtree, folder, True)
    path = folder / "mlflow.db"
    with open(folder / "migrating.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one migration a run: the other workers wait for it
        if not path.exists():
            from mlflow import MlflowClient

            made = folder / f"mlflow-{os.getpid()}.db"
            MlflowClient(f"sqlite:///{made}").search_experiments()
            made.rename(path)  # whole or not there: a worker never copies a store half migrated
    return path


def seed_mlflow_store(path: Path) -> str:
    """A fresh MLflow sqlite store at `path` (unless one is there), copied from one MLflow migrated once
    per test run (`_migrate_once`); its URI. A store MLflow creates runs every schema migration first:
    about 2 s of CPU in each of the suite's hundreds of orchestrator runs, on a 2-core CI machine. The
    copy is the same store, empty but for MLflow's Default experiment. Tests of what happens with no store
    skip this."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_store(), path)
    return f"sqlite:///{path}"


@contextlib.contextmanager
def ssh_port_that_hangs_up() -> Iterator[int]:
    """A loopback port whose one "sshd" sends its banner, reads the client's key exchange and hangs up:
    what a client mid-handshake sees when every session of a real sshd is killed (the fault campaign's
    ssh_cut). Not an sshd: a listener that plays that one moment."""

    def hang_up(srv: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn, _ = srv.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2p1\r\n")
                conn.settimeout(0.3)
                while conn.recv(65536):  # read to the client's silence: the end it sees is EOF, not RST
                    pass

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        threading.Thread(target=hang_up, args=(srv,), daemon=True).start()
        yield srv.getsockname()[1]


def sim_clock(scale: float) -> list[str]:
    """The overrides that run the sim's prefill and decode at `scale` of the modelled hardware's clock."""
    return [
        f"deployment.roles.{role}.env.HEISENHUNT_SIM_TIME_SCALE={scale}" for role in ("prefill", "decode")
    ]


# The sim's clock at 0.05 of the modelled hardware (the shipped deployment runs at 0.2): a study's stress
# and throughput sweep take a quarter of the time, and its corruption rates are those the calibration
# bands are checked at (tests/sim/test_calibration.py runs at 0.05). For studies whose checks are
# verdicts and rates; not where a phase must last long enough to be interrupted.
FAST_SIM = sim_clock(0.05)


def local_cluster_overrides(tmp_path: Path) -> list[str]:
    """Free ports and work dirs under tmp_path for every role of the local cluster."""
    overrides = []
    for role in ("prefill", "decode", "router"):
        overrides += [
            f"cluster.hosts.{role}.port={free_port()}",
            f"cluster.hosts.{role}.work_dir={tmp_path}/{role}",
        ]
    overrides.append(f"cluster.hosts.prefill.bootstrap_port={free_port()}")
    overrides.append(f"cluster.hosts.router.metrics_port={free_port()}")
    return overrides


def orchestrator_argv(
    root: Path,
    *args: str,
    entry: Sequence[str] = ("-m", "orchestrator"),
    tracking_uri: str | None = None,
    local_cluster: bool = True,
) -> list[str]:
    """The command line of a study run in `root`: `python` with `entry`, then Hydra's flags among `args`
    (-m, --cfg ...: its parser takes none after the overrides), the local cluster on free ports with its
    work dirs under `root` (unless `local_cluster` is False), the MLflow store (`tracking_uri`, else a
    seeded `root/mlflow.db`), the reports and the sweep folder under `root`, then the other `args`."""
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    return [
        sys.executable,
        *entry,
        *flags,
        *(local_cluster_overrides(root) if local_cluster else ()),
        f"tracking.uri={tracking_uri or seed_mlflow_store(root / 'mlflow.db')}",
        f"report.dir={root}/reports",
        f"hydra.sweep.dir={root}/multirun",
        *overrides,
    ]


POOL_MEMBERS = ("pd0", "pd1")


def pool_overrides(tmp_path: Path) -> list[str]:
    """`cluster_pool=local2` with free ports and work dirs `tmp_path/<member>-<role>` for both members."""
    out = ["cluster_pool=local2"]
    for member in POOL_MEMBERS:
        hosts = f"cluster_pool.clusters.{member}.hosts"
        for role in ("prefill", "decode", "router"):
            out += [
                f"{hosts}.{role}.port={free_port()}",
                f"{hosts}.{role}.work_dir={tmp_path}/{member}-{role}",
            ]
        out += [f"{hosts}.prefill.bootstrap_port={free_port()}", f"{hosts}.router.metrics_port={free_port()}"]
    return out


def job_and_plan(cfg: DictConfig) -> tuple[JobConf, ArmPlan]:
    job = load_job(cfg)
    return job, plan_arm(job)


def plan_of(cfg: DictConfig) -> ArmPlan:
    """The arm a composed job config describes (typed and checked first, as a job does it)."""
    return plan_arm(load_job(cfg))


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator[Callable[..., DictConfig]]:
    """compose_cfg(*overrides) -> the job config as a job of the app would see it (hydra node included)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):

        def _compose(*overrides: str, isolated: bool = True) -> DictConfig:
            extra = local_cluster_overrides(tmp_path) if isolated else []
            seed_mlflow_store(tmp_path / "mlflow.db")
            return compose(
                "config",
                return_hydra_config=True,
                overrides=[
                    *extra,
                    f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                    f"report.dir={tmp_path}/reports",
                    *overrides,
                ],
            )

        yield _compose


# --- the real sglang package, for holding configs and the simulator to it (scripts/sglang-cpu.sh) -----------

REAL_SGLANG_VERSION = "0.5.23"
REAL_SGLANG_DEFAULT = (
    Path.home() / ".cache" / "heisenhunt" / f"sglang-{REAL_SGLANG_VERSION}-cpu" / "bin" / "python"
)


@functools.cache
def _real_sglang_python() -> tuple[str | None, str]:
    """(interpreter, '') of the real sglang installed for CPU checks, or (None, why not)."""
    python = os.environ.get("HEISENHUNT_SGLANG_PYTHON") or str(REAL_SGLANG_DEFAULT)
    if not Path(python).exists():
        return None, f"no real sglang interpreter at {python} (scripts/sglang-cpu.sh installs it)"
    probe = "import importlib.metadata as m, sglang.srt.environ; print(m.version('sglang'))"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    if found.returncode != 0 or found.stdout.strip() != REAL_SGLANG_VERSION:
        why = (found.stderr.strip() or found.stdout.strip())[-300:]
        return None, f"{python} has no sglang {REAL_SGLANG_VERSION}: {why} (scripts/sglang-cpu.sh)"
    return python, ""


@pytest.fixture
def real_sglang_python() -> str:
    """The interpreter of the real sglang package (its parser, env registry and source; no GPU). Skips with
    the reason where it is not installed; under HEISENHUNT_REQUIRE_REAL_SGLANG=1 (CI) that is a failure."""
    python, why = _real_sglang_python()
    if python is None:
        if os.environ.get("HEISENHUNT_REQUIRE_REAL_SGLANG") == "1":
            pytest.fail(f"HEISENHUNT_REQUIRE_REAL_SGLANG=1, but {why}")
        pytest.skip(why)
    return python


# --- preflight_only runs, and a user's factor level with a misspelled variable ------------------------


def listening(port: int) -> bool:
    """Whether something accepts connections on a loopback port."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def preflight_only(tmp_path: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m orchestrator -m ... preflight_only=true` on a local cluster under tmp_path; asserts that
    nothing was started or written: no server listening, no work dir, no MLflow store, no report."""
    cluster = local_cluster_overrides(tmp_path)
    argv = [
        sys.executable, "-m", "orchestrator", "-m", *cluster, "preflight_only=true",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"report.dir={tmp_path}/reports",
        f"hydra.sweep.dir={tmp_path}/multirun", *overrides,
    ]  # fmt: skip
    proc = warm.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    ports = [int(o.split("=")[1]) for o in cluster if o.split("=")[0].endswith("port")]
    assert not any(listening(port) for port in ports)
    assert not any((tmp_path / role).exists() for role in ("prefill", "decode", "router"))
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "reports").exists()
    return proc


TYPO = "SGLANG_OPT_USE_MULTISTREAM_OVERLAP"  # SGLANG_OPT_USE_MULTI_STREAM_OVERLAP, misspelled


def typo_level(tmp_path: Path) -> tuple[str, Path]:
    """A user's level factor/multi_stream=typo setting `TYPO` on decode, in a searchpath folder of their
    own: (the hydra.searchpath override, the level's file)."""
    folder = tmp_path / "mine" / "factor" / "multi_stream"
    folder.mkdir(parents=True)
    path = folder / "typo.yaml"
    path.write_text(f'level: typo\nroles:\n  decode: {{env: {{{TYPO}: "0"}}}}\n')
    return f"hydra.searchpath=[file://{tmp_path / 'mine'}]", path


def typo_refusal(proc: subprocess.CompletedProcess, path: Path) -> str:
    """The refusal line of `TYPO`, checked for what every host's refusal names."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    refusal = next(line for line in out.splitlines() if f"{TYPO} is read nowhere" in line)
    assert f"factor.multi_stream (level typo).roles.decode.env in {path}" in refusal
    assert "Nearest names this build reads: SGLANG_OPT_USE_MULTI_STREAM_OVERLAP" in refusal
    return refusal
