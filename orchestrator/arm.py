"""One arm end to end, as plain functions: a pure `prepare` step and `run_arm`, which takes its side
effects (transports, tracker, workload) from the caller.

    prepare(job, finished)  -> ArmStart (or a skip, on resume): validate, plan, resume check. Pure.
    run_arm(plan, transports, tracker, workload, ...): preflight on the hosts -> co-restart the PD
        deployment -> stress workload -> throughput sweep -> logs; teardown is one ExitStack.

A failed arm is data: it becomes a FAILED run with its reason and the sweep goes on. An interrupt
(Ctrl-C, SIGTERM) tears everything down, keeps what was measured, marks the run KILLED and stops. Bad
input that a host catches before any restart (PreflightError) ends the run FAILED and stops the sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from orchestrator.config.plan import ArmPlan, arm_label, plan_arm, server_url
from orchestrator.config.redact import redact_text
from orchestrator.config.schema import SERVER_ROLES, JobConf, LeaseConf
from orchestrator.remote import close_all
from orchestrator.remote.base import Transport
from orchestrator.run.deploy import DeployError, Deployment, http_get
from orchestrator.run.lease import Holder, LeaseHeld, cluster_leases, hosts_held
from orchestrator.run.observe import parse_decode_log
from orchestrator.run.preflight import (
    Expected,
    PreflightError,
    check_arm_on_hosts,
    confirm_server_args,
    gpu_memory_used,
    host_provenance,
)
from orchestrator.run.progress import NO_PROGRESS, TERMINAL, ProgressSink
from orchestrator.workload.client import INTERRUPT_SIGNALS
from orchestrator.workload.decode_load import DecodeLoad, DecodeLoadMonitor, planned_concurrency

log = logging.getLogger("orchestrator")

# the stress seed of repetition r is seed + r * REPETITION_SEED_STRIDE: repetitions see other tasks
REPETITION_SEED_STRIDE = 7919


# --- prepare (pure) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmStart:
    """A job that is to run: its plan, and how it is labelled and recorded."""

    plan: ArmPlan
    label: str
    repetition: int
    study: str
    lease: LeaseConf = field(default_factory=LeaseConf)

    def log_label(self, run_id: str) -> str:
        """Names this start's logs on the hosts: every start has its own (never appended to)."""
        return f"{self.study}-{self.plan.signature}-r{self.repetition}-{run_id[:12]}"


@dataclass(frozen=True)
class ArmSkip:
    """A job resume skips: its (signature, repetition) already has a FINISHED run."""

    label: str
    signature: str
    repetition: int

    def summary(self) -> dict[str, Any]:
        return {
            "status": "SKIPPED",
            "signature": self.signature,
            "repetition": self.repetition,
            "arm": self.label,
        }


def prepare(job: JobConf, finished: set[tuple[str, int]]) -> ArmStart | ArmSkip:
    """What to do with a (validated) job, given the study's FINISHED (signature, repetition) pairs."""
    plan = plan_arm(job)
    label = arm_label(plan.factors, job.study.baseline)
    if job.resume and (plan.signature, job.repetition) in finished:
        return ArmSkip(label=label, signature=plan.signature, repetition=job.repetition)
    return ArmStart(
        plan=plan, label=label, repetition=job.repetition, study=job.study.name, lease=job.cluster.lease
    )


# --- the workload, as the arm sees it ------------------------------------------------------------------


class Tracker(Protocol):
    """What run_arm records through (tracking.ArmTracker; tests may pass another recorder)."""

    run_id: str

    def __enter__(self) -> Tracker: ...
    def __exit__(self, *exc: Any) -> bool: ...
    def fail(self, reason: str, log_tail: str = "") -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def log_provenance(self, role: str, info: Mapping[str, Any]) -> None: ...
    def log_startup(self, seconds_by_role: Mapping[str, float]) -> None: ...
    def log_stress(self, summary: Any, out_dir: Path | None) -> None: ...
    def log_bench(self, result: Any, out_dir: Path | None) -> None: ...
    def log_facts(self, facts: Any) -> None: ...
    def log_held(self, seconds: float) -> None: ...


