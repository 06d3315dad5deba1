"""The Hydra side of a study: the callback that opens and closes the sweep's parent MLflow run, and
`build_report`, the pipeline from the tracking store to the report files (used at the end of a multirun
and by `python -m orchestrator.report`).

The callback turns Hydra's config into typed values (`config.load.load_job`) and hands them to tracking;
nothing past this module sees a DictConfig.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from orchestrator.config.load import ConfigError, load_job
from orchestrator.config.plan import measurement_conditions, plan_arm
from orchestrator.config.redact import redact_text
from orchestrator.study.sweep import sweep_design, sweep_study

if TYPE_CHECKING:
    from orchestrator.analysis.result import StudyResult

log = logging.getLogger(__name__)


def _write():
    """MLflow's writer, imported when first needed: MLflow takes seconds to import, a dry run needs none."""
    from orchestrator.tracking import write

    return write


def _layout():
    """The tracking layout (MLflow's client), imported when first needed, as `_write`."""
    from orchestrator.tracking import layout

    return layout


def study_result(tracking_uri: str, study: str, pool_sweeps: bool = False) -> StudyResult:
    """MLflow -> analysis: the study's typed result. The latest sweep's runs (and those it resumed) unless
    `pool_sweeps`; its measurement conditions pick today's arms."""
    from orchestrator.study.designs import analyse_study
    from orchestrator.tracking.read import load_study

    spec, context, runs = load_study(tracking_uri, study, pool_sweeps)
    return analyse_study(spec, runs, context, conditions=context.get("conditions") or None)


def build_report(
    tracking_uri: str, study: str, out_dir: Path, plots: bool = True, pool_sweeps: bool = False
) -> tuple[StudyResult, list[Path]]:
    """MLflow -> analysis -> files: the typed result and the paths written, report.md first
    (`study_result` for which runs)."""
    from orchestrator.report.render import write_report

    result = study_result(tracking_uri, study, pool_sweeps)
    return result, write_report(result, out_dir, plots, tracking_uri)


def recorded_overrides(config: DictConfig) -> list[str]:
    """The command line as the parent run records it, secret env values redacted. When the config does
    not even load (the sweeper refuses it next), nothing is recorded rather than risk a secret."""
    try:
        secrets = plan_arm(load_job(config)).secrets
    except ConfigError:
        return []
    # how it was launched (a pool on Ray) is part of the command; Hydra's other settings (its output
    # dirs) are not the study's
    # (unresolved: an override may hold an interpolation, `hydra.sweep.subdir=${hydra.job.num}`)
    given = OmegaConf.to_container(config.hydra.overrides, resolve=False)
    launcher = [
        str(o)
        for o in given.get("hydra") or []
        if str(o).startswith(("hydra/launcher=", "hydra.launcher.", "hydra/sweeper=", "hydra.sweeper."))
    ]
    task = [str(o) for o in given.get("task") or []]
    return [redact_text(o, secrets) for o in launcher + task]


# The study callback of this process's sweep, whose parent run opens once the sweep is accepted
# (`open_parent_run`): the sweeper opens it after its first batch passed every check, so a refused command
# line opens no run (and, for a new study name, creates no experiment), and is refused without importing
# MLflow at all.
_CURRENT: list[StudyCallback] = []


def open_parent_run() -> str | None:
    """Open the sweep's parent run if the study callback has not yet (the sweeper, once the sweep is
    accepted); its id (None without a study callback)."""
    return _CURRENT[-1].run_id if _CURRENT else None


def study_failed() -> bool:
    """The sweep ran, but its report could not be written or its study run not ended (the arms' runs are
    kept; the command exits 1, having said how to rebuild the report)."""
    return bool(_CURRENT and _CURRENT[-1].failed)


def opened_parent_run() -> str | None:
    """The sweep's parent run if it was opened (None: not yet, or no study callback)."""
    return _CURRENT[-1]._run_id if _CURRENT else None


