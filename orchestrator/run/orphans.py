"""Runs whose orchestrator died: a SIGKILL, an OOM kill or a lost machine leaves the MLflow run RUNNING
for good, since nothing was left to end it. Every arm run and every study's parent run records the
process that owns it (`PROCESS_TAG`: host, pid and that pid's start time, as a lease holder does), and
each sweep of a study first ends the runs of that study whose owner on this machine is provably gone:
FAILED, with the reason. An owner on another machine is left alone (nothing here can prove it dead); the
analysis never pools a RUNNING run either way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from orchestrator.run.lease import Holder, is_stale, local_start_time
from orchestrator.tracking.layout import PROCESS_TAG, iter_runs, make_client
from orchestrator.tracking.write import end_run_failed

log = logging.getLogger(__name__)


def process_tag(label: str) -> dict[str, str]:
    """The tag that names this process as the owner of a run."""
    return {PROCESS_TAG: json.dumps(Holder.this_process(label).__dict__, sort_keys=True)}


def owner_gone(tag_value: str, here: str, local_start_time: Callable[[int], str]) -> str | None:
    """Why the run's owner is provably gone (pure, given how to read a local pid's start time), or None
    while it may still run (alive, on another machine, or no record)."""
    try:
        data = json.loads(tag_value)
        owner = Holder(**{k: data[k] for k in ("id", "label", "hostname", "pid", "pid_started")})
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if owner.hostname != here or not is_stale(owner, 0.0, float("inf"), here, local_start_time):
        return None
    return f"its orchestrator process ({owner.describe()}) died before it could end the run"


def end_orphaned_runs(uri: str, study: str, here: str, by: str) -> list[str]:
    """End FAILED the RUNNING runs of `study` (arms and parents) whose owner on this machine is gone;
    returns their ids. `by` says who found them, for the reason."""
    client = make_client(uri)
    experiment = client.get_experiment_by_name(study)
    if experiment is None:
        return []
    ended = []
    for run in iter_runs(client, experiment.experiment_id, "attributes.status = 'RUNNING'"):
        tag = run.data.tags.get(PROCESS_TAG)
        reason = owner_gone(tag, here, local_start_time) if tag else None
        if reason is None:
            continue
        reason = f"{reason}; ended by {by}"
        end_run_failed(uri, run.info.run_id, reason)
        log.warning("MLflow run %s: %s", run.info.run_id, reason)
        ended.append(run.info.run_id)
    return ended
