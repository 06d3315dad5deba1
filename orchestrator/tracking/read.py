"""MLflow read back: a study's runs as the analysis' records (`analysis.runs.RunRecord`), the FINISHED ones a
resume skips, and the study definition the report is rebuilt from. The layout is in `tracking.layout`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrator.analysis.runs import (
    DIVERGENCE,
    LevelSample,
    RunRecord,
    example_run,
    identity,
    machine_of,
    oracle_of,
    placement_of,
)
from orchestrator.config.plan import arm_conditions
from orchestrator.config.schema import StudyConf
from orchestrator.tracking.layout import (
    CORRUPTED,
    DEPLOYMENT_COST_TAG,
    HELD,
    KIND,
    LAUNCH_ARTIFACT,
    PARENT_TAG,
    PLANNED_ARTIFACT,
    iter_runs,
    make_client,
)
from orchestrator.workload import decode_load
from orchestrator.workload.detect import FAMILIES

# artifact downloads while loading a study run in parallel: each is a small file read, mostly waiting
LOAD_THREADS = 8
# a stress run's artifacts the report reads of runs judged by the differential oracle
STRESS_SUMMARY = "stress/summary.json"
STRESS_CORRUPTED = "stress/corrupted"
# the diverged sessions' artifacts tried for an arm's example (one without a difference, e.g. a wrong
# answer's, is passed over)
EXAMPLE_TRIES = 3


# --- reading back ----------------------------------------------------------------------------------

log = logging.getLogger(__name__)


def finished_runs(uri: str, study: str) -> set[tuple[str, int]]:
    """(signature, repetition) of every FINISHED arm run of the study, for resume."""
    client = make_client(uri)
    exp = client.get_experiment_by_name(study)
    if exp is None:
        return set()
    runs = iter_runs(client, exp.experiment_id, f"tags.`{KIND}` = 'arm' and attributes.status = 'FINISHED'")
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


def conditions_of(tags: Mapping[str, str]) -> dict[str, str]:
    """A run's (or a sweep's) measurement conditions, as today's arm identity reads them."""
    return arm_conditions(json.loads(tags.get("conditions") or "{}"))


def _judged_by_divergence(run: Any) -> bool:
    return oracle_of(conditions_of(run.data.tags)) == DIVERGENCE


def _record(
    run: Any,
    bench: tuple[LevelSample, ...],
    config: dict[str, dict[str, Any]],
    summary: Mapping[str, Any] | None = None,
) -> RunRecord:
    """A run as the analysis reads it (pure, given what was downloaded for it: its bench levels, launch
    config and, of a run judged by the differential oracle, its stress/summary.json)."""
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    summary = summary or {}
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
        conditions=conditions_of(tags),
        wall_s=float(metrics[HELD]) if HELD in metrics else None,
        stress_s=float(metrics["stress_duration_s"]) if "stress_duration_s" in metrics else None,
        decode_load=decode_load.from_record(metrics, tags),
        placement=placement_of(tags),
        machine=machine_of(tags),
        reference=dict(summary.get("reference") or {}),
        divergence=dict(summary.get("divergence") or {}),
    )


def _divergence_example(client: MlflowClient, run_id: str, tmp: Path) -> dict[str, Any] | None:
    """One diverged session's artifact of a run (the first by name that records a difference), or None."""
    try:
        listed = client.list_artifacts(run_id, STRESS_CORRUPTED)
    except (MlflowException, OSError):
        return None
    for item in sorted(a.path for a in listed if not a.is_dir and a.path.endswith(".json"))[:EXAMPLE_TRIES]:
        document = read_json_artifact(client, run_id, item, tmp)
        if isinstance(document, dict) and isinstance(document.get("difference"), dict):
            return document
    return None


def _with_examples(
    client: MlflowClient, out: list[RunRecord], pool: ThreadPoolExecutor, tmp: Path
) -> list[RunRecord]:
    """`out` with one diverged session's artifact on one run per arm judged by the differential oracle
    (`runs.example_run`): one listing and a download or two per arm, none for other studies."""
    arms: dict[str, list[RunRecord]] = {}
    for record in out:
        if oracle_of(record.conditions) == DIVERGENCE:
            arms.setdefault(identity(record), []).append(record)
    chosen = [run for run in (example_run(group) for group in arms.values()) if run is not None]
    found = {
        r.run_id: pool.submit(_divergence_example, client, r.run_id, tmp / f"example-{r.run_id}")
        for r in chosen
    }
    return [
        dataclasses.replace(r, divergence_example=found[r.run_id].result()) if r.run_id in found else r
        for r in out
    ]


def _has_bench(run: Any) -> bool:
    return run.data.tags.get("bench") == "logged" and run.info.status == "FINISHED"


def records(client: MlflowClient, runs: list[Any], tmp: Path) -> list[RunRecord]:
    """RunRecords of `runs`, downloading only what the analysis reads: bench.json of the runs that carried
    a throughput sweep, launch.json once per signature (the launch is the signature's; only one run's is
    shown), and of runs judged by the differential oracle their stress/summary.json and one diverged
    session's artifact per arm (the report's example). Downloads run in parallel."""
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
        summaries = {
            r.info.run_id: pool.submit(
                read_json_artifact, client, r.info.run_id, STRESS_SUMMARY, tmp / f"summary-{r.info.run_id}"
            )
            for r in runs
            if _judged_by_divergence(r)
        }
        out = []
        for run in runs:
            bench = benches[run.info.run_id].result() if run.info.run_id in benches else ()
            if not bench and _has_bench(run):
                bench = _bench_from_metrics(run.data.metrics)
            summary = summaries[run.info.run_id].result() if run.info.run_id in summaries else None
            config = configs[run.data.tags.get("signature", "?")].result()
            out.append(_record(run, bench, config, summary if isinstance(summary, dict) else None))
        return _with_examples(client, out, pool, tmp)


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
    conditions = conditions_of(parent.data.tags)
    earlier = [
        r
        for r in runs
        if r.data.tags.get(PARENT_TAG) != parent_id
        and r.info.status == "FINISHED"
        and (key := (r.data.tags.get("signature"), int(r.data.tags.get("repetition", 0)))) in planned
        and key not in covered
        and conditions_of(r.data.tags) == conditions
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
        iter_runs(
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
        every = list(iter_runs(client, exp.experiment_id, f"tags.`{KIND}` = 'arm'"))
        chosen, pooled = sweep_runs(every, parent, planned, pool_sweeps)
        runs = records(client, chosen, Path(tmp))
    context = {
        "parent_run_id": parent.info.run_id,
        "overrides": json.loads(parent.data.tags.get("overrides", "[]")),
        "design": parent.data.tags.get("design", ""),
        "conditions": conditions_of(parent.data.tags),
        "pooled": pooled,
    }
    if DEPLOYMENT_COST_TAG in parent.data.tags:  # sweeps logged before GPU time was reported have none
        context["deployment_cost"] = json.loads(parent.data.tags[DEPLOYMENT_COST_TAG])
    return spec, context, runs
