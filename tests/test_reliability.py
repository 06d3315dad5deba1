"""Reliability, end to end through the real CLI: failures are data, nothing is lost, nothing is left running.

Every test runs `python -m orchestrator` as a subprocess on the embedded default (the simulated SGLang
PD servers and the real sglang-router, on loopback ports picked free for the test), tracking into a
real MLflow sqlite store under tmp_path. Faults come from real process behaviour: a flag the server's
argparse refuses, a signal sent to the orchestrator, the decode process group killed mid-workload.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.run.lease import local_start_time
from tests import warm
from tests.conftest import free_port, seed_mlflow_store, sweep_logs
from tests.test_study import finish, kill_if_running

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
            out += [
                f"cluster.hosts.{role}.port={self.ports[role]}",
                f"cluster.hosts.{role}.work_dir={self.work_dir(role)}",
            ]
        out += [
            f"cluster.hosts.prefill.bootstrap_port={self.ports['bootstrap']}",
            f"tracking.uri={self.uri}",
            f"report.dir={self.reports}",
            f"hydra.sweep.dir={self.sweep_dir}",
            # job dirs named by number: short paths the test can find
            "hydra.sweep.subdir=${hydra.job.num}",
            # a server that will not stop is killed quickly
            "deployment.stop_grace_s=5",
            # every sweep here, the command-line ones too, records under one study
            f"study.name={STUDY}",
            f"cluster.hosts.router.metrics_port={self.ports['metrics']}",
        ]
        return out

    def start(self, *overrides: str, own_group: bool = False) -> subprocess.Popen:
        """`python -m orchestrator -m` with the sandbox's overrides, except those `overrides` replace.
        own_group: in a process group of its own, so a test can send Ctrl-C as a terminal does (to the
        whole foreground group: the orchestrator and any command it is running at that moment)."""
        replaced = {o.split("=", 1)[0].lstrip("+") for o in overrides}
        base = [o for o in self.base_overrides() if o.split("=", 1)[0].lstrip("+") not in replaced]
        # -m first: Hydra reads flags before overrides (the primary config is a multirun anyway)
        argv = [sys.executable, "-m", "orchestrator", "-m", *base, *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("HEISENHUNT_PARENT_RUN_ID", None)
        proc = warm.popen(
            argv,
            cwd=self.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0 if own_group else None,
        )
        self.procs.append(proc)
        return proc

    def run(self, *overrides: str, timeout: float = 240) -> tuple[int, str]:
        proc = self.start(*overrides)
        out = finish(proc, timeout)
        return proc.returncode, out

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.uri)

    def arm_runs(self) -> list:
        client = self.client()
        exp = client.get_experiment_by_name(STUDY)
        if exp is None:
            return []
        return client.search_runs(
            [exp.experiment_id], "tags.`heisenhunt.kind` = 'arm'", order_by=["attributes.start_time ASC"]
        )

    def job_dir(self, num: int) -> Path:
        return self.sweep_dir / str(num)

    def report_cli(self) -> dict:
        """Rebuild the report from MLflow alone with the report command; report.json's content."""
        proc = warm.run(
            [
                sys.executable,
                "-m",
                "orchestrator.report",
                "--tracking-uri",
                self.uri,
                "--study",
                STUDY,
                "--out",
                str(self.reports),
                "--no-plots",
            ],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads((self.reports / STUDY / "report.json").read_text())

    def report_md(self) -> str:
        return (self.reports / STUDY / "report.md").read_text()

    # --- what is left running ------------------------------------------------------------------------

    def pid_files(self) -> list[Path]:
        return sorted(self.root.glob("*/*.pid"))

    def live_servers(self) -> list[str]:
        """Server process groups named by a pid file that still have a live (non-zombie) process."""
        return [
            f"{path}: pgid {pgid}"
            for path in self.pid_files()
            if (pgid := pid_of(path)) and group_alive(pgid)
        ]

    def listening(self) -> list[int]:
        return sorted(set(self.ports.values()) & listening_ports())

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_if_running(proc)
        for path in self.pid_files():
            pgid = pid_of(path)
            if pgid and group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)


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


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(
                f"the orchestrator exited ({proc.returncode}) before {what}:\n{proc.communicate()[0][-4000:]}"
            )
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
    seed_mlflow_store(tmp_path / "mlflow.db")
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