class Workload(Protocol):
    """What is measured on a healthy deployment; it logs through the tracker as it goes."""

    def measure(self, plan: ArmPlan, deployment: Deployment, tracker: Tracker, out_dir: Path) -> None: ...


def carries_bench(plan: ArmPlan, repetition: int) -> bool:
    """Whether this repetition of the arm runs the throughput sweep (`bench.repetitions`)."""
    wanted = plan.bench.repetitions
    return plan.bench.enabled and (wanted is None or repetition in wanted)


@dataclass(frozen=True)
class StressThenBench:
    """The standard workload: the tool-calling stress reproducer, then (if enabled) the throughput sweep,
    with the plan's workload and bench settings. A server that dies meanwhile fails the arm. `progress`
    hears the phase and every session's outcome (the terminal's display, run/progress.py)."""

    repetition: int = 0
    progress: ProgressSink = NO_PROGRESS

    def measure(self, plan: ArmPlan, deployment: Deployment, tracker: Tracker, out_dir: Path) -> None:
        from orchestrator.workload.bench import bench_config, run_bench_sync
        from orchestrator.workload.stress import run_stress_sync, stress_settings, summarize_jsonl

        stress_dir = out_dir / "stress"
        w = plan.workload
        monitor = decode_load_monitor(plan)  # the decode's load while the sessions run
        self.progress.phase("stress")
        self.progress.sessions_planned(w.sessions)
        try:
            # the rest of the workload section flows through by field name
            given = dict(
                url=plan.router_url,
                out_dir=stress_dir,
                model=plan.served_model,
                concurrency=w.concurrency or None,
                seed=w.seed + self.repetition * REPETITION_SEED_STRIDE,
                # the sweep's display shows the sessions (one live display on a terminal, not two)
                progress=None if self.progress is NO_PROGRESS else False,
            )

            def server_gone() -> str | None:
                return f"{role} is no longer running" if (role := deployment.dead_role()) else None

            if w.oracle == "reproducer":  # the user's own reproducer judges the sessions
                from orchestrator.workload.reproducer import reproducer_settings, run_reproducer_sync

                summary = run_reproducer_sync(
                    reproducer_settings(w, **given), server_gone=server_gone, on_outcome=self.progress.session
                )
            else:
                summary = run_stress_sync(
                    stress_settings(w, **given),
                    server_gone=server_gone,
                    on_outcome=self.progress.session,
                    on_phase=self.progress.phase,
                )
            decode_load = monitor.stop()
        except BaseException:
            decode_load = monitor.stop()
            # whatever completed before the interrupt or crash is kept, marked partial by its counts
            partial = summarize_jsonl(stress_dir / "sessions.jsonl", planned=w.sessions, oracle=w.oracle)
            tracker.log_stress(partial, stress_dir)
            log_decode_load(tracker, decode_load, stress_dir)
            raise
        tracker.log_stress(summary, stress_dir)
        log_decode_load(tracker, decode_load, stress_dir)
        deployment.check_alive("the stress workload")
        if carries_bench(plan, self.repetition):
            b = plan.bench
            self.progress.phase("bench")
            bench_dir = out_dir / "bench"
            # the rest of the bench section flows through by field name
            config = bench_config(
                b, url=plan.router_url, model=plan.served_model, concurrency_levels=b.concurrency
            )
            result = run_bench_sync(config, out_dir=bench_dir)
            tracker.log_bench(result, bench_dir)
            deployment.check_alive("the throughput sweep")


# --- the decode's load during the stress run ----------------------------------------------------------


def decode_load_monitor(plan: ArmPlan) -> DecodeLoadMonitor:
    """A started poller of the decode's `/metrics` for this arm's stress run
    (orchestrator.workload.decode_load), against the sessions the workload runs at once."""
    w = plan.workload
    url = server_url(plan.roles["decode"].host) + "/metrics"
    return DecodeLoadMonitor(url, planned_concurrency(w.sessions, w.concurrency or None)).start()


