"""The layout in MLflow that `tracking.write` writes and `tracking.read` reads: a parent run per
multirun, a child run per arm.

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

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)
T = TypeVar("T")

# the arm's outcome, named to sort first
CORRUPTED, SESSIONS, RATE = "arm.corrupted", "arm.sessions", "arm.rate"
# seconds a run held its servers, first start to the end of teardown: its GPU time (analysis/cost.py)
HELD = "servers_held_s"
PARENT_ENV = "HEISENHUNT_PARENT_RUN_ID"
PARENT_FILE = Path(".heisenhunt") / "parent_run_id"
KIND = "heisenhunt.kind"
# the process that owns a RUNNING run: host, pid, its start time (run/orphans.py)
PROCESS_TAG = "heisenhunt.process"
# on a study (parent) run: the deployment's cost estimate (deployment.cost, JSON), which the report's GPU
# time uses until the runs measure their own (analysis/cost.py)
DEPLOYMENT_COST_TAG = "heisenhunt.deployment_cost"
MAX_TAG = 7900  # MLflow's tag value limit is 8000
MAX_PARAM = 5900  # and 6000 for params
PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
# a saved view of the experiment's runs page ("Views" menu; opened by `arms_view_url`)
ARMS_VIEW = "heisenhunt-arms"
VIEW_TAG = "mlflow.sharedViewState."
LAUNCH_ARTIFACT = "launch/launch.json"
PLANNED_ARTIFACT = "study/planned.json"


# --- shared helpers --------------------------------------------------------------------------------


def make_client(uri: str) -> MlflowClient:
    """A client of the store at `uri`. The first client of a process opens the store (MLflow checks its
    tables then), and a store busy for a while is waited for there as everywhere (found by the fault
    campaign, seed 173879092: a resumed sweep's first open met a lock held past sqlite's busy timeout and
    the sweep exited 1)."""
    return retry_store(lambda: MlflowClient(tracking_uri=uri))


def is_tracking_server(uri: str) -> bool:
    """An MLflow tracking server (its UI at the same address), not a store this process opens itself."""
    return uri.startswith(("http://", "https://"))


# a store busy for a while, not broken: sqlite's lock held by another writer past its busy timeout
TRANSIENT_STORE_ERRORS = ("database is locked", "database table is locked")


def is_transient_store_error(error: BaseException) -> bool:
    text = str(error)
    return any(marker in text for marker in TRANSIENT_STORE_ERRORS)


def retry_store(
    call: Callable[[], T],
    patience_s: float = 60.0,
    wait_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`, again while it fails for a store busy for a while (`is_transient_store_error`), for up to
    `patience_s`; any other error, or one past it, is raised. For what only reads or rewrites the same
    thing (a study's report): once more changes nothing."""
    deadline = clock() + patience_s
    while True:
        try:
            return call()
        except Exception as e:
            if not is_transient_store_error(e) or clock() + wait_s > deadline:
                raise
            log.warning(
                "the tracking store is busy (%s); trying again in %.0f s", str(e).splitlines()[0], wait_s
            )
            sleep(wait_s)


def iter_runs(
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