# A level added through a test config dir (options of one group merge across the search path). Its flag
# value is well-formed (config validation accepts it) and the host's flag parser accepts it too (the
# preflight passes), but the server's own check refuses it at start: a server that will not start.
BROKEN_LEVEL = {
    "factor/multi_stream/broken.yaml": (
        "level: broken\nroles:\n  decode: {flags: {--cuda-graph-max-bs-decode: 0}}\n"
    ),
}


@pytest.mark.slow
def test_an_arm_whose_server_will_not_start_is_a_failed_run_and_the_sweep_goes_on(study):
    rc, out = study.run(
        searchpath_dir(study.root, BROKEN_LEVEL),
        "factor/multi_stream=broken,off",
        "workload.sessions=4",
        *SMALL,
    )
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
    assert "error: --cuda-graph-max-bs-decode must be >= 1" in failure
    # the report lists the failed arm and why
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    problems = [p for p in report["problem_runs"] if p["status"] == "FAILED"]
    assert [p["arm"] for p in problems] == ["multi_stream=broken"]
    assert "exited before becoming healthy" in problems[0]["reason"]
    # the terminal says so as the arm ends (the error itself on stderr), then goes on
    assert "arm 1/2 multi_stream=broken #0: FAILED (" in out, out[-3000:]
    assert ": decode: exited before becoming healthy" in out
    assert "arm 2/2 multi_stream=off #0: FINISHED, 4/4 sessions" in out
    md = study.report_md()
    failed_rows = [
        line for line in md.splitlines() if line.startswith("| multi_stream=broken") and "FAILED" in line
    ]
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
    assert proc.returncode == 130, out[-3000:]
    # what was kept, and how to resume
    assert "heisenhunt: kept 0 of 1 arm runs FINISHED, 1 KILLED" in out, out[-3000:]
    assert "run the same command with resume=true" in out
    # one line says what was kept; no traceback
    assert "Traceback" not in out and "is KILLED with the" in out, out[-3000:]
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
    # the report command (from MLflow alone) lists them with their counts, never pooled: a killed run's
    # outcomes are biased (a corrupted session ends at its first bad turn, a clean one needs every round)
    report = study.report_cli()
    [arm] = report["arms"]
    assert arm["n"] == 0
    [problem] = report["problem_runs"]
    assert problem["status"] == "KILLED" and not problem["used"]
    assert problem["corrupted"] + problem["clean"] == metrics["arm.sessions"]
    assert "KILLED" in study.report_md()


