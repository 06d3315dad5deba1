"""MLflow tracking: a parent run per multirun, a child run per arm, and reading it back. Takes typed
values (`schema`, `plan.ArmPlan`) only; the Hydra callback that drives the parent run is in callbacks.py.

Layout in MLflow (experiment = the study's name):
- the experiment is tagged as model training (`mlflow.experimentKind`), not a GenAI app, and carries a
  saved runs view (`ARMS_VIEW`) listing the arm runs with their factor and corruption columns.
- parent run (tag `heisenhunt.kind=study`, named after its sweep dir): created by `start_study_run` (from
  the callback's `on_multirun_start`) and left RUNNING until `end_study_run`, which attaches the report
  (`report/`) and sets the run's description to the report's headline.
  Its id reaches the jobs explicitly, through `<sweep dir>/.heisenhunt/parent_run_id` and the env var
  HEISENHUNT_PARENT_RUN_ID, so launchers that run jobs in other processes work too. It carries the
  study definition (`study/study.json`), from which the report command rebuilds the report.
  If the sweep never reaches `on_multirun_end` (bad input, Ctrl-C), an exit hook marks it KILLED.
- child runs (tag `heisenhunt.kind=arm`, `mlflow.parentRunId`): one per arm x repetition, written by
  `ArmTracker`, named `<arm label> #<repetition>`. Params (one line each, so the compare view reads them)
  `factor.<name>` (every factor on every arm, so the compare view lines arms up), `env.<role>.<NAME>`
  (redacted), `workload.*`, `bench.*`. Tags `signature`, `repetition`, `study`, `arm`,
  `outcomes` (none|partial|complete), `client_bound`, `provenance.<role>.*`, `failure_reason`, `cluster`
  and on a pool `cluster_pool`, `cluster_pool.member`, `lease.*` (read back as `RunRecord.placement`).
  Metrics: first the arm's outcome, `arm.corrupted`, `arm.sessions` (sessions with an outcome), `arm.rate`
  and its exact interval `arm.rate_ci_low|high` (the `arm.` names sort first in MLflow's alphabetical
  tables, and `arm.rate` is logged first, so the compare view's chart plots it); then `sessions_total`,
  `sessions_clean|errored|planned`, `detector.<name>` (the counted finding that ended a session),
  `family.<family>` (sessions with a finding of that detector family, counted or noted beside),
  `usage_missing_turns`, `tok_s.c<C>`, `concurrency.c<C>` (achieved),
  `ttft_p50_s.c<C>` ..., `startup_s.<role>`, `capture_batches`, `eager_batches`,
  `decode_load.planned|mean|p50|max|samples` (the decode's load during the stress run as its /metrics
  reported it, against the planned concurrency; tags `decode_load` measured|unknown, `decode_load_unknown`).
  Artifacts: `launch/launch.json` (per role: argv, flags, and origin: which factor level, the deployment
  or the cluster set each env var and flag), the resolved config, `stress/` (sessions.jsonl, summary.json,
  corrupted/), `bench/bench.json`, `logs/`, `failure/`.

Every call goes through an explicit `MlflowClient(tracking_uri=...)`: no global MLflow state. Every
artifact is scanned for the arm's secret env values and uploaded redacted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrator import decode_load
from orchestrator.analysis import LevelSample, RunRecord
from orchestrator.analysis.clusters import placement_of
from orchestrator.analysis.stats import clopper_pearson
from orchestrator.plan import ArmPlan, arm_label, flag_words
from orchestrator.redact import redact_env, redact_text
from orchestrator.results import BenchResult, LogFacts, StressSummary
from orchestrator.schema import StudyConf, TrackingConf
from orchestrator.workload.bench import bench_to_dict
from orchestrator.workload.detect import FAMILIES

log = logging.getLogger(__name__)

PARENT_ENV = "HEISENHUNT_PARENT_RUN_ID"
PARENT_FILE = Path(".heisenhunt") / "parent_run_id"
KIND = "heisenhunt.kind"
MAX_TAG = 7900  # MLflow's tag value limit is 8000
MAX_PARAM = 5900  # and 6000 for params
PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
# MLflow 3 opens an experiment of this kind on its runs rather than on the GenAI overview
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# a saved view of the experiment's runs page ("Views" menu; opened by `arms_view_url`)
ARMS_VIEW = "heisenhunt-arms"
VIEW_TAG = "mlflow.sharedViewState."
LAUNCH_ARTIFACT = "launch/launch.json"
PLANNED_ARTIFACT = "study/planned.json"
# artifact downloads while loading a study run in parallel: each is a small file read, mostly waiting
LOAD_THREADS = 8
# the arm's outcome, named to sort first
CORRUPTED, SESSIONS, RATE = "arm.corrupted", "arm.sessions", "arm.rate"
RATE_CI_LOW, RATE_CI_HIGH = "arm.rate_ci_low", "arm.rate_ci_high"


# --- shared helpers --------------------------------------------------------------------------------


def make_client(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


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
    if uri.startswith(("http://", "https://")):
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
    if isinstance(node, Mapping):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flatten(f"{prefix}.{key}", value))
        return out
    return {prefix: "null" if node is None else str(node)}


def _iter_runs(
    client: MlflowClient, experiment_id: str, filter_string: str, order_by: list[str] | None = None
) -> Iterator[Any]:
    token = None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=filter_string,
            max_results=1000,
            order_by=order_by,
            page_token=token,
        )
        yield from page
        token = page.token
        if not token:
            return


# --- parent run: the study callback ----------------------------------------------------------------


def end_run_refused(uri: str, run_id: str, reason: str) -> None:
    """End a run FAILED now with its (already redacted) reason: the sweep was refused before any job ran,
    and MLflow shows why the parent run is empty."""
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
    uri: str, run_id: str, paths: list[Path], failure: str | None = None, headline: str | None = None
) -> None:
    """Attach the report files and end the parent run: FINISHED, or FAILED with `failure`. The report's
    `headline` becomes the first paragraph of the run's description, above the study's."""
    client = make_client(uri)
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
    ) -> ArmTracker:
        client = make_client(tracking.uri)
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
        run = client.create_run(exp_id, tags=tags, run_name=f"{label} #{int(repetition)}")
        tracker = cls(client, run.info.run_id, plan.secrets)
        tracker._log_params(plan)
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
        held, self._startup = self._startup, {}
        self._metrics(held)

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
        metrics |= {f"family.{name}": summary.by_family.get(name, 0) for name in FAMILIES}
        metrics["usage_missing_turns"] = summary.usage_missing_turns
        self._metrics(metrics)
        self._outcome_logged = True
        self._flush_startup()
        self._tags({"outcomes": "partial" if summary.partial else "complete"})
        if out_dir is None:
            return
        out_dir = Path(out_dir)
        for name in ("sessions.jsonl", "summary.json"):
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
        """The decode's load during the stress run (orchestrator.decode_load): metrics
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
        if exc_type is None:
            self._end("FINISHED")
        elif issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self._tags({"failure_reason": f"interrupted ({exc_type.__name__})"})
            self._end("KILLED")
        else:
            self.fail(f"{exc_type.__name__}: {exc}", "".join(traceback.format_exception(exc_type, exc, tb)))
        return False


