"""The Hydra side of a study: the callback that opens and closes the sweep's parent MLflow run, and
`build_report`, the pipeline from the tracking store to the report files (used at the end of a multirun
and by `python -m orchestrator.report`).

The callback turns Hydra's config into typed values (`config.load_job`) and hands them to tracking.py;
nothing past this module sees a DictConfig.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from orchestrator import tracking
from orchestrator.config import ConfigError, load_job, study_of
from orchestrator.plan import plan_arm
from orchestrator.redact import redact_text

log = logging.getLogger(__name__)


def build_report(tracking_uri: str, study: str, out_dir: Path, plots: bool = True) -> list[Path]:
    """MLflow -> analysis -> files; returns the paths, report.md first."""
    from orchestrator.analysis import analyse
    from orchestrator.report import write_report

    spec, context, runs = tracking.load_study(tracking_uri, study)
    return write_report(analyse(spec, runs, context), out_dir, plots, tracking_uri)


def sweep_design(config: DictConfig) -> str:
    """The design the sweeper runs: the study's own when it sweeps params, else the default sweep's."""
    sweeper = config.hydra.get("sweeper") or {}
    return str(sweeper.get("design") if sweeper.get("params") else sweeper.get("default_design", "")) or "?"


def recorded_overrides(config: DictConfig) -> list[str]:
    """The command line as the parent run records it, secret env values redacted. When the config does
    not even load (the sweeper refuses it next), nothing is recorded rather than risk a secret."""
    try:
        secrets = plan_arm(load_job(config)).secrets
    except ConfigError:
        return []
    return [redact_text(str(o), secrets) for o in (config.hydra.overrides.get("task") or [])]


class StudyCallback(Callback):
    """Hydra callback: the parent MLflow run of a multirun, and the report at its end."""

    def __init__(self, **_: Any) -> None:
        self.run_id: str | None = None
        self._uri: str | None = None
        self._saved_env: str | None = None
        self._ended = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.checks import check_local_side

        study = study_of(config)
        uri = str(config.tracking.uri)
        # before the parent run exists: a bad store or reports dir stops the sweep with one clear message
        check_local_side(uri, str(config.report.dir))
        tracking_conf = OmegaConf.to_object(config.tracking)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        self.run_id = tracking.start_study_run(
            tracking_conf, study, sweep_dir, sweep_design(config), recorded_overrides(config)
        )
        self._uri, self._ended = uri, False
        self._saved_env = os.environ.get(tracking.PARENT_ENV)
        os.environ[tracking.PARENT_ENV] = self.run_id
        atexit.register(self._abandoned)
        log.info("MLflow: study %s, parent run %s (%s)", study.name, self.run_id, uri)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.run_id is None or self._uri is None:
            return
        paths: list[Path] = []
        failure = headline = None
        try:
            paths = build_report(
                self._uri, str(config.study.name), Path(str(config.report.dir)), bool(config.report.plots)
            )
            headline = json.loads(paths[1].read_text())["headline"]  # report.json
            log.info("report: %s", paths[0])
        except Exception as e:
            log.exception("the report could not be built")
            failure = f"report: {type(e).__name__}: {e}"
        finally:
            tracking.end_study_run(self._uri, self.run_id, paths, failure, headline)
            self._ended = True
            self._restore_env()
            atexit.unregister(self._abandoned)

    def _restore_env(self) -> None:
        if self._saved_env is None:
            os.environ.pop(tracking.PARENT_ENV, None)
        else:
            os.environ[tracking.PARENT_ENV] = self._saved_env

    def _abandoned(self) -> None:
        """At exit without on_multirun_end (the sweep raised or was interrupted): end the parent KILLED."""
        if self._ended or self.run_id is None or self._uri is None:
            return
        try:
            tracking.end_run_abandoned(self._uri, self.run_id)
        except Exception:
            log.exception("could not mark parent run %s KILLED", self.run_id)
        self._ended = True
