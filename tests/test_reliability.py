"""Reliability, end to end through the real CLI: failures are data, nothing is lost, nothing is left running.

Every test runs `python -m orchestrator` as a subprocess on the embedded default (the simulated SGLang
PD servers and the real sglang-router, on loopback ports picked free for the test), tracking into a
real MLflow sqlite store under tmp_path. Faults come from real process behaviour: a flag the server's
argparse refuses, a signal sent to the orchestrator, the decode process group killed mid-workload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port

ROLES = ("prefill", "decode", "router")
STUDY = "quick"
# the smallest arm: one round per session, no throughput sweep
SMALL = ["workload.rounds=1", "bench.enabled=false"]


@dataclass
class Study:
    """A sandbox for CLI runs: free ports, work dirs, MLflow store, reports and sweep dir under `root`."""

    root: Path
    ports: dict[str, int] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.root}/mlflow.db"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def sweep_dir(self) -> Path:
        return self.root / "multirun"

    def work_dir(self, role: str) -> Path:
        return self.root / role

    def base_overrides(self) -> list[str]:
        out = []
        for role in ROLES:
            out += [f"cluster.hosts.{role}.port={self.ports[role]}", f"cluster.hosts.{role}.work_dir={self.work_dir(role)}"]
        out += [
            f"cluster.hosts.prefill.bootstrap_port={self.ports['bootstrap']}",
            f"tracking.uri={self.uri}",
            f"report.dir={self.reports}",
            f"hydra.sweep.dir={self.sweep_dir}",
            # job dirs named by number: short paths the test can find
            "hydra.sweep.subdir=${hydra.job.num}",
            # a server that will not stop is killed quickly
            "deployment.stop_grace_s=5",
            # the router's metrics exporter defaults to port 29000: taken by any other router on this machine
            f"++deployment.roles.router.flags={{--prometheus-port: {self.ports['metrics']}}}",
        ]
        return out

    def start(self, *overrides: str, base: bool = True) -> subprocess.Popen:
        # -m first: Hydra reads flags before overrides (the primary config is a multirun anyway)
        argv = [sys.executable, "-m", "orchestrator", "-m", *(self.base_overrides() if base else []), *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("HEISENHUNT_PARENT_RUN_ID", None)
        proc = subprocess.Popen(argv, cwd=self.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        self.procs.append(proc)
        return proc

    def run(self, *overrides: str, timeout: float = 240, base: bool = True) -> tuple[int, str]:
        proc = self.start(*overrides, base=base)
        out = finish(proc, timeout)
        return proc.returncode, out

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.uri)

    def arm_runs(self) -> list:
        client = self.client()
        exp = client.get_experiment_by_name(STUDY)
        if exp is None:
            return []
        return client.search_runs([exp.experiment_id], "tags.`heisenhunt.kind` = 'arm'",
                                  order_by=["attributes.start_time ASC"])

    def job_dir(self, num: int) -> Path:
        return self.sweep_dir / str(num)

    def report_cli(self) -> dict:
        """Rebuild the report from MLflow alone with the report command; report.json's content."""
        proc = subprocess.run([sys.executable, "-m", "orchestrator.report", "--tracking-uri", self.uri,
                               "--study", STUDY, "--out", str(self.reports), "--no-plots"],
                              cwd=self.root, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads((self.reports / STUDY / "report.json").read_text())

    def report_md(self) -> str:
        return (self.reports / STUDY / "report.md").read_text()

    # --- what is left running ------------------------------------------------------------------------

    def pid_files(self) -> list[Path]:
        return sorted(self.root.glob("*/*.pid"))

    def live_servers(self) -> list[str]:
        """Server process groups named by a pid file that still have a live (non-zombie) process."""
        return [f"{path}: pgid {pgid}" for path in self.pid_files() if (pgid := pid_of(path)) and group_alive(pgid)]

    def listening(self) -> list[int]:
        return sorted(set(self.ports.values()) & listening_ports())

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        for path in self.pid_files():
            pgid = pid_of(path)
            if pgid and group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"orchestrator did not finish within {timeout}s:\n{out[-5000:]}")
    return out