# --- reading back ----------------------------------------------------------------------------------


def finished_runs(uri: str, study: str) -> set[tuple[str, int]]:
    """(signature, repetition) of every FINISHED arm run of the study, for resume."""
    client = make_client(uri)
    exp = client.get_experiment_by_name(study)
    if exp is None:
        return set()
    runs = _iter_runs(client, exp.experiment_id, f"tags.`{KIND}` = 'arm' and attributes.status = 'FINISHED'")
    return {(r.data.tags["signature"], int(r.data.tags["repetition"])) for r in runs}


def _bench_levels(client: MlflowClient, run_id: str, tmp: Path) -> tuple[LevelSample, ...]:
    try:
        path = client.download_artifacts(run_id, "bench/bench.json", str(tmp))
    except (MlflowException, OSError) as e:
        log.warning("run %s: bench.json unreadable (%s); throughput from metrics only", run_id, e)
        return ()
    data = json.loads(Path(path).read_text())
    levels = []
    for raw in data.get("levels", []):
        levels.append(
            LevelSample(
                concurrency=int(raw["concurrency"]),
                tok_s=float(raw["output_tok_s"]),
                ttft_p50_s=float(raw["ttft_s"]["p50"]),
                ttft_p99_s=float(raw["ttft_s"]["p99"]),
                itl_p50_s=float(raw["itl_s"]["p50"]),
                itl_p99_s=float(raw["itl_s"]["p99"]),
                errors=int(raw.get("errors", 0)),
                request_tokens=tuple(float(x) for x in raw.get("request_tokens") or ()),
                request_latency_s=tuple(float(x) for x in raw.get("request_latency_s") or ()),
            )
        )
    return tuple(sorted(levels, key=lambda lv: lv.concurrency))


def _bench_from_metrics(metrics: Mapping[str, float]) -> tuple[LevelSample, ...]:
    levels = []
    for key, value in metrics.items():
        if key.startswith("tok_s.c"):
            c = key.removeprefix("tok_s.")
            levels.append(
                LevelSample(
                    concurrency=int(c[1:]),
                    tok_s=value,
                    ttft_p50_s=metrics.get(f"ttft_p50_s.{c}", float("nan")),
                    ttft_p99_s=metrics.get(f"ttft_p99_s.{c}", float("nan")),
                    itl_p50_s=metrics.get(f"itl_p50_s.{c}", float("nan")),
                    itl_p99_s=metrics.get(f"itl_p99_s.{c}", float("nan")),
                    errors=int(metrics.get(f"errors.{c}", 0)),
                )
            )
    return tuple(sorted(levels, key=lambda lv: lv.concurrency))