class StudyCallback(Callback):
    """Hydra callback: the parent MLflow run of a multirun, and the report at its end."""

    def __init__(self, **_: Any) -> None:
        self._run_id: str | None = None
        self._open: Callable[[], str] | None = None
        self.study_name: str | None = None
        self._uri: str | None = None
        self._saved_env: str | None = None
        self._tracking: Any = None  # the sweep's TrackingConf
        self._ended = False
        self.failed = False  # the report or the end of the study run failed (study_failed)

    @property
    def run_id(self) -> str | None:
        """The parent run's id, opened now if the sweep has not opened it yet."""
        if self._run_id is None and self._open is not None:
            self._run_id = self._open()
        return self._run_id

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.run.local_checks import check_local_side

        if config.get("dry_run") or config.get("preflight_only"):
            return  # a dry run or a preflight opens no run: it only prints or checks the arms
        uri = str(config.tracking.uri)
        try:
            check_local_side(uri, str(config.report.dir))
        except ConfigError:
            return  # the sweeper refuses the sweep next, with this message (once)
        study, adhoc = sweep_study(config)
        tracking_conf = OmegaConf.to_object(config.tracking)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        design = sweep_design(config, adhoc)
        overrides = recorded_overrides(config)
        conditions = measurement_conditions(OmegaConf.to_object(config.workload))
        deployment_cost = OmegaConf.to_container(config.deployment.get("cost") or {}, resolve=True)
        resume = bool(config.get("resume"))

        def open_run() -> str:
            from orchestrator.run import orphans

            # results an earlier sweep kept while the server did not answer are sent first: their runs
            # end as their arms ended them, not as orphans
            _write().deliver_outboxes(tracking_conf, study.name)
            # runs of this study a killed orchestrator left RUNNING are ended first, saying so
            orphans.end_orphaned_runs(uri, study.name, socket.gethostname(), by=f"the sweep in {sweep_dir}")
            run_id = _write().start_study_run(
                tracking_conf,
                study,
                sweep_dir,
                design,
                overrides,
                conditions=conditions,
                resume=resume,
                extra_tags={
                    **orphans.process_tag(f"study {study.name}, sweep {sweep_dir}"),
                    _write().DEPLOYMENT_COST_TAG: json.dumps(deployment_cost, sort_keys=True),
                },
            )
            self._saved_env = os.environ.get(_write().PARENT_ENV)
            os.environ[_write().PARENT_ENV] = run_id
            atexit.register(self._abandoned)
            log.info("MLflow: study %s, parent run %s (%s)", study.name, run_id, uri)
            return run_id

        self.study_name, self._tracking = study.name, tracking_conf
        self._uri, self._ended, self._run_id, self._open = uri, False, None, open_run
        _CURRENT[:] = [self]  # one sweep per process

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.report import console

        self._open = None  # a sweep that ends unopened (nothing accepted) opens nothing now
        console.stop_display()  # the arms are done; the terminal is the verdict's
        if self._run_id is None or self._uri is None:
            return
        paths: list[Path] = []
        failure = headline = None
        metrics: dict[str, float] = {}
        _clean_up_pool(config)
        try:
            # what the arms kept while the tracking server did not answer goes in before the report
            kept = _write().deliver_outboxes(self._tracking, self.study_name or "")
            if kept:
                log.warning(
                    "%d arm runs' results are still kept for the tracking server (%s): the report lacks "
                    "them; resume=true sends them",
                    len(kept),
                    ", ".join(kept),
                )
            # a store busy for a while (another study's writes, a lock held) is waited for, not reported
            # as a failed report (found by the fault campaign, seed 173879092: the sweep exited 1)
            result, paths = _layout().retry_store(
                lambda: build_report(
                    self._uri,
                    self.study_name or str(config.study.name),
                    Path(str(config.report.dir)),
                    bool(config.report.plots),
                )
            )
            headline = result.headline
            if result.cost:
                metrics = {
                    "study.gpu_hours": result.cost.gpu_hours,
                    "study.starts": result.cost.starts,
                    "study.sessions": result.cost.sessions,
                }
            hint = _write().ui_hint(self._uri, self.study_name or str(config.study.name))
            log.info("report: %s", paths[0])
            log.info(hint)
            console.show_verdict(result, paths[0], hint)
        except Exception as e:
            log.exception("the report could not be built")
            failure = f"report: {type(e).__name__}: {e}"
            console.show_kept()
        finally:
            uri, run_id = self._uri, self._run_id
            try:
                _layout().retry_store(
                    lambda: _write().end_study_run(uri, run_id, paths, failure, headline, metrics)
                )
            except Exception as e:  # (Hydra would only warn of it, and the sweep exit 0)
                log.exception("the study's run %s could not be ended", run_id)
                failure = failure or f"ending the study's run: {type(e).__name__}: {e}"
            self._ended = True
            self.failed = failure is not None
            self._restore_env()
            atexit.unregister(self._abandoned)

    def _restore_env(self) -> None:
        if self._saved_env is None:
            os.environ.pop(_write().PARENT_ENV, None)
        else:
            os.environ[_write().PARENT_ENV] = self._saved_env

    def _abandoned(self) -> None:
        """At exit without on_multirun_end (the sweep raised or was interrupted): end the parent KILLED."""
        if self._ended or self._run_id is None or self._uri is None:
            return
        try:
            _write().end_run_abandoned(self._uri, self._run_id)
        except Exception:
            log.exception("could not mark parent run %s KILLED", self._run_id)
        self._ended = True


def _clean_up_pool(config: DictConfig) -> None:
    """Under Ray, the members of the study's cluster pool that a lost arm left behind are torn down and
    that arm's run ended FAILED, before the report counts it (pool.clean_up_lost)."""
    if config.get("cluster_pool") is None or "ray" not in sys.modules:
        return
    try:
        import ray

        if not ray.is_initialized():
            return
        from orchestrator.run.pool import clean_up_lost

        cleaned = clean_up_lost(load_job(config))
        if cleaned:
            log.warning("cluster pool: tore down %s after lost arms", ", ".join(cleaned))
    except Exception:
        log.exception("could not clean up the cluster pool's lost members")
