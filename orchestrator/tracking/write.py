"""MLflow written: the study's parent run and one child run per arm (`ArmTracker`), over the layout in
`tracking.layout`. Takes typed values (`config.schema`, `config.plan.ArmPlan`) only; the Hydra callback
that drives the parent run is `report.pipeline`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrator.analysis.stats import clopper_pearson
from orchestrator.config.plan import ArmPlan, arm_label, flag_words
from orchestrator.config.redact import REDACTED, is_secret_name, redact_argv, redact_env, redact_text
from orchestrator.config.schema import StudyConf, TrackingConf
from orchestrator.tracking.layout import (
    ARMS_VIEW,
    CORRUPTED,
    DEPLOYMENT_COST_TAG,  # noqa: F401 - the report pipeline tags the study run with it
    HELD,
    KIND,
    LAUNCH_ARTIFACT,
    MAX_PARAM,
    MAX_TAG,
    NOTE_TAG,
    PARENT_ENV,
    PARENT_FILE,
    PARENT_TAG,
    PLANNED_ARTIFACT,
    RATE,
    SESSIONS,
    VIEW_TAG,
    is_tracking_server,
    make_client,
)
from orchestrator.tracking.outbox import OutboxClient, deliver_all
from orchestrator.workload import decode_load
from orchestrator.workload.bench import bench_to_dict
from orchestrator.workload.detect import FAMILIES, ORACLES
from orchestrator.workload.results import BenchResult, LogFacts, StressSummary

log = logging.getLogger(__name__)
# MLflow 3 opens an experiment of this kind on its runs rather than on the GenAI overview
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
RATE_CI_LOW, RATE_CI_HIGH = "arm.rate_ci_low", "arm.rate_ci_high"


def artifact_location_for(tracking: TrackingConf) -> str | None:
    """Where a new experiment keeps its artifacts: `tracking.artifact_location`, else, for a sqlite file,
    `mlruns/` beside that file (None: the server's or MLflow's own default). MLflow's own default is
    `./mlruns` under whatever directory the process runs in: a study resumed from another directory, or
    a test whose store is under its tmp_path, would spread one store's artifacts over several places."""
    if tracking.artifact_location:
        return tracking.artifact_location
    path = tracking.sqlite_file
    if not path or path.startswith(":memory:"):
        return None
    return str(Path(path).absolute().parent / "mlruns")


def ensure_experiment(
    client: MlflowClient, name: str, artifact_location: str | None = None, factors: Iterable[str] = ()
) -> str:
    """The id of the experiment `name`, created if missing (safe when jobs race to create it), tagged to
    open on its runs, with the arms view for `factors` (rewritten when the factors change)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        with contextlib.suppress(MlflowException):  # another job created it first
            client.create_experiment(
                name,
                artifact_location=artifact_location or None,
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise LookupError(f"MLflow experiment {name!r} could not be created")
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}  # also on experiments made before this tag existed
    if factors:
        tags[VIEW_TAG + ARMS_VIEW] = arms_view(factors)
    for key, value in tags.items():
        if exp.tags.get(key) != value:
            client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def _column(kind: str, key: str) -> str:
    return f"{kind}.`{key}`"  # the runs table's column id


def view_factors(study: StudyConf, plan_factors: Iterable[str] = ()) -> list[str]:
    """The factors the arms view shows: those the study's hypotheses vary, else every factor."""
    return sorted({h.factor for h in study.hypotheses} or set(plan_factors))


def arms_view(factors: Iterable[str]) -> str:
    """The saved runs view (an experiment tag's value, as MLflow's "Views" menu stores it): the arm runs
    grouped by arm (expanded, not folded under their parent run), newest first, the run name whole, then
    the outcome and a column per factor."""
    run_name, factors = _column("attributes", "Run Name"), sorted(factors)
    # the outcome next to the run name (which names the levels that differ from the baseline), then the
    # factors: the MLflow Assistant's panel leaves the table ~700 px of a 1280 px screen
    columns = [
        *(_column("metrics", key) for key in (RATE, CORRUPTED, SESSIONS)),
        *(_column("params", f"factor.{name}") for name in factors),
    ]
    state = {
        "searchFilter": f"tags.`{KIND}` = 'arm'",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        "selectedColumns": columns,
        "columnOrder": [run_name, *columns],
        # wide enough for each header (~9 px a character): a factor column's values are short levels
        "columnWidths": {run_name: 260}
        | {_column("params", f"factor.{name}"): 9 * len(f"factor.{name}") + 24 for name in factors},
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "arm"}]},
    }
    return json.dumps(
        {"name": "arms: factors and corruption", "createdAt": 0, "updatedAt": 0, "state": json.dumps(state)}
    )