def read_json_artifact(client: MlflowClient, run_id: str, artifact: str, tmp: Path) -> Any | None:
    """A run's JSON artifact, or None when it has none (e.g. runs logged before it existed)."""
    try:
        path = client.download_artifacts(run_id, artifact, str(tmp))
    except (MlflowException, OSError):
        return None
    return json.loads(Path(path).read_text())


def read_launch(client: MlflowClient, run_id: str, tmp: Path) -> dict[str, dict[str, Any]] | None:
    """A run's `launch/launch.json` (see launch_record), or None when it has none (runs logged before it)."""
    return read_json_artifact(client, run_id, LAUNCH_ARTIFACT, tmp)


def _launch_config(client: MlflowClient, run: Any, tmp: Path) -> dict[str, dict[str, Any]]:
    """role -> {"env", "flags", "argv", "origin"}: env from the params, the rest from launch.json, or from
    the `flags.|argv.|origin.<role>` params of runs logged before launch.json."""
    config: dict[str, dict[str, Any]] = {}
    for key, value in run.data.params.items():
        kind, _, rest = key.partition(".")
        role = rest.partition(".")[0]
        if kind in ("env", "flags", "argv", "origin"):
            config.setdefault(role, {"env": {}, "flags": "", "argv": "", "origin": {}})
        if kind == "env":
            config[role]["env"][rest.partition(".")[2]] = value
        elif kind in ("flags", "argv"):
            config[role][kind] = value
        elif kind == "origin":
            config[role]["origin"] = json.loads(value)
    for role, launch in (read_launch(client, run.info.run_id, tmp / run.info.run_id) or {}).items():
        config.setdefault(role, {"env": {}})
        config[role] |= {k: launch[k] for k in ("argv", "flags", "origin")}
    return {role: config[role] for role in sorted(config)}


def _record(run: Any, bench: tuple[LevelSample, ...], config: dict[str, dict[str, Any]]) -> RunRecord:
    """A run as the analysis reads it (pure, given what was downloaded for it)."""
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    outcomes = tags.get("outcomes", "none")
    return RunRecord(
        run_id=run.info.run_id,
        status=run.info.status,
        signature=tags.get("signature", params.get("signature", "?")),
        repetition=int(tags.get("repetition", 0)),
        factors={k.removeprefix("factor."): v for k, v in sorted(params.items()) if k.startswith("factor.")},
        outcomes=outcomes if outcomes in ("partial", "complete") else "none",
        clean=int(metrics.get("sessions_clean", 0)),
        # runs logged before the arm.* names have sessions_corrupted
        corrupted=int(metrics.get(CORRUPTED, metrics.get("sessions_corrupted", 0))),
        errored=int(metrics.get("sessions_errored", 0)),
        planned=int(metrics.get("sessions_planned", 0)),
        reason=tags.get("failure_reason", ""),
        client_bound=tags.get("client_bound") == "true",
        missing_usage=int(tags.get("missing_usage") or 0),
        families={name: int(metrics[f"family.{name}"]) for name in FAMILIES if f"family.{name}" in metrics},
        bench=bench,
        config=config,
        facts={
            k: float(metrics[k])
            for k in ("capture_batches", "eager_batches", "bootstrap_failures")
            if k in metrics
        },
        conditions=json.loads(tags.get("conditions") or "{}"),
        decode_load=decode_load.from_record(metrics, tags),
        placement=placement_of(tags),
    )


def _has_bench(run: Any) -> bool:
    return run.data.tags.get("bench") == "logged" and run.info.status == "FINISHED"


def records(client: MlflowClient, runs: list[Any], tmp: Path) -> list[RunRecord]:
    """RunRecords of `runs`, downloading only what the analysis reads: bench.json of the runs that carried
    a throughput sweep, and launch.json once per signature (the launch is the signature's; only one
    run's is shown). Downloads run in parallel."""
    first_of_signature: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: (r.info.status != "FINISHED", r.info.start_time or 0)):
        first_of_signature.setdefault(run.data.tags.get("signature", "?"), run)
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        benches = {
            r.info.run_id: pool.submit(_bench_levels, client, r.info.run_id, tmp / r.info.run_id)
            for r in runs
            if _has_bench(r)
        }
        configs = {
            sig: pool.submit(_launch_config, client, r, tmp / f"launch-{r.info.run_id}")
            for sig, r in first_of_signature.items()
        }
        out = []
        for run in runs:
            bench = benches[run.info.run_id].result() if run.info.run_id in benches else ()
            if not bench and _has_bench(run):
                bench = _bench_from_metrics(run.data.metrics)
            out.append(_record(run, bench, configs[run.data.tags.get("signature", "?")].result()))
    return out