def log_decode_load(tracker: Tracker, load: DecodeLoad, out_dir: Path | None) -> None:
    """Record the decode's load; never fails the arm (a tracker without `log_decode_load`, such as a
    test's recorder, skips it)."""
    if load.measured:
        log.info(
            "decode load during the stress run: mean %.1f, p50 %.1f, max %.0f of %d planned (%d samples)%s",
            load.mean,
            load.p50,
            load.max,
            load.planned,
            len(load.samples),
            " - short of the planned concurrency" if load.short else "",
        )
    record = getattr(tracker, "log_decode_load", None)
    if record is None:
        return
    try:
        record(load, out_dir)
    except Exception as e:
        log.warning("could not record the decode load: %s", e)


# --- signals -------------------------------------------------------------------------------------------


class InterruptGuard:
    """SIGINT and SIGTERM while an arm runs.

    The first one raises KeyboardInterrupt, so the arm's teardown runs. Any later one (an impatient
    second Ctrl-C) is logged and ignored until the arm is done: it must not cut the teardown short and
    leave servers running. A signal that arrives during the teardown of an arm that ended on its own is
    held and raised once the arm is recorded (`raise_pending`), so it still stops the sweep.
    """

    SIGNALS = INTERRUPT_SIGNALS

    def __init__(self) -> None:
        self.fired = False
        self.holding: str | None = None  # what the shield protects now ("teardown"), if anything
        self.pending: int | None = None
        self.held_during = ""  # what the pending signal waited for: the message names it
        self.depth = 0  # installs of this guard, one inside the other (the job's, then the arm's)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.fired:
            self.pending = self.pending or signum
            log.warning("signal %d ignored: stopping the servers first", signum)
            return
        if self.holding is not None:
            if self.pending is None:
                self.pending, self.held_during = signum, self.holding
            log.warning("signal %d held until the %s is done", signum, self.holding)
            return
        self.fired = True
        raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[InterruptGuard]:
        """The guard's handlers while the block runs. When the outermost install ends, a signal it held
        and nothing raised since (the arm ended on an error after its teardown) is raised: it still
        stops the sweep."""
        if self.depth:  # installed already, by the caller
            yield self
            return
        try:
            previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        except ValueError:  # not the main thread (some launchers): signals keep their defaults
            yield self
            return
        self.depth += 1
        try:
            yield self
        finally:
            self.depth -= 1
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.raise_pending()

    @contextlib.contextmanager
    def shield(self, during: str = "teardown") -> Iterator[None]:
        """Hold signals while the block runs; `during` names it in the warning and the interrupt."""
        self.holding = during
        try:
            yield
        finally:
            self.holding = None

    def raise_pending(self) -> None:
        if self.pending is not None and not self.fired:
            self.fired = True
            raise KeyboardInterrupt(f"signal {self.pending} (held during the {self.held_during})")


# --- execute -------------------------------------------------------------------------------------------


def run_arm(
    start: ArmStart,
    transports: Mapping[str, Transport],
    tracker: Tracker,
    workload: Workload,
    out_dir: Path,
    on_event: Callable[[str], None] = log.info,
    holder: Holder | None = None,
    progress: ProgressSink = NO_PROGRESS,
    guard: InterruptGuard | None = None,
) -> dict[str, Any]:
    """Run one prepared arm on its hosts and record it; returns the job's summary. The tracker's run
    ends here (FINISHED, FAILED or KILLED) and the transports are closed. `holder`: the lease holder that
    already took this cluster's host leases (a pool's pick, pool.py); the arm holds them under it.
    `progress` hears the arm's phases and how it ended (the workload reports the sessions). `guard`: the
    caller's, where it already guards the run's creation (else one of the arm's own)."""
    guard = guard or InterruptGuard()
    with guard.installed():
        try:
            summary = _run_arm(
                start, transports, tracker, workload, out_dir, on_event, holder, progress, guard
            )
        except (PreflightError, LeaseHeld) as e:
            progress.finish("REFUSED", str(e))
            raise
        except Exception as e:
            progress.finish("FAILED", f"{type(e).__name__}: {e}")
            raise
        except BaseException:
            progress.finish("KILLED")
            raise
        progress.finish(summary["status"], summary.pop("reason"))
        guard.raise_pending()  # a signal held during the teardown of an arm that ended on its own
        return summary


