"""`python -m orchestrator`: the Hydra app. One job runs one arm; a multirun runs a study.

This is the edge: it turns Hydra's config into typed values (`config.load_job`), builds the side effects
(transports to the hosts, the MLflow tracker) and hands them to `arm.run_arm`, a plain function that
tests call directly.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from orchestrator.arm import ArmSkip, StressThenBench, prepare, run_arm
from orchestrator.checks import check_local_side
from orchestrator.config import CONF_DIR, load_job
from orchestrator.lease import LeaseHeld
from orchestrator.preflight import PreflightError
from orchestrator.redact import redact_text

log = logging.getLogger("orchestrator")


class ArmRefused(CompactHydraException):
    """A host refused the arm, or its cluster stayed another study's: nothing was restarted. (Compact:
    Hydra prints the message alone.)"""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during an arm, saying what was kept."""


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
    try:
        return run_arm(step, transports, tracker, StressThenBench(step.repetition), output_dir)
    except KeyboardInterrupt as e:
        kept = _lines(output_dir / "stress" / "sessions.jsonl")
        raise Interrupted(
            f"{e}: stopped arm {step.label} #{step.repetition}; its MLflow run {tracker.run_id} is KILLED "
            f"with the {kept} sessions that completed, earlier arms are kept as they finished, and every "
            f"server this arm started was stopped"
        ) from None


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    try:
        return run_job(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (PreflightError, LeaseHeld) as e:
        raise ArmRefused(str(e)) from e


def cli() -> None:
    """The command: its own checks of the command line, then the Hydra app; an interrupt ends with one
    line saying what was kept, not a traceback."""
    from orchestrator.argv import command_line_problems

    problems = command_line_problems(sys.argv[1:])
    if problems:
        print("invalid command line:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except KeyboardInterrupt as e:
        print(
            f"heisenhunt: {e}" if isinstance(e, Interrupted) else "heisenhunt: interrupted", file=sys.stderr
        )
        sys.exit(130)


if __name__ == "__main__":
    cli()
