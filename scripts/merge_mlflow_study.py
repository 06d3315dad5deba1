"""Copy one study's runs from MLflow stores into another: every run (the sweeps' parent runs first, their
arm runs re-pointed at the copies) with its status, times, tags, params, metric histories and artifacts.

For a study whose starts ran in device calls that could not share one store (each call on a lent GPU
machine brings back its own): the copies pool with `python -m orchestrator.report --pool-sweeps`, and
the report says which sweeps it pooled. Nothing is changed in the copies but the parent-run link.

    python scripts/merge_mlflow_study.py --study real_determinism --into sqlite:///OUT/mlruns.db \
        --artifacts OUT/mlruns SRC_URI [SRC_URI ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

PARENT_TAG = "mlflow.parentRunId"


def copy_study(src: MlflowClient, dst: MlflowClient, study: str, artifacts: str) -> int:
    experiment = src.get_experiment_by_name(study)
    if experiment is None:
        raise SystemExit(f"no study {study!r} in {src.tracking_uri}")
    target = dst.get_experiment_by_name(study)
    target_id = target.experiment_id if target else dst.create_experiment(study, artifact_location=artifacts)
    runs = src.search_runs([experiment.experiment_id], max_results=50_000)
    runs.sort(key=lambda r: (PARENT_TAG in r.data.tags, r.info.start_time or 0))  # parents first
    copied: dict[str, str] = {}
    for run in runs:
        tags = dict(run.data.tags)
        if PARENT_TAG in tags:
            tags[PARENT_TAG] = copied.get(tags[PARENT_TAG], tags[PARENT_TAG])
        new = dst.create_run(target_id, start_time=run.info.start_time, tags=tags, run_name=run.info.run_name)
        run_id = new.info.run_id
        copied[run.info.run_id] = run_id
        params = [Param(k, v) for k, v in run.data.params.items()]
        metrics = [
            Metric(m.key, m.value, m.timestamp, m.step)
            for key in run.data.metrics
            for m in src.get_metric_history(run.info.run_id, key)
        ]
        for i in range(0, max(len(params), len(metrics)), 100):
            dst.log_batch(run_id, metrics=metrics[i : i + 100], params=params[i : i + 100])
        with tempfile.TemporaryDirectory() as tmp:
            if src.list_artifacts(run.info.run_id):
                local = src.download_artifacts(run.info.run_id, "", tmp)
                dst.log_artifacts(run_id, local)
        dst.set_terminated(run_id, status=run.info.status, end_time=run.info.end_time)
    return len(copied)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", required=True)
    parser.add_argument("--into", required=True, help="the tracking URI to copy into")
    parser.add_argument("--artifacts", required=True, help="the new experiment's artifact location")
    parser.add_argument("sources", nargs="+", help="tracking URIs to copy from")
    args = parser.parse_args(argv)
    dst = MlflowClient(args.into)
    artifacts = str(Path(args.artifacts).resolve())
    for uri in args.sources:
        print(f"{uri}: {copy_study(MlflowClient(uri), dst, args.study, artifacts)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