def _run_arm(
    start: ArmStart,
    transports: Mapping[str, Transport],
    tracker: Tracker,
    workload: Workload,
    out_dir: Path,
    on_event: Callable[[str], None],
    holder: Holder | None,
    progress: ProgressSink,
    guard: InterruptGuard,
) -> dict[str, Any]:
    plan = start.plan
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("arm %s, repetition %d, signature %s", start.label, start.repetition, plan.signature)
    status, reason = "FINISHED", ""
    with tracker, contextlib.ExitStack() as teardown:
        teardown.callback(close_all, transports)
        try:
            expected = host_checks(plan, transports, tracker)
        except PreflightError as e:
            # bad input the hosts caught: nothing was stopped or restarted; the run says why, the sweep stops
            tracker.fail(str(e))
            raise
        except Exception as e:  # a host that could not be asked (its SSH connection cut): this arm failed,
            # with nothing stopped or started; the sweep goes on (fault campaign seed 33, ssh, 4 at once)
            reason = f"could not check the arm on its hosts: {type(e).__name__}: {e}"
            log.error("arm %s failed: %s", start.label, reason)
            tracker.fail(reason)
            return _summary(start, tracker.run_id, "FAILED", reason)
        # the cluster is this arm's from before the first stop until after the last one
        holder = holder or Holder.this_process(
            f"study {start.study}, arm {start.label} #{start.repetition} (MLflow run {tracker.run_id})"
        )
        work_dirs = {role: rp.host.work_dir for role, rp in plan.roles.items()}

        def waiting(message: str) -> None:
            # a wait on another study's lease reaches the terminal: the display alone would seem stuck
            log.info(message, extra=TERMINAL)
            if on_event is not log.info:
                on_event(message)

        try:
            teardown.enter_context(
                hosts_held(cluster_leases(transports, work_dirs), holder, start.lease, waiting)
            )
        except LeaseHeld as e:
            tracker.fail(str(e))
            raise
        except Exception as e:  # a host that cannot record the lease (its disk full): this arm failed, and
            # nothing was stopped or started, since the cluster is not provably this arm's
            reason = f"could not take the cluster's lease: {type(e).__name__}: {e}"
            log.error("arm %s failed: %s", start.label, reason)
            tracker.fail(reason)
            return _summary(start, tracker.run_id, "FAILED", reason)
        deployment = Deployment(
            plan, transports, run_label=start.log_label(tracker.run_id), on_event=on_event
        )
        teardown.callback(_teardown, guard, deployment, out_dir, tracker)
        teardown.callback(progress.phase, "teardown")  # (callbacks run last first: before the stop)
        try:
            deployment.co_restart()
            tracker.log_startup(deployment.startup_s)
            confirm_running_args(plan, expected, tracker)
            workload.measure(plan, deployment, tracker, out_dir)
        except DeployError as e:
            log.error("arm %s failed: %s", start.label, e)
            tracker.fail(str(e).splitlines()[0], e.log_tail)
            status, reason = "FAILED", str(e).splitlines()[0]
        except Exception as e:  # failures are data: record this arm and let the sweep go on
            log.exception("arm %s failed", start.label)
            tracker.fail(f"{type(e).__name__}: {e}")
            status, reason = "FAILED", f"{type(e).__name__}: {e}"
    return _summary(start, tracker.run_id, status, reason)


def _summary(start: ArmStart, run_id: str, status: str, reason: str) -> dict[str, Any]:
    return {
        "status": status,
        "signature": start.plan.signature,
        "repetition": start.repetition,
        "arm": start.label,
        "run_id": run_id,
        "reason": reason,
    }


