"""`python -m orchestrator`: the Hydra app. One job runs one arm; a multirun runs a study.

This is the edge: it turns Hydra's config into typed values (`config.load_job`), builds the side effects
(transports to the hosts, the MLflow tracker) and hands them to `arm.run_arm`, a plain function that
tests call directly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from orchestrator.arm import ArmSkip, StressThenBench, prepare, run_arm
from orchestrator.checks import check_local_side
from orchestrator.config import CONF_DIR, load_job
from orchestrator.redact import redact_text

log = logging.getLogger("orchestrator")


def run_job(cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    """One job of the sweep: load and check it, skip it on resume, else run its arm."""
    from orchestrator.remote import make_transports
    from orchestrator.tracking import ArmTracker, finished_runs, parent_run_id

    job = load_job(cfg)
    check_local_side(job.tracking.uri, job.report.dir)
    finished = finished_runs(job.tracking.uri, job.study.name) if job.resume else set()
    step = prepare(job, finished)
    if isinstance(step, ArmSkip):
        log.info(
            "resume: %s repetition %d (signature %s) already FINISHED; skipped",
            step.label,
            step.repetition,
            step.signature,
        )
        return step.summary()
    output_dir.mkdir(parents=True, exist_ok=True)
    config_file = output_dir / "resolved_config.yaml"
    job_keys = [k for k in cfg if k != "hydra"]  # a composed config may carry Hydra's own node
    text = OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, job_keys), resolve=True)
    config_file.write_text(redact_text(text, step.plan.secrets))
    transports = make_transports({role: rp.host for role, rp in step.plan.roles.items()})
    parent = parent_run_id(job.parent_run_id, job.sweep_dir)
    tracker = ArmTracker.start(job.tracking, job.study, step.plan, step.repetition, parent)
    tracker.log_artifact(config_file)
    return run_arm(step, transports, tracker, StressThenBench(step.repetition), output_dir)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