def arms_view_url(ui: str, experiment_id: str) -> str:
    """The UI address of the experiment's arms view, e.g. arms_view_url("http://127.0.0.1:5000", "1")."""
    query = f"viewStateShareKey={ARMS_VIEW}&workflowType=machine_learning"
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def ui_hint(uri: str, study: str) -> str:
    """Where to look at a study's arms in the MLflow UI: the tracking server itself, or the `mlflow ui`
    to start over a local store."""
    exp = make_client(uri).get_experiment_by_name(study)
    if exp is None:
        return ""
    if is_tracking_server(uri):
        return f"arms in the MLflow UI: {arms_view_url(uri, exp.experiment_id)}"
    return (
        f"arms in the MLflow UI: `mlflow ui --backend-store-uri {shlex.quote(uri)}`, then "
        f"{arms_view_url('http://127.0.0.1:5000', exp.experiment_id)}"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


def _digits(x: float) -> float:
    return float(f"{x:.4g}")


def _flatten(prefix: str, node: Any) -> dict[str, str]:
    """Dotted params of a config section; a reproducer's secret-looking keyword argument (`call.api_key`)
    and secret flag's value (its `command`'s `--token X`) are recorded as ***."""
    if isinstance(node, Mapping):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flatten(f"{prefix}.{key}", value))
        return out
    if prefix.startswith(REPRODUCER_KEYS) and node is not None:
        if isinstance(node, list | tuple):
            node = redact_argv(node)
        elif is_secret_name(prefix.rsplit(".", 1)[-1]):
            node = REDACTED
    return {prefix: "null" if node is None else str(node)}


# the reproducer's callable's keyword arguments and its argv: the params where a user's credentials may be
REPRODUCER_KEYS = ("workload.call.", "workload.command")


# --- parent run: the study callback ----------------------------------------------------------------


def end_run_failed(uri: str, run_id: str, reason: str) -> None:
    """End a run FAILED now with its (already redacted) reason: a sweep refused before any job ran (MLflow
    shows why the parent run is empty), or a run whose orchestrator died (run/orphans.py)."""
    client = make_client(uri)
    client.set_tag(run_id, "failure_reason", reason[:MAX_TAG])
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))


def tag_run(uri: str, run_id: str, tags: Mapping[str, str]) -> None:
    """Tags on a run, ended or not (where the arm ran, when its lease ended)."""
    client = make_client(uri)
    client.log_batch(run_id, tags=[RunTag(k, str(v)[:MAX_TAG]) for k, v in tags.items()])