def pid_of(pid_file: Path) -> int | None:
    """The pid on a pid file's first line (the second line is its start time)."""
    try:
        first = pid_file.read_text().splitlines()[0].strip()
    except (FileNotFoundError, IndexError):
        return None
    return int(first) if first.isdigit() else None


def group_alive(pgid: int) -> bool:
    """A live, non-zombie process in process group `pgid` (read from /proc, not by name)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this machine, from `ss -ltn`."""
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def wait_for(predicate: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the orchestrator exited ({proc.returncode}) before {what}:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def jsonl_lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def artifact_text(client: MlflowClient, run_id: str, path: str, dst: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


@pytest.fixture
def study(tmp_path: Path) -> Iterator[Study]:
    s = Study(tmp_path, {role: free_port() for role in (*ROLES, "bootstrap", "metrics")})
    try:
        yield s
    finally:
        s.cleanup()


def searchpath_dir(root: Path, files: dict[str, str]) -> str:
    """A config dir for hydra.searchpath holding `files` (relative path -> YAML text); the override."""
    conf = root / "extra_conf"
    for rel, text in files.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    return f"hydra.searchpath=[file://{conf}]"


# --- 1. a failing arm does not sink the sweep ----------------------------------------------------------


# A level added through a test config dir (options of one group merge across the search path): it passes
# a flag that is well-formed, so config validation accepts it, but the server's argparse refuses it.
BROKEN_LEVEL = {
    "factor/multi_stream/broken.yaml": "level: broken\nroles:\n  decode: {flags: {--no-such-flag: null}}\n",
}


@pytest.mark.slow
def test_an_arm_whose_server_will_not_start_is_a_failed_run_and_the_sweep_goes_on(study):
    rc, out = study.run(searchpath_dir(study.root, BROKEN_LEVEL), "factor/multi_stream=broken,off",
                        "workload.sessions=4", *SMALL)
    assert rc == 0, out[-5000:]
    runs = {r.data.params["factor.multi_stream"]: r for r in study.arm_runs()}
    assert set(runs) == {"broken", "off"}, out[-3000:]
    bad, ok = runs["broken"], runs["off"]
    # the failed arm came first; the next one still ran to the end
    assert bad.info.start_time < ok.info.start_time
    assert ok.info.status == "FINISHED" and ok.data.metrics["sessions_total"] == 4
    assert bad.info.status == "FAILED"
    assert bad.data.tags["failure_reason"].startswith("decode: exited before becoming healthy")
    failure = artifact_text(study.client(), bad.info.run_id, "failure/failure.txt", study.root / "dl")
    # the log tail shows why: the server's own argparse error
    assert "unrecognized arguments: --no-such-flag" in failure
    # the report lists the failed arm and why
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    problems = [p for p in report["problem_runs"] if p["status"] == "FAILED"]
    assert [p["arm"] for p in problems] == ["multi_stream=broken"]
    assert "exited before becoming healthy" in problems[0]["reason"]
    md = study.report_md()
    failed_rows = [line for line in md.splitlines() if line.startswith("| multi_stream=broken") and "FAILED" in line]
    assert failed_rows and "exited before becoming healthy" in failed_rows[0]
    assert not study.live_servers() and not study.listening()


# --- 2. interrupts ------------------------------------------------------------------------------------

# long enough that the signal lands mid-stress: few sessions at a time, several rounds each
LONG_STRESS = ["workload.sessions=200", "workload.rounds=4", "workload.concurrency=2", "bench.enabled=false"]


def interrupt_mid_stress(study: Study, proc: subprocess.Popen, job: int, signum: int) -> str:
    """Wait until job `job` has written some session outcomes, send `signum` to the orchestrator, wait."""
    sessions = study.job_dir(job) / "stress" / "sessions.jsonl"
    wait_for(lambda: jsonl_lines(sessions) >= 3, 120, f"job {job} to record 3 sessions", proc)
    # the servers of this arm are up now: their pid files and ports are what must be gone afterwards
    assert len(study.live_servers()) == 3 and set(study.listening()) == set(study.ports.values())
    proc.send_signal(signum)
    return finish(proc, 120)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_mid_stress_tears_down_every_host_and_keeps_the_partial_outcomes(study, signum):
    proc = study.start("factor/multi_stream=on", "repetition=0", *LONG_STRESS)
    out = interrupt_mid_stress(study, proc, 0, signum)
    assert proc.returncode != 0, out[-3000:]
    # nothing left running, no port left listening, no pid file left behind
    assert not study.live_servers(), out[-3000:]
    assert not study.listening()
    assert not study.pid_files()
    [run] = study.arm_runs()
    assert run.info.status == "KILLED", out[-3000:]
    assert "interrupted" in run.data.tags["failure_reason"]
    # the sessions that completed are kept, in MLflow, as a partial outcome
    metrics = run.data.metrics
    assert run.data.tags["outcomes"] == "partial"
    recorded = jsonl_lines(study.job_dir(0) / "stress" / "sessions.jsonl")
    assert 3 <= metrics["sessions_total"] == recorded < metrics["sessions_planned"] == 200
    jsonl = artifact_text(study.client(), run.info.run_id, "stress/sessions.jsonl", study.root / "dl")
    assert len(jsonl.splitlines()) == recorded
    # the parent run did not reach on_multirun_end: it is KILLED too, not left RUNNING
    parent = study.client().get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "KILLED"
    # the report command (from MLflow alone) uses them, marked partial
    report = study.report_cli()
    [arm] = report["arms"]
    assert arm["partial"] and arm["n"] == metrics["sessions_clean"] + metrics["sessions_corrupted"]
    [problem] = report["problem_runs"]
    assert problem["status"] == "KILLED" and problem["used"]
    assert "partial" in study.report_md()


# --- 3. a server dying mid-workload ---------------------------------------------------------------------


@pytest.mark.slow
def test_decode_dying_mid_stress_errors_the_sessions_in_flight_and_fails_the_arm(study):
    # multi_stream=off: the simulated target corrupts nothing in this arm, so any corrupted session
    # would be the server's death miscounted as corruption
    proc = study.start("factor/multi_stream=off", "repetition=0", "hydra.sweeper.default_design=factorial",
                       "workload.timeout_s=15", *LONG_STRESS)
    sessions = study.job_dir(0) / "stress" / "sessions.jsonl"
    wait_for(lambda: jsonl_lines(sessions) >= 3, 120, "3 sessions recorded", proc)
    decode = pid_of(study.work_dir("decode") / "decode.pid")
    assert decode and group_alive(decode)
    os.killpg(decode, signal.SIGKILL)
    out = finish(proc, 240)
    assert proc.returncode == 0, out[-4000:]  # a failed arm is data, not a crash of the sweep
    [run] = study.arm_runs()
    m = run.data.metrics
    assert run.info.status == "FAILED", out[-3000:]
    assert run.data.tags["failure_reason"].startswith("decode: died during the stress workload")
    # no session is lost; those cut off by the death are errored, none corrupted
    assert m["sessions_total"] == m["sessions_planned"] == 200 == jsonl_lines(sessions)
    assert m["sessions_errored"] >= 1 and m["sessions_corrupted"] == 0
    assert m["sessions_clean"] + m["sessions_errored"] == 200
    outcomes = [json.loads(line) for line in sessions.read_text().splitlines()]
    assert len({o["session_id"] for o in outcomes}) == 200
    assert all(o["error"] for o in outcomes if o["status"] == "errored")
    # the corruption numbers leave errored sessions out: n counts clean + corrupted only
    assert m["corruption_rate"] == 0.0
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    [arm] = report["arms"]
    assert arm["n"] == m["sessions_clean"] and arm["errored"] == m["sessions_errored"] and arm["corrupted"] == 0
    [problem] = report["problem_runs"]
    assert problem["status"] == "FAILED" and "died during the stress workload" in problem["reason"]
    assert "died during the stress workload" in study.report_md()
    assert not study.live_servers() and not study.listening() and not study.pid_files()