@pytest.mark.slow
def test_ctrl_c_while_the_servers_start_leaves_nothing_running(study):
    proc = study.start("factor/multi_stream=on", "repetition=0", *LONG_STRESS, own_group=True)
    # prefill is up and decode is being started: Ctrl-C, as a terminal sends it, to the whole group
    wait_for(lambda: (study.work_dir("decode") / "decode.pid").exists(), 120, "decode to start", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out = finish(proc, 120)
    assert proc.returncode != 0, out[-3000:]
    assert not study.live_servers(), out[-3000:]
    assert not study.listening() and not study.pid_files()
    [run] = study.arm_runs()
    assert run.info.status == "KILLED" and run.data.tags["outcomes"] == "none"


# --- 3. a server dying mid-workload ---------------------------------------------------------------------


@pytest.mark.slow
def test_decode_dying_mid_stress_errors_the_sessions_in_flight_and_fails_the_arm(study):
    # multi_stream=off: the simulated target corrupts nothing in this arm, so any corrupted session
    # would be the server's death miscounted as corruption. The turn timeout stays long (120 s): the
    # stress watchdog, not the timeout, must end the sessions caught by the death.
    proc = study.start(
        "factor/multi_stream=off",
        "repetition=0",
        "workload.sessions=24",
        "workload.rounds=4",
        "workload.concurrency=6",
        "workload.timeout_s=120",
        "bench.enabled=false",
    )
    sessions = study.job_dir(0) / "stress" / "sessions.jsonl"
    wait_for(lambda: jsonl_lines(sessions) >= 3, 120, "3 sessions recorded", proc)
    decode = pid_of(study.work_dir("decode") / "decode.pid")
    assert decode and group_alive(decode)
    os.killpg(decode, signal.SIGKILL)
    killed_at = time.monotonic()
    out = finish(proc, 240)
    assert time.monotonic() - killed_at < 60, "the sessions waited out their timeouts: no watchdog"
    assert proc.returncode == 0, out[-4000:]  # a failed arm is data, not a crash of the sweep
    [run] = study.arm_runs()
    m = run.data.metrics
    assert run.info.status == "FAILED", out[-3000:]
    assert run.data.tags["failure_reason"].startswith("decode: died during the stress workload")
    # every session that ran has its outcome; those cut off by the death are errored, none corrupted;
    # sessions never started are left out, so the run is marked partial (planned > sessions)
    assert m["sessions_planned"] == 24 and m["sessions_total"] == jsonl_lines(sessions) >= 3
    assert m["sessions_errored"] >= 1 and m["arm.corrupted"] == 0
    assert m["sessions_clean"] + m["sessions_errored"] == m["sessions_total"]
    outcomes = [json.loads(line) for line in sessions.read_text().splitlines()]
    assert len({o["session_id"] for o in outcomes}) == len(outcomes)
    assert all(o["error"] for o in outcomes if o["status"] == "errored")
    # the corruption numbers leave errored sessions out: n counts clean + corrupted only
    assert m["arm.rate"] == 0.0
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    # the failed run is listed with its counts, never pooled into its arm
    [arm] = report["arms"]
    assert arm["n"] == 0
    [problem] = report["problem_runs"]
    assert problem["status"] == "FAILED" and not problem["used"]
    assert problem["clean"] == m["sessions_clean"] and problem["errored"] == m["sessions_errored"]
    assert problem["corrupted"] == 0
    assert problem["status"] == "FAILED" and "died during the stress workload" in problem["reason"]
    assert "died during the stress workload" in study.report_md()
    assert not study.live_servers() and not study.listening() and not study.pid_files()


# --- 4. resume ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_skips_finished_arms_and_reruns_the_interrupted_one(study):
    # one session at a time, so the second arm is surely mid-stress when the signal lands
    sweep = [
        "factor/multi_stream=on,off",
        "repetition=0",
        "workload.sessions=20",
        "workload.rounds=3",
        "workload.concurrency=1",
        "bench.enabled=false",
    ]
    proc = study.start(*sweep)
    out = interrupt_mid_stress(study, proc, 1, signal.SIGTERM)
    assert proc.returncode != 0, out[-3000:]
    first = {r.data.params["factor.multi_stream"]: r for r in study.arm_runs()}
    assert {k: r.info.status for k, r in first.items()} == {"on": "FINISHED", "off": "KILLED"}, out[-3000:]
    killed = first["off"]
    kept = int(killed.data.metrics["sessions_total"])
    assert 3 <= kept < 20 and killed.data.tags["outcomes"] == "partial"
    # before the re-run, the report lists the interrupted run but pools none of its (biased) outcomes
    report = study.report_cli()
    arms = {a["label"]: a for a in report["arms"]}
    assert arms["multi_stream=off"]["n"] == 0 and arms["baseline"]["n"] > 0
    [problem] = report["problem_runs"]
    assert problem["run_id"] == killed.info.run_id and not problem["used"]
    assert problem["clean"] + problem["corrupted"] == kept - killed.data.metrics["sessions_errored"]

    rc, out = study.run(*sweep, "resume=true")
    assert rc == 0, out[-4000:]
    assert "already FINISHED; skipped" in sweep_logs(study.sweep_dir)
    assert ": SKIPPED (already FINISHED: resume)" in out  # and the terminal says so
    after = study.arm_runs()
    by_level: dict[str, list] = {}
    for run in after:
        by_level.setdefault(run.data.params["factor.multi_stream"], []).append(run)
    # the finished arm was skipped: still its one run; the interrupted one ran again, to the end
    assert [r.info.run_id for r in by_level["on"]] == [first["on"].info.run_id]
    assert sorted(r.info.status for r in by_level["off"]) == ["FINISHED", "KILLED"]
    rerun = next(r for r in by_level["off"] if r.info.status == "FINISHED")
    assert rerun.data.metrics["sessions_total"] == 20 and rerun.data.tags["outcomes"] == "complete"
    # the report at the end of the resumed sweep: the complete re-run counts, the interrupted run is
    # still listed (its outcomes not pooled twice: the re-run replays the same seeded sessions)
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    arms = {a["label"]: a for a in report["arms"]}
    assert arms["multi_stream=off"]["n"] == 20
    [problem] = report["problem_runs"]
    assert problem["run_id"] == killed.info.run_id and problem["status"] == "KILLED" and not problem["used"]
    assert not study.live_servers() and not study.listening() and not study.pid_files()


# --- 5. bad input: one clear message, before any server is restarted -------------------------------------

BAD_EXPERIMENTS = {
    "experiment/broken_yaml.yaml": "# @package _global_\nstudy: {name: [unclosed\n",
    "experiment/misspelled.yaml": "# @package _global_\nstudy:\n  name: misspelled\n  hypothesis: []\n",
    "experiment/unknown_factor.yaml": (
        "# @package _global_\nstudy:\n  name: unknown_factor\n  hypotheses:\n"
        "    - {id: H-x, factor: nosuch, statement: s, baseline: a, treatment: b}\n"
    ),
}
BAD_FAULT_MODEL = "version: 1\nrules: 12\n"
# a user's factor whose levels are wrong in the two ways a schema catches: a misspelled role, a `level:`
# that is not its file name
BAD_EXPERIMENTS |= {
    "factor/warp/slow.yaml": 'level: slow\nroles:\n  decod: {env: {WARP_SLOW: "1"}}\n',
    "factor/warp/fast.yaml": 'level: quick\nroles:\n  decode: {env: {WARP_SLOW: "0"}}\n',
}


@dataclass(frozen=True)
class BadInput:
    overrides: tuple[str, ...]
    # every one of these must appear in the output (the key, and what is accepted)
    expect: tuple[str, ...]


BAD_INPUTS = {
    "unknown detector family": BadInput(
        ("workload.count=[structural,drift]",),
        (
            "workload.count: ['drift'] not a detector family; accepted: ['structural', 'plan_drift', "
            "'diverged_early', 'diverged', 'wrong_answer', 'reproducer']",
        ),
    ),
    "unknown oracle": BadInput(
        ("workload.oracle=eyeball",),
        ("workload.oracle: 'eyeball' is not one of ['tool_calls', 'divergence', 'reproducer']",),
    ),
    "prompts file that is not there": BadInput(
        ("workload.prompts=/nonexistent/prompts.jsonl",),
        ("workload.prompts: /nonexistent/prompts.jsonl", "cannot read"),
    ),
    "unknown tool choice": BadInput(
        ("workload.tool_choice=always",),
        ("workload.tool_choice: 'always' is not one of ['auto', 'required', 'plan']",),
    ),
    "unknown factor": BadInput(
        ("+factor/nosuch=on",), ("factor/nosuch", "accepted factor names", "multi_stream")
    ),
    # checked on the command line before Hydra composes (Hydra's own message names no factors)
    "unknown factor without +": BadInput(
        ("factor/nosuch=on",),
        ("factor/nosuch: unknown factor 'nosuch'", "accepted factor names", "multi_stream"),
    ),
    "factor level with a misspelled role": BadInput(
        ("+factor/warp=slow", "{searchpath}"),
        (
            "factor/warp/slow.yaml",
            "roles.decod: unknown role 'decod'",
            "accepted: ['prefill', 'decode', 'router']",
        ),
    ),
    "factor level named unlike its file": BadInput(
        ("+factor/warp=fast", "{searchpath}"),
        ("factor/warp/fast.yaml", "level: 'quick' differs from the file name 'fast'", "accepted: 'fast'"),
    ),
    # also checked on the command line (Hydra's own message dumps its search path and exits 1)
    "unknown level": BadInput(
        ("factor/multi_stream=maybe",),
        ("factor/multi_stream: unknown level 'maybe'; accepted levels: [off, on]",),
    ),
    "experiment file not YAML": BadInput(
        ("+experiment=broken_yaml", "{searchpath}"), ("experiment/broken_yaml.yaml", "line 1")
    ),
    "experiment file misspelled key": BadInput(
        ("+experiment=misspelled", "{searchpath}"),
        ("experiment/misspelled", "Key 'hypothesis' not in 'StudyConf'"),
    ),
    "hypothesis with an unknown factor": BadInput(
        ("+experiment=unknown_factor", "{searchpath}"),
        (
            "study.hypotheses[0] (H-x).factor: unknown factor 'nosuch'",
            "accepted: ['capture', 'determinism', 'hicache'",
        ),
    ),
    "hypothesis with an unknown level": BadInput(
        ("study.hypotheses.0.treatment=maybe",),
        ("study.hypotheses[0] (H-multistream).treatment: unknown level 'maybe'", "accepted: ['off', 'on']"),
    ),
    "invalid env name": BadInput(
        ('++deployment.roles.decode.env={bad-name: "1"}',),
        ("deployment.roles.decode.env: invalid variable name 'bad-name'", "[A-Z_][A-Z0-9_]*"),
    ),
    "flag value with shell metacharacters": BadInput(
        ("++deployment.roles.decode.flags={--tool-call-parser: 'x;touch {root}/pwned'}",),
        ("deployment.roles.decode.flags.--tool-call-parser", "shell metacharacter", "accepted: plain words"),
    ),
    # the hosts check every arm before the first job: flags with the host's own parser...
    "flag the host's parser refuses": BadInput(
        ("++deployment.roles.decode.flags={--no-such-flag: null}",),
        (
            "decode: on 127.0.0.1: sglang does not know --no-such-flag",
            "(set by deployment.roles.decode.flags)",
        ),
    ),
    # ...and the deployment's preflight module (the sim's `python -m orchestrator.sim.check`)
    "invalid fault-model file": BadInput(
        ("++deployment.roles.decode.env={HEISENHUNT_SIM_FAULT_MODEL: '{root}/bad_fault_model.yaml'}",),
        (
            "decode: `python -m orchestrator.sim.check` on 127.0.0.1 refused the arm",
            "bad_fault_model.yaml: rules:",
            "expected a list of rules",
        ),
    ),
    "unreachable tracking URI": BadInput(
        ("tracking.uri=http://127.0.0.1:{closed_port}",),
        ("tracking.uri: cannot reach", "accepted: a reachable MLflow server"),
    ),
    "unwritable reports dir": BadInput(
        ("report.dir={root}/a_file/reports",), ("report.dir:", "is not a writable directory", "accepted:")
    ),
}


@pytest.fixture
def sentinel(study: Study) -> Iterator[tuple[int, str]]:
    """A process this tool would stop on a co-restart: its pid file, with the start time, as decode's.
    (No server runs anywhere, so stopping this is the only mark a restart could leave.)"""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        started = local_start_time(proc.pid)
        pid_file = study.work_dir("decode") / "decode.pid"
        pid_file.parent.mkdir(parents=True)
        pid_file.write_text(f"{proc.pid}\n{started}\n")
        yield proc.pid, pid_file.read_text()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("case", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_is_refused_with_one_clear_message_before_any_restart(study, sentinel, case):
    (study.root / "a_file").write_text("")
    (study.root / "bad_fault_model.yaml").write_text(BAD_FAULT_MODEL)
    searchpath = searchpath_dir(study.root, BAD_EXPERIMENTS)
    overrides = [
        o.replace("{searchpath}", searchpath)
        .replace("{root}", str(study.root))
        .replace("{closed_port}", str(free_port()))
        for o in case.overrides
    ]
    if not any(o.startswith("factor/multi_stream=") for o in overrides):
        overrides.append("factor/multi_stream=on")
    rc, out = study.run(*overrides, "repetition=0", "workload.sessions=2", *SMALL, timeout=120)
    assert rc != 0, out[-4000:]
    for text in case.expect:
        assert text in out, f"{text!r} not in the output:\n{out[-4000:]}"
    # nothing was restarted: the process a co-restart would have stopped runs on, its pid file untouched,
    # and no server was started (no other pid file, no server log)
    pid, pid_text = sentinel
    assert group_alive(pid)
    assert (study.work_dir("decode") / "decode.pid").read_text() == pid_text
    assert study.pid_files() == [study.work_dir("decode") / "decode.pid"]
    assert not any(study.root.glob("*/logs"))
    assert not (study.root / "pwned").exists()
    # refused before the first job: no arm run was even opened, nor the sweep's parent run (it opens once
    # the sweep is accepted): the store has not even the study's experiment
    assert not study.arm_runs()
    if (study.root / "mlflow.db").exists():
        assert study.client().get_experiment_by_name(STUDY) is None


def test_the_sentinel_is_what_a_restart_stops(study, sentinel):
    """The control for the table above: with good input, the co-restart does stop the sentinel."""
    rc, out = study.run("factor/multi_stream=on", "repetition=0", "workload.sessions=2", *SMALL, timeout=120)
    assert rc == 0, out[-4000:]
    assert not group_alive(sentinel[0])
    assert [r.info.status for r in study.arm_runs()] == ["FINISHED"]
    assert not study.live_servers() and not study.pid_files()


# --- 6. secrets ------------------------------------------------------------------------------------------

SECRET = "hunter2-secret-value"


def test_a_literal_secret_on_the_command_line_is_refused_naming_the_form_to_use(study):
    """Hydra keeps the command line as typed (.hydra/, multirun.yaml, its launch log): a literal secret
    would be there for good, so it is refused before Hydra sees it."""
    (study.root / "mlflow.db").unlink()  # not even a store is made
    rc, out = study.run("factor/multi_stream=on", f"++deployment.roles.decode.env={{HF_TOKEN: {SECRET}}}")
    assert rc == 2, out[-3000:]
    assert "deployment.roles.decode.env.HF_TOKEN: a literal secret" in out
    assert "'${oc.env:HF_TOKEN}'" in out and SECRET not in out
    assert not any(study.root.rglob("multirun.yaml")) and not (study.root / "mlflow.db").exists()


@pytest.mark.parametrize("given", ["from_env"])
def test_secret_env_values_reach_no_param_tag_artifact_report_or_log(study, given, monkeypatch):
    """The way to pass a secret: `${oc.env:...}`, read at run time."""
    monkeypatch.setenv("HH_TEST_SECRET", SECRET)
    value = "'${oc.env:HH_TEST_SECRET}'"
    proc = study.start(
        "factor/multi_stream=on",
        "repetition=0",
        "workload.sessions=2",
        *SMALL,
        f"++deployment.roles.decode.env={{HF_TOKEN: {value}, MY_API_KEY: {value}}}",
    )
    out = finish(proc, 120)
    assert proc.returncode == 0, out[-4000:]
    client = study.client()
    exp = client.get_experiment_by_name(STUDY)
    all_runs = client.search_runs([exp.experiment_id])
    [arm] = study.arm_runs()
    assert arm.info.status == "FINISHED"
    # the secret reached the server (it ran with it) but is shown as *** wherever this tool writes
    assert (
        arm.data.params["env.decode.HF_TOKEN"] == "***" and arm.data.params["env.decode.MY_API_KEY"] == "***"
    )
    leaks = []
    for run in all_runs:
        for kind, mapping in (
            ("param", run.data.params),
            ("tag", run.data.tags),
            ("metric", run.data.metrics),
        ):
            leaks += [f"{run.info.run_id} {kind} {k}" for k, v in mapping.items() if SECRET in f"{k}={v}"]
        dst = study.root / "artifacts" / run.info.run_id
        dst.mkdir(parents=True)
        client.download_artifacts(run.info.run_id, "", str(dst))
    assert len(list((study.root / "artifacts").rglob("*.log"))) >= 3  # the server logs were attached
    files = [
        *(study.root / "artifacts").rglob("*"),
        *study.reports.rglob("*"),
        *study.job_dir(0).rglob("*.log"),
        study.job_dir(0) / "resolved_config.yaml",
        *study.root.glob("*/logs/*/*.log"),
    ]
    if given == "from_env":
        # nothing under the sandbox holds it (Hydra's own snapshots keep `${oc.env:...}` unresolved),
        # nor does the console
        files += list(study.root.rglob("*"))
        leaks += ["console"] if SECRET in out else []
    leaks += [str(f) for f in files if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert not leaks, leaks


# --- 7. load ----------------------------------------------------------------------------------------------

LOAD_SESSIONS = 1000


@pytest.mark.slow
def test_a_thousand_concurrent_sessions_through_the_router_lose_no_outcome(study):
    t0 = time.monotonic()
    rc, out = study.run(
        "factor/multi_stream=on",
        "repetition=0",
        f"workload.sessions={LOAD_SESSIONS}",
        "workload.rounds=1",
        "bench.enabled=false",
        timeout=500,
    )
    elapsed = time.monotonic() - t0
    assert rc == 0, out[-4000:]
    [run] = study.arm_runs()
    m = run.data.metrics
    assert run.info.status == "FINISHED", out[-3000:]
    # every session has exactly one outcome, none of them a client error
    outcomes = [
        json.loads(line) for line in (study.job_dir(0) / "stress" / "sessions.jsonl").read_text().splitlines()
    ]
    assert len(outcomes) == len({o["session_id"] for o in outcomes}) == LOAD_SESSIONS
    assert (
        m["sessions_total"] == m["sessions_planned"] == LOAD_SESSIONS
        and run.data.tags["outcomes"] == "complete"
    )
    assert m["sessions_errored"] == 0, [o["error"] for o in outcomes if o["status"] == "errored"][:5]
    assert m["arm.sessions"] == LOAD_SESSIONS
    summary = json.loads((study.job_dir(0) / "stress" / "summary.json").read_text())
    assert summary["settings"]["concurrency"] == LOAD_SESSIONS  # all at once
    print(
        f"{LOAD_SESSIONS} concurrent sessions: stress {m['stress_duration_s']:.1f}s, arm {elapsed:.1f}s, "
        f"{int(m['arm.corrupted'])} corrupted, 0 errored"
    )
    assert not study.live_servers() and not study.listening()


@pytest.mark.slow
def test_an_impatient_user_pressing_ctrl_c_again_during_teardown_still_leaves_nothing_running(study):
    proc = study.start("factor/multi_stream=on", "repetition=0", *LONG_STRESS)
    sessions = study.job_dir(0) / "stress" / "sessions.jsonl"
    wait_for(lambda: jsonl_lines(sessions) >= 3, 120, "3 sessions recorded", proc)
    for _ in range(8):  # the first one interrupts; the rest land in the teardown
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGINT)
        time.sleep(0.15)
    out = finish(proc, 120)
    assert not study.live_servers(), out[-4000:]
    assert not study.listening() and not study.pid_files()
    [run] = study.arm_runs()
    assert run.info.status == "KILLED" and run.data.tags["outcomes"] == "partial", out[-3000:]


def test_an_arm_its_hosts_refuse_stops_nothing_and_starts_nothing(compose_cfg, study, sentinel, tmp_path):
    """One job on its own (no sweeper in front): a host check that refuses the arm comes before the
    co-restart, so whatever runs (here the sentinel in decode's pid file) is left alone."""
    from orchestrator.__main__ import run_job
    from orchestrator.run.preflight import PreflightError

    (tmp_path / "bad.yaml").write_text(BAD_FAULT_MODEL)
    cfg = compose_cfg(f"++deployment.roles.decode.env={{HEISENHUNT_SIM_FAULT_MODEL: '{tmp_path}/bad.yaml'}}")
    with pytest.raises(PreflightError, match=r"orchestrator\.sim\.check.* refused the arm"):
        run_job(cfg, tmp_path / "job")
    pid, pid_text = sentinel
    assert group_alive(pid)
    assert (study.work_dir("decode") / "decode.pid").read_text() == pid_text
    assert not (study.work_dir("prefill") / "prefill.pid").exists()
    client = MlflowClient(str(cfg.tracking.uri))
    [run] = client.search_runs([client.get_experiment_by_name(str(cfg.study.name)).experiment_id])
    assert run.info.status == "FAILED" and "refused the arm" in run.data.tags["failure_reason"]


# --- 5. the orchestrator's own death, and interrupts in every phase (issue 32) --------------------------


@pytest.mark.slow
def test_a_killed_orchestrator_leaves_its_run_to_the_next_sweep_which_ends_it_and_its_servers(study):
    """SIGKILL of the orchestrator mid-stress: nothing in it can run, so its arm's MLflow run stays RUNNING
    and its servers keep serving. The resume that follows stops the servers through their pid files (its
    co-restart) and ends the run FAILED, naming the dead process; the parent run too. Found by the fault
    campaign (bench/fault_campaign.py), where every `sigkill` fault left a RUNNING run behind."""
    proc = study.start("factor/multi_stream=on", "repetition=0", *LONG_STRESS)
    sessions = study.job_dir(0) / "stress" / "sessions.jsonl"
    wait_for(lambda: jsonl_lines(sessions) >= 3, 120, "3 sessions recorded", proc)
    proc.kill()
    proc.communicate()
    assert len(study.live_servers()) == 3  # left running: nothing could stop them
    [killed] = study.arm_runs()
    assert killed.info.status == "RUNNING"
    rc, out = study.run("factor/multi_stream=on", "repetition=0", "resume=true", *SMALL)
    assert rc == 0, out[-3000:]
    client = study.client()
    ended = client.get_run(killed.info.run_id)
    assert ended.info.status == "FAILED", out[-3000:]
    assert "orchestrator process" in ended.data.tags["failure_reason"]
    assert f"pid {proc.pid}" in ended.data.tags["failure_reason"]
    assert client.get_run(killed.data.tags["mlflow.parentRunId"]).info.status == "FAILED"
    assert sorted(r.info.status for r in study.arm_runs()) == ["FAILED", "FINISHED"]
    assert not study.live_servers() and not study.listening() and not study.pid_files()


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["before the first arm", "between arms"])
def test_sigint_inherited_ignored_is_honoured_in_every_phase(study, moment):
    """A background job of a script inherits SIGINT ignored. The rule (orchestrator/run/interrupts.py):
    SIGINT and SIGTERM are honoured anyway, in every phase; before, a SIGINT before the first arm or
    between arms was dropped while one during an arm stopped the study."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "-m", *study.base_overrides(), "factor/multi_stream=on",
         "repetition=0,1", *SMALL],
        cwd=study.root, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    study.procs.append(proc)
    if moment == "before the first arm":
        wait_for(lambda: (study.sweep_dir / "multirun.log").exists(), 60, "the sweep to begin", proc)
    else:
        progress = study.sweep_dir / ".heisenhunt" / "progress" / "0.json"
        wait_for(lambda: progress.exists() and '"done"' in progress.read_text(), 120, "arm 0 to end", proc)
    proc.send_signal(signal.SIGINT)
    out = finish(proc, 120)
    assert proc.returncode == 130, out[-3000:]
    # the signal may land a moment later than aimed (in the next arm's start: one that came while Hydra
    # composed that arm's config is handed back once the composing is done, run/interrupts.py): that arm
    # is then KILLED, and the last line says which arm was stopped
    # one that landed while the next arm's MLflow run was created waits until it is, and says so (CI at
    # 316548b: "signal 2 (held during the teardown)", which named the wrong phase)
    stopped = re.search(
        r"heisenhunt: signal 2(?: \(held during the creation of its MLflow run\))?: stopped arm", out
    )
    assert "heisenhunt: interrupted" in out or stopped, out[-3000:]
    statuses = [r.info.status for r in study.arm_runs()]
    done = [] if moment == "before the first arm" else ["FINISHED"]
    assert statuses in (done, [*done, "KILLED"]), out[-3000:]
    assert not study.live_servers() and not study.listening()