def host_checks(plan: ArmPlan, transports: Mapping[str, Transport], tracker: Tracker) -> Expected:
    """The hosts check the arm (again: a host may have changed since the sweep began) and say what
    they run, before anything is restarted. Returns what each factor-set flag must read on the running
    servers (`confirm_running_args`)."""
    expected, identities = check_arm_on_hosts(plan, transports)
    for role in SERVER_ROLES:
        host = plan.roles[role].host
        info = host_provenance(
            transports[role], host.python, host.server_checkout, identity=identities.get(role)
        )
        tracker.log_provenance(role, dataclasses.asdict(info))
    return expected


def server_info(base_url: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """A server's own view of its arguments: `/server_info`, else the deprecated `/get_server_info`
    (older sglang); None where neither answers with a JSON object."""
    for path in ("/server_info", "/get_server_info"):
        status, body = http_get(base_url + path, timeout=timeout_s, limit=8 << 20)
        if status == 200:
            try:
                info = json.loads(body)
            except json.JSONDecodeError:
                return None
            return info if isinstance(info, dict) else None
    return None


def confirm_running_args(
    plan: ArmPlan,
    expected: Expected,
    tracker: Tracker,
    fetch: Callable[[str], dict[str, Any] | None] = server_info,
) -> None:
    """After start-up, each server says which arguments are in effect; a flag a factor set that the
    server did not take fails the arm (DeployError), since the arm would not test what it is labelled
    with. What could not be confirmed is logged and recorded (`provenance.<role>.args_unconfirmed`)."""
    infos = {role: fetch(server_url(plan.roles[role].host)) for role, flags in expected.items() if flags}
    problems, notes = confirm_server_args(plan, expected, infos)
    for role, flags in expected.items():
        if flags:
            unconfirmed = [n for n in notes if n.startswith(f"{role}: ")]
            tracker.log_provenance(
                role,
                {
                    "args_checked": ",".join(flags),
                    "args_unconfirmed": "; ".join(unconfirmed),
                },
            )
    for note in notes:
        log.warning("server arguments: %s", note)
    if problems:
        raise DeployError("server arguments", "; ".join(problems))


def _teardown(guard: InterruptGuard, deployment: Deployment, out_dir: Path, tracker: Tracker) -> None:
    """Stop every server, keep their logs, show the GPUs were freed; signals wait until it is done."""
    with guard.shield():
        problems = deployment.stop_all()
        if deployment.held_since is not None:  # the GPU time this run held (analysis/cost.py)
            tracker.log_held(time.monotonic() - deployment.held_since)
        collect_logs(deployment, out_dir, tracker)
        gpus_after_teardown(deployment.transports, tracker)
    if problems:
        log.error("teardown problems: %s", problems)


def gpus_after_teardown(transports: Mapping[str, Transport], tracker: Tracker) -> None:
    """GPU memory in use after teardown, per server host: shows the GPUs were freed (None: no GPUs)."""
    for role in SERVER_ROLES:
        try:
            used = gpu_memory_used(transports[role])
        except Exception as e:
            log.warning("could not read GPU memory on %s after teardown: %s", role, e)
            continue
        if used is not None:
            tracker.log_provenance(role, {"gpu_memory_used_after_teardown_mib": used})


def collect_logs(deployment: Deployment, out_dir: Path, tracker: Tracker) -> None:
    """Fetch every role's log of this arm into the job dir, attach them, parse the decode log."""
    logs_dir = out_dir / "server_logs"
    logs_dir.mkdir(exist_ok=True)
    for role, transport in deployment.transports.items():
        try:
            text = transport.read_file(deployment.paths(role).log).decode(errors="replace")
        except (FileNotFoundError, OSError) as e:
            log.warning("no %s log to fetch: %s", role, e)
            continue
        text = redact_text(text, deployment.plan.roles[role].secrets)
        target = logs_dir / f"{role}.log"
        target.write_text(text)
        tracker.log_artifact(target, "server_logs")
        if role == "decode":
            tracker.log_facts(parse_decode_log(text))