def end_lost_run(uri: str, run_id: str, reason: str, lost_at: str) -> bool:
    """End the run of an arm whose holder was lost (pool.py) FAILED with the reason, if it is still
    RUNNING (a holder may die after its run ended); False when it had ended."""
    client = make_client(uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return False
    tag_run(uri, run_id, {"failure_reason": reason, "lease.end": lost_at, "lease.lost": reason})
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
    return True


def parent_run_id(explicit: str | None, sweep_dir: str | None) -> str | None:
    """The sweep's parent run: `explicit` (the job's parent_run_id) if set, else $HEISENHUNT_PARENT_RUN_ID,
    else the file in the sweep dir, else None (a job run on its own)."""
    if explicit:
        return explicit
    if os.environ.get(PARENT_ENV):
        return os.environ[PARENT_ENV]
    if sweep_dir and (Path(sweep_dir) / PARENT_FILE).is_file():
        return (Path(sweep_dir) / PARENT_FILE).read_text().strip() or None
    return None


def start_study_run(
    tracking: TrackingConf,
    study: StudyConf,
    sweep_dir: Path,
    design: str,
    overrides: list[str],
    conditions: Mapping[str, str] | None = None,
    resume: bool = False,
    extra_tags: Mapping[str, str] | None = None,
) -> str:
    """The parent run of a sweep (left RUNNING), with the study definition attached; its id is left in
    the sweep dir for the jobs. `overrides` must already be redacted. `conditions`: the sweep's
    measurement conditions (plan.measurement_conditions), which pick today's arms in the report;
    `resume`: the sweep continues earlier ones (their FINISHED runs of the planned jobs count)."""
    client = make_client(tracking.uri)
    exp_id = ensure_experiment(client, study.name, artifact_location_for(tracking), view_factors(study))
    tags = {
        KIND: "study",
        "study": study.name,
        "sweep_dir": str(sweep_dir),
        "design": design,
        "overrides": json.dumps(overrides)[:MAX_TAG],
        "conditions": json.dumps(dict(conditions or {}), sort_keys=True),
        "resume": str(bool(resume)).lower(),
        NOTE_TAG: study.description[:MAX_TAG],
        **(extra_tags or {}),
    }
    # the experiment already names the study: the sweep dir's name (its start time) is short and whole
    run = client.create_run(exp_id, tags=tags, run_name=sweep_dir.name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "study.json"
        path.write_text(json.dumps(study.to_dict(), indent=1, sort_keys=True))
        client.log_artifact(run.info.run_id, str(path), "study")
    (sweep_dir / PARENT_FILE).parent.mkdir(parents=True, exist_ok=True)
    (sweep_dir / PARENT_FILE).write_text(run.info.run_id + "\n")
    return run.info.run_id


def record_planned(uri: str, run_id: str, jobs: list[tuple[str, int]]) -> None:
    """The (signature, repetition) of every job the sweep planned, as `study/planned.json`: a resumed
    sweep's report counts the earlier FINISHED runs of exactly these jobs."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / PLANNED_ARTIFACT.rsplit("/", 1)[1]
        path.write_text(json.dumps(sorted(set(jobs))))
        make_client(uri).log_artifact(run_id, str(path), PLANNED_ARTIFACT.rsplit("/", 1)[0])


def log_look(uri: str, run_id: str, look: Any) -> None:
    """A sequential study's look on its parent run: per hypothesis and claim its log e-value, with the
    round as the step, so the MLflow UI plots the evidence over rounds (`sequential.Look`)."""
    from mlflow.entities import Metric

    stamp = _now_ms()
    metrics = [
        Metric(f"evidence.{h}.{claim}", float(value), stamp, look.round)
        for h, ev in look.evidence.items()
        for claim, value in ev.as_dict().items()
    ]
    metrics += [
        Metric("sequential.icc", float(look.icc), stamp, look.round),
        Metric("sequential.sessions", float(look.sessions), stamp, look.round),
        Metric(
            "sequential.decided",
            float(sum(d.verdict is not None for d in look.decisions.values())),
            stamp,
            look.round,
        ),
    ]
    make_client(uri).log_batch(run_id, metrics=metrics)


def end_study_run(
    uri: str,
    run_id: str,
    paths: list[Path],
    failure: str | None = None,
    headline: str | None = None,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Attach the report files and end the parent run: FINISHED, or FAILED with `failure`. The report's
    `headline` becomes the first paragraph of the run's description, above the study's; `metrics` (the
    study's GPU hours, starts, sessions) are logged on it, so the UI compares studies by what they cost."""
    client = make_client(uri)
    if metrics:
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    for path in paths:
        client.log_artifact(run_id, str(path), "report")
    if headline:
        description = client.get_run(run_id).data.tags.get(NOTE_TAG, "")
        client.set_tag(run_id, NOTE_TAG, f"{headline}\n\n{description}".strip()[:MAX_TAG])
    if failure:
        client.set_tag(run_id, "failure_reason", failure[:MAX_TAG])
    status = RunStatus.FAILED if failure else RunStatus.FINISHED
    client.set_terminated(run_id, RunStatus.to_string(status))


def end_run_abandoned(uri: str, run_id: str) -> None:
    """A parent run still RUNNING when its sweep ended without its end callback: KILLED, saying so."""
    client = make_client(uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return  # already ended with its reason (e.g. the sweeper refused the sweep: FAILED)
    client.set_tag(run_id, "failure_reason", "the multirun ended before on_multirun_end")
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))


# --- child runs: one per arm -----------------------------------------------------------------------


def launch_record(plan: ArmPlan) -> dict[str, dict[str, Any]]:
    """Per role: the launch argv and flags (shell words), and the origin of each env var and flag (which
    factor level, the deployment or the cluster set it). Stored as `launch/launch.json`, redacted."""
    return {
        role: {
            "argv": shlex.join(rp.argv),
            "flags": shlex.join(flag_words(rp.flags)),
            "origin": dict(rp.origin),
        }
        for role, rp in sorted(plan.roles.items())
    }


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
Held = tuple[dict[int, Any], list[int]]


def _hold_interrupts() -> Held | None:
    """Note SIGINT and SIGTERM instead of acting on them, until `_release_interrupts`: Python's handlers,
    not the thread's signal mask (the kernel hands a process's signal to any thread that does not block
    it, and Python then runs the handler in the main thread all the same). None off the main thread,
    where handlers cannot be set (and never run)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum)) for sig in INTERRUPTS}
    return previous, caught


def _release_interrupts(held: Held | None, drop: bool = False) -> None:
    """Put the handlers back, and raise again the first signal that came meanwhile (its own handler runs
    now, here), unless `drop`: an interrupt is already on its way."""
    if held is None:
        return
    previous, caught = held
    for sig, handler in previous.items():
        if handler is not None:  # None: a handler set outside Python, which signal.signal cannot put back
            signal.signal(sig, handler)
    if caught and not drop:
        signal.raise_signal(caught[0])


class WholeCalls:
    """An MlflowClient whose calls a SIGINT or SIGTERM does not cut: the signal waits until the call
    returns (or fails), then is raised. An interrupt inside a sqlite commit left the store's connection
    mid-transaction, and every later write of the process failed "database is locked" (found by the
    fault campaign: a SIGINT in preflight as the host checks were tagged; the study went on, failing one
    arm after another). Not used over HTTP: a request cut short leaves the server's store whole, and a
    server that is down must not make Ctrl-C wait out the client's retries."""

    def __init__(self, client: MlflowClient):
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def whole(*args: Any, **kwargs: Any) -> Any:
            held = _hold_interrupts()
            try:
                result = attr(*args, **kwargs)
            finally:
                _release_interrupts(held)  # a signal that came meanwhile is raised here
            return result

        return whole


def outbox_root(tracking: TrackingConf, study: str) -> Path:
    return Path(tracking.outbox_dir).expanduser() / study


def deliver_outboxes(tracking: TrackingConf, study: str) -> list[str]:
    """The study's results kept while its tracking server did not answer, sent now (outbox.py); the run
    ids still kept."""
    if not is_tracking_server(tracking.uri):
        return []
    _, kept = deliver_all(make_client(tracking.uri), outbox_root(tracking, study), tracking.uri, study)
    return kept


def tracker_client(uri: str) -> MlflowClient:
    """The client an arm's run is written through: `WholeCalls` but over HTTP."""
    client = make_client(uri)
    return client if is_tracking_server(uri) else WholeCalls(client)  # type: ignore[return-value]


class ArmTracker:
    """One MLflow child run per arm x repetition. Use as a context manager:

        with ArmTracker.start(tracking, study, plan, repetition, parent_id) as tracker:
            tracker.log_stress(summary, out_dir) ...

    On exit: FINISHED, or KILLED on KeyboardInterrupt/SystemExit, or FAILED on any other exception
    (the reason recorded, the exception re-raised). `fail()` ends it FAILED early; later calls still log.
    """

    def __init__(self, client: MlflowClient, run_id: str, secrets: Mapping[str, str]):
        self.client = client
        self.run_id = run_id
        self._secrets = dict(secrets)
        self._ended = False
        self.status: str = "RUNNING"
        # held until the arm's outcome is logged: the compare view's chart plots a run's first metric
        self._startup: dict[str, float] = {}
        self._outcome_logged = False

    @classmethod
    def start(
        cls,
        tracking: TrackingConf,
        study: StudyConf,
        plan: ArmPlan,
        repetition: int,
        parent_run_id: str | None,
        extra_tags: Mapping[str, str] | None = None,
    ) -> ArmTracker:
        """The arm's run, created RUNNING with its tags (and `extra_tags`, there from its first moment:
        the owner process of run/orphans.py), its params logged."""
        client = tracker_client(tracking.uri)
        if is_tracking_server(tracking.uri):
            outbox = outbox_root(tracking, study.name)
            client = OutboxClient(client, outbox, tracking.uri, study.name, log.warning)
        factors = view_factors(study, plan.factors)
        exp_id = ensure_experiment(client, study.name, artifact_location_for(tracking), factors)
        label = arm_label(plan.factors, study.baseline)
        tags = {
            KIND: "arm",
            "study": study.name,
            "signature": plan.signature,
            "repetition": str(int(repetition)),
            "arm": label,
            "outcomes": "none",
            "conditions": json.dumps(plan.conditions, sort_keys=True),
        }
        if parent_run_id:
            tags[PARENT_TAG] = parent_run_id
        tags.update(extra_tags or {})
        # an interrupt while the run is created waits until a tracker holds it, which then ends it KILLED
        # (found by the fault campaign, seed 600203567: a SIGINT inside create_run, after the store had
        # the run, left it RUNNING until the next sweep ended it FAILED)
        held = _hold_interrupts()
        try:
            run = client.create_run(exp_id, tags=tags, run_name=f"{label} #{int(repetition)}")
        except BaseException:
            _release_interrupts(held)
            raise
        tracker = cls(client, run.info.run_id, plan.secrets)
        try:
            _release_interrupts(held)  # a signal that came meanwhile is raised here
            tracker._log_params(plan)
        except (
            BaseException
        ) as e:  # (found by the fault campaign, seed 389426981: a Ctrl-C here left it RUNNING)
            tracker.__exit__(type(e), e, e.__traceback__)
            raise
        return tracker

    # params are immutable in MLflow: logged once, at start. One line each; the launch commands (many
    # lines in the compare view's table) go to an artifact.
    def _log_params(self, plan: ArmPlan) -> None:
        # (the signature is a tag: as a param it would take an axis of the compare view's chart)
        params = {f"factor.{name}": level for name, level in sorted(plan.factors.items())}
        for role, rp in sorted(plan.roles.items()):
            for name, value in sorted(redact_env(rp.env).items()):
                params[f"env.{role}.{name}"] = value
        params.update(_flatten("workload", asdict(plan.workload)))
        params.update(_flatten("bench", asdict(plan.bench)))
        items = [Param(k, self.redact(v)[:MAX_PARAM]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(LAUNCH_ARTIFACT).name
            path.write_text(json.dumps(launch_record(plan), indent=1, sort_keys=True) + "\n")
            self.log_artifact(path, str(Path(LAUNCH_ARTIFACT).parent))

    def redact(self, text: str) -> str:
        return redact_text(text, self._secrets)

    def _metrics(self, values: Mapping[str, float]) -> None:
        now = _now_ms()
        items = [
            Metric(k, float(v), now, 0)
            for k, v in values.items()
            if v is not None and float(v) == float(v) and abs(float(v)) != float("inf")
        ]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def _tags(self, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, self.redact(str(v))[:MAX_TAG]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i : i + 100])

    def log_tags(self, tags: Mapping[str, Any]) -> None:
        self._tags(tags)

    def log_provenance(self, role: str, info: Mapping[str, Any]) -> None:
        self._tags({f"provenance.{role}.{key}": value for key, value in info.items()})

    def log_startup(self, seconds_by_role: Mapping[str, float]) -> None:
        """Logged after the arm's outcome (log_stress), or at the end of the run if it has none."""
        self._startup |= {f"startup_s.{role}": s for role, s in seconds_by_role.items()}
        if self._outcome_logged or self._ended:
            self._flush_startup()

    def _flush_startup(self) -> None:
        pending, self._startup = self._startup, {}
        self._metrics(pending)

    def log_held(self, seconds: float) -> None:
        """How long the run held its servers (their GPUs): from the first start to the end of teardown."""
        self._metrics({HELD: round(seconds, 3)})

    def log_stress(self, summary: StressSummary, out_dir: Path | None) -> None:
        """Counts, rate and its exact interval; partial when fewer sessions than planned have an outcome."""
        n = summary.clean + summary.corrupted
        lo, hi = clopper_pearson(summary.corrupted, n)
        # the rate first (see _startup); rate and bounds to 4 significant digits, which the UI's cells show
        # whole (the counts beside them are exact)
        metrics: dict[str, float] = {RATE: _digits(summary.corrupted / n)} if n else {}
        metrics |= {CORRUPTED: summary.corrupted, SESSIONS: n}
        if n:
            metrics |= {RATE_CI_LOW: _digits(lo), RATE_CI_HIGH: _digits(hi)}
        metrics |= {
            "sessions_total": summary.sessions,
            "sessions_clean": summary.clean,
            "sessions_errored": summary.errored,
            "sessions_planned": summary.planned,
            "stress_duration_s": summary.duration_s,
        }
        metrics |= {f"detector.{name}": count for name, count in summary.by_detector.items()}
        # every family, counted or only noted: sessions with at least one finding of it (0 logged too,
        # so an arm without drift reads 0, not missing)
        # (the families the run's oracle judges, and any other found: a tool-call run logs no divergence)
        judged = set(ORACLES.get(summary.oracle, ())) | set(summary.by_family)
        metrics |= {f"family.{name}": summary.by_family.get(name, 0) for name in FAMILIES if name in judged}
        metrics["usage_missing_turns"] = summary.usage_missing_turns
        if summary.oracle == "divergence":  # its reference pass held the GPUs too (in stress_duration_s)
            metrics["reference_s"] = summary.reference_s
        self._metrics(metrics)
        self._outcome_logged = True
        self._flush_startup()
        self._tags({"outcomes": "partial" if summary.partial else "complete"})
        if out_dir is None:
            return
        out_dir = Path(out_dir)
        for name in ("sessions.jsonl", "summary.json", "reproducer.stderr"):
            if (out_dir / name).is_file():
                self.log_artifact(out_dir / name, "stress")
        corrupted = out_dir / "corrupted"
        if corrupted.is_dir():
            for path in sorted(corrupted.iterdir()):
                if path.is_file():
                    self.log_artifact(path, "stress/corrupted")

    def log_bench(self, result: BenchResult, out_dir: Path | None) -> None:
        metrics: dict[str, float] = {}
        for lv in result.levels:
            c = f"c{lv.concurrency}"
            metrics |= {
                f"tok_s.{c}": lv.output_tok_s,
                f"req_s.{c}": lv.request_s,
                f"errors.{c}": lv.errors,
                f"ttft_p50_s.{c}": lv.ttft_s.p50,
                f"ttft_p99_s.{c}": lv.ttft_s.p99,
                f"itl_p50_s.{c}": lv.itl_s.p50,
                f"itl_p99_s.{c}": lv.itl_s.p99,
                f"tpot_p50_s.{c}": lv.tpot_s.p50,
                f"concurrency.{c}": lv.achieved_concurrency,  # not "achieved_...": the arm.* sort first
                f"missing_usage.{c}": lv.missing_usage,
            }
        self._metrics(metrics)
        warnings = [f"c{lv.concurrency}: {w}" for lv in result.levels for w in lv.warnings]
        self._tags(
            {
                "client_bound": str(result.client_bound).lower(),
                "missing_usage": str(result.missing_usage),
                "bench": "logged",
                **({"bench_warnings": "; ".join(warnings)} if warnings else {}),
            }
        )
        path = Path(out_dir) / "bench.json" if out_dir is not None else None
        if path is not None and path.is_file():
            self.log_artifact(path, "bench")
            return
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp) / "bench.json"
            tmp_path.write_text(json.dumps(bench_to_dict(result), indent=1))
            self.log_artifact(tmp_path, "bench")

    def log_facts(self, facts: LogFacts) -> None:
        self._metrics(
            {
                "capture_batches": facts.capture_batches,
                "eager_batches": facts.eager_batches,
                "bootstrap_failures": facts.bootstrap_failures,
                "graph_capture_seen": int(facts.graph_capture_seen),
                "server_ready": int(facts.ready),
            }
        )

    def log_decode_load(self, load: decode_load.DecodeLoad, out_dir: Path | None) -> None:
        """The decode's load during the stress run (orchestrator.workload.decode_load): metrics
        `decode_load.planned` (the planned concurrency) and, when measured, `decode_load.mean|p50|max|
        samples`; tag `decode_load` (measured | unknown) and `decode_load_unknown` (why); the samples
        as `stress/decode_load.json`."""
        self._metrics(load.metrics())
        tags = {"decode_load": "measured" if load.measured else "unknown"}
        if not load.measured:
            tags["decode_load_unknown"] = load.unknown
        self._tags(tags)
        text = json.dumps(load.to_dict(), indent=1) + "\n"
        if out_dir is not None:  # kept in the job's stress dir too
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "decode_load.json").write_text(text)
            self.log_artifact(Path(out_dir) / "decode_load.json", "stress")
            return
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "decode_load.json").write_text(text)
            self.log_artifact(Path(tmp) / "decode_load.json", "stress")

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file (or a directory's files), with the arm's secret values redacted from text."""
        path = Path(path)
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file():
                    rel = child.parent.relative_to(path).as_posix()
                    sub = "/".join(p for p in (artifact_path, path.name, "" if rel == "." else rel) if p)
                    self.log_artifact(child, sub)
            return
        if not path.is_file():
            log.warning("artifact %s does not exist; not logged", path)
            return
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            text = None
        clean = self.redact(text) if text is not None else None
        if clean is None or clean == text:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
            return
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / path.name
            copy.write_text(clean)
            self.client.log_artifact(self.run_id, str(copy), artifact_path)

    def fail(self, reason: str, log_tail: str = "") -> None:
        """End the run FAILED now, with the reason as a tag and, with the log tail, as failure/failure.txt."""
        self._tags({"failure_reason": reason})
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "failure.txt"
            path.write_text(reason + ("\n\n--- log tail ---\n" + log_tail if log_tail else "") + "\n")
            self.log_artifact(path, "failure")
        self._end("FAILED")

    def _end(self, status: str) -> None:
        if not self._ended:
            self._flush_startup()
            self.client.set_terminated(self.run_id, status)
            self._ended, self.status = True, status

    def __enter__(self) -> ArmTracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if self._ended:
            return False
        interrupted = exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit))
        # the run is ended whatever comes meanwhile: a signal waits until it is (found by the fault
        # campaign, seed 404285457: a second SIGINT cut the ending of a Ctrl-C'd run short, RUNNING), and
        # one that comes while an interrupt already ends it is not raised twice
        held = _hold_interrupts()
        try:
            if exc_type is None:
                self._end("FINISHED")
            elif interrupted:
                self._tags({"failure_reason": f"interrupted ({exc_type.__name__})"})
                self._end("KILLED")
            else:
                self.fail(
                    f"{exc_type.__name__}: {exc}", "".join(traceback.format_exception(exc_type, exc, tb))
                )
        except Exception as e:
            if exc_type is None:
                raise
            # what ended the arm goes on: an interrupt turned into a store error would let the sweep go
            # on (found by the fault campaign, with the store locked); the next sweep ends the run
            what = f"{type(e).__name__}: {e}"
            log.error("could not end MLflow run %s after %s: %s", self.run_id, exc_type.__name__, what)
        finally:
            _release_interrupts(held, drop=interrupted)
        return False