def sweep_runs(
    runs: list[Any], parent: Any, planned: set[tuple[str, int]] | None, pool_sweeps: bool
) -> tuple[list[Any], str]:
    """Which arm runs a sweep's report counts, and how the report says it (pure).

    By default: the runs of this sweep (its parent run) only, so an earlier sweep (another workload, a
    re-run after an inconclusive study: an unplanned second look) never pools in. A resumed sweep adds
    the earlier FINISHED runs of the jobs it planned and skipped. `pool_sweeps`: every run of the study."""
    if pool_sweeps:
        sweeps = {r.data.tags.get(PARENT_TAG) for r in runs}
        return list(runs), f"all {len(runs)} arm runs of the study, from {len(sweeps)} sweep(s) (asked for)"
    parent_id = parent.info.run_id
    mine = [r for r in runs if r.data.tags.get(PARENT_TAG) == parent_id]
    if parent.data.tags.get("resume") != "true" or not planned:
        return mine, f"the {len(mine)} arm runs of sweep {parent_id}"
    covered = {
        (r.data.tags.get("signature"), int(r.data.tags.get("repetition", 0)))
        for r in mine
        if r.info.status == "FINISHED"
    }
    conditions = parent.data.tags.get("conditions") or "{}"
    earlier = [
        r
        for r in runs
        if r.data.tags.get(PARENT_TAG) != parent_id
        and r.info.status == "FINISHED"
        and (key := (r.data.tags.get("signature"), int(r.data.tags.get("repetition", 0)))) in planned
        and key not in covered
        and (r.data.tags.get("conditions") or "{}") == conditions
    ]
    # one FINISHED run per planned job: the latest, when earlier sweeps ran it more than once
    latest: dict[tuple[str, int], Any] = {}
    for r in sorted(earlier, key=lambda r: r.info.start_time or 0):
        latest[(r.data.tags.get("signature"), int(r.data.tags.get("repetition", 0)))] = r
    # the earlier sweeps' interrupted or failed runs of the planned jobs: listed (why it was resumed),
    # never pooled
    stopped = [
        r
        for r in runs
        if r.data.tags.get(PARENT_TAG) != parent_id
        and r.info.status != "FINISHED"
        and (r.data.tags.get("signature"), int(r.data.tags.get("repetition", 0))) in planned
    ]
    return mine + list(latest.values()) + stopped, (
        f"the {len(mine)} arm runs of sweep {parent_id}, and {len(latest)} FINISHED runs of earlier "
        f"sweeps that it resumed (resume=true skipped them)"
    )


def _planned(client: MlflowClient, run_id: str, tmp: Path) -> set[tuple[str, int]] | None:
    jobs = read_json_artifact(client, run_id, PLANNED_ARTIFACT, tmp)
    return None if jobs is None else {(str(sig), int(rep)) for sig, rep in jobs}


def load_study(
    uri: str, study: str, pool_sweeps: bool = False
) -> tuple[StudyConf, dict[str, Any], list[RunRecord]]:
    """The study definition and the report context (from its latest parent run: its sweep), and the arm
    runs that sweep's report counts (`sweep_runs`)."""
    client = make_client(uri)
    exp = client.get_experiment_by_name(study)
    if exp is None:
        raise LookupError(f"no MLflow experiment named {study!r} at {uri}")
    parents = list(
        _iter_runs(
            client, exp.experiment_id, f"tags.`{KIND}` = 'study'", order_by=["attributes.start_time DESC"]
        )
    )
    if not parents:
        raise LookupError(f"experiment {study!r} at {uri} has no study run (made by StudyCallback)")
    parent = parents[0]
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = client.download_artifacts(parent.info.run_id, "study/study.json", tmp)
        spec = StudyConf.from_dict(json.loads(Path(spec_path).read_text()))
        planned = _planned(client, parent.info.run_id, Path(tmp) / "planned")
        every = list(_iter_runs(client, exp.experiment_id, f"tags.`{KIND}` = 'arm'"))
        chosen, pooled = sweep_runs(every, parent, planned, pool_sweeps)
        runs = records(client, chosen, Path(tmp))
    context = {
        "parent_run_id": parent.info.run_id,
        "overrides": json.loads(parent.data.tags.get("overrides", "[]")),
        "design": parent.data.tags.get("design", ""),
        "conditions": json.loads(parent.data.tags.get("conditions") or "{}"),
        "pooled": pooled,
    }
    return spec, context, runs
