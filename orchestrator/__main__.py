"""`python -m orchestrator`: the Hydra app. One job runs one arm; a multirun runs a study.

The terminal shows the study's progress and, at the end, its verdict (the report's headline, the
hypotheses table, the report's path); the logs go to the log files (`<sweep dir>/multirun.log`,
`<sweep dir>/<job>/__main__.log`). HEISENHUNT_VERBOSE=1 brings the logs back to the terminal
(orchestrator/report/console.py).

This is the edge: it turns Hydra's config into typed values (`config.load_job`), builds the side effects
(transports to the hosts, the MLflow tracker) and hands them to `arm.run_arm`, a plain function that
tests call directly.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from orchestrator.arm import ArmSkip, ArmStart, InterruptGuard, StressThenBench, prepare, run_arm
from orchestrator.config.load import CONF_DIR, load_job
from orchestrator.config.redact import redact_text
from orchestrator.config.schema import JobConf
from orchestrator.run.interrupts import honour_interrupts
from orchestrator.run.lease import LeaseHeld
from orchestrator.run.local_checks import check_local_side
from orchestrator.run.preflight import PreflightError
from orchestrator.run.progress import NO_PROGRESS, ProgressFile, ProgressSink, progress_dir

log = logging.getLogger("orchestrator")


class ArmRefused(CompactHydraException):
    """A host refused the arm, or its cluster stayed another study's: nothing was restarted. (Compact:
    Hydra prints the message alone.)"""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during an arm, saying what was kept."""


def run_job(cfg: DictConfig, output_dir: Path, job_num: int | None = None) -> dict[str, Any]:
    """One job of the sweep: load and check it, skip it on resume, else run its arm (on a member of its
    cluster pool, held for the whole arm, when it has one). `job_num`: its number in a multirun, whose
    progress the arm then reports for the terminal (run/progress.py)."""
    from orchestrator.config.plan import on_cluster
    from orchestrator.tracking.read import finished_runs

    job = load_job(cfg)
    check_local_side(job.tracking.uri, job.report.dir)
    finished = finished_runs(job.tracking.uri, job.study.name) if job.resume else set()
    pool = job.cluster_pool
    # (a skip needs no cluster: the signature does not depend on hosts)
    step = prepare(on_cluster(job, next(iter(pool.clusters))) if pool else job, finished)
    progress = _progress(job.sweep_dir, job_num, step)
    if isinstance(step, ArmSkip):
        progress.finish("SKIPPED")
        log.info(
            "resume: %s repetition %d (signature %s) already FINISHED; skipped",
            step.label,
            step.repetition,
            step.signature,
        )
        return step.summary()
    if pool is None:
        return run_on_cluster(job, step, cfg, output_dir, progress=progress)
    from orchestrator.run import pool as cluster_pool
    from orchestrator.tracking.write import tag_run

    holder = cluster_pool.PoolHolder(
        label=f"study {job.study.name}, arm {step.label} #{step.repetition}",
        study=job.study.name,
        tracking_uri=job.tracking.uri,
    )

    def lease_ended(hold: cluster_pool.Hold, end: float) -> None:
        if hold.run_id:
            tag_run(job.tracking.uri, hold.run_id, {"lease.end": cluster_pool.iso(end)})

    with cluster_pool.held(cluster_pool.lessor_for(pool), holder, lease_ended) as hold:
        if hold.grant.lost is not None:
            log.warning(
                "cluster pool: %s was lost by an earlier arm (%s); this arm's co-restart stops what it "
                "left running before anything starts",
                hold.member,
                hold.grant.lost.reason,
            )
            cluster_pool.mark_lost_run(hold.grant.lost, f"by the next arm on {hold.member}")
        on_member = on_cluster(job, hold.member)
        step = prepare(on_member, set())  # planned again: the member's hosts and ports
        assert isinstance(step, ArmStart)
        return run_on_cluster(on_member, step, cfg, output_dir, hold, progress)


def _progress(sweep_dir: str | None, job_num: int | None, step: ArmStart | ArmSkip) -> ProgressSink:
    """The job's progress file in a multirun (the driver's display reads it); nowhere otherwise."""
    if sweep_dir is None or job_num is None:
        return NO_PROGRESS
    path = progress_dir(sweep_dir) / f"{job_num}.json"
    return ProgressFile(path, job_num, step.label, step.repetition)


def run_on_cluster(
    job: JobConf,
    step: ArmStart,
    cfg: DictConfig,
    output_dir: Path,
    hold: Any = None,
    progress: ProgressSink = NO_PROGRESS,
) -> dict[str, Any]:
    """Run the job's prepared arm on `job.cluster` (`hold`: the pool member it holds, if any)."""
    from orchestrator.config import slurm
    from orchestrator.remote import make_transports
    from orchestrator.run import orphans
    from orchestrator.run import pool as cluster_pool
    from orchestrator.tracking.write import ArmTracker, parent_run_id

    output_dir.mkdir(parents=True, exist_ok=True)
    config_file = output_dir / "resolved_config.yaml"
    job_keys = [k for k in cfg if k != "hydra"]  # a composed config may carry Hydra's own node
    recorded = OmegaConf.masked_copy(cfg, job_keys)
    if hold is not None:  # the cluster it ran on, not the unused `cluster` default
        recorded.cluster = cfg.cluster_pool.clusters[hold.member]
    text = OmegaConf.to_yaml(recorded, resolve=True)
    config_file.write_text(redact_text(text, step.plan.secrets))
    transports = make_transports({role: rp.host for role, rp in step.plan.roles.items()})
    parent = parent_run_id(job.parent_run_id, job.sweep_dir)
    # the process that owns the run, from its first moment: a later sweep ends it if this one is killed
    owner = orphans.process_tag(f"arm {step.label} #{step.repetition}")
    # one guard from before the arm's run is created until it is ended: the first SIGINT or SIGTERM
    # raises, a later one waits (found by the fault campaign, seeds 404285457 and 407295012: a second
    # SIGINT while the first was still unwinding towards the run's end left the run RUNNING)
    guard = InterruptGuard()
    with guard.installed():
        # a signal while the run is created is raised in the `try` that ends it
        with guard.shield("creation of its MLflow run"):
            tracker = ArmTracker.start(job.tracking, job.study, step.plan, step.repetition, parent, owner)
        # from here the run ends however this job does: an interrupt before the arm takes the run over
        # (found by the fault campaign: a SIGTERM while the tags were written left it RUNNING) ends it
        # here, KILLED; after that, the arm has ended it, and ending it again does nothing
        try:
            guard.raise_pending()
            # the SLURM job it runs in, if any (its id, nodes, partition): hydra/launcher=heisenhunt_slurm
            placement = {"cluster": job.cluster.name, **slurm.allocation_tags()}
            if hold is not None:
                hold.record_run(tracker.run_id)
                placement |= cluster_pool.lease_tags(job.cluster_pool, hold.grant)
            tracker.log_tags(placement)
            tracker.log_artifact(config_file)
            host_holder = hold.grant.host_holder if hold is not None else None
            return run_arm(
                step,
                transports,
                tracker,
                StressThenBench(step.repetition, progress),
                output_dir,
                holder=host_holder,
                progress=progress,
                guard=guard,
            )
        except KeyboardInterrupt as e:
            tracker.__exit__(type(e), e, e.__traceback__)
            kept = _lines(output_dir / "stress" / "sessions.jsonl")
            raise Interrupted(
                f"{e}: stopped arm {step.label} #{step.repetition}; its MLflow run {tracker.run_id} is "
                f"KILLED with the {kept} sessions that completed, earlier arms are kept as they finished, "
                f"and every server this arm started was stopped"
            ) from None
        except BaseException as e:
            tracker.__exit__(type(e), e, e.__traceback__)
            raise


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    runtime = HydraConfig.get().runtime
    if Path(runtime.cwd).is_dir():
        # the command's directory, where the config's relative paths point (tracking.uri, report.dir):
        # a launcher that runs jobs in other processes (Ray's workers) starts them elsewhere
        os.chdir(runtime.cwd)
    hydra_conf = HydraConfig.get()
    job_num = hydra_conf.job.num if hydra_conf.mode == RunMode.MULTIRUN else None
    output_dir = Path(hydra_conf.runtime.output_dir)
    try:
        summary = run_job(cfg, output_dir, job_num)
    except (PreflightError, LeaseHeld) as e:
        raise ArmRefused(str(e)) from e
    if job_num is None:  # a single run (hydra.mode=RUN): no sweep display, so one line says how it ended
        print(f"arm {summary['arm']} #{summary['repetition']}: {summary['status']}; logs in {output_dir}")
    return summary


def cli() -> None:
    """The command: its own help page and checks of the command line, then the Hydra app; an interrupt
    ends with one line saying what was kept, not a traceback, then what the study kept and how to resume
    (so does a study that stops on an error)."""
    from orchestrator.config.argv import command_line_problems
    from orchestrator.report import console

    if {"--help", "-h"} & set(sys.argv[1:]):
        # Our page, not Hydra's, printed before Hydra starts: a `hydra/help` template is static text (its
        # $APP_CONFIG_GROUPS lists the schema_* nodes and no study descriptions), and one built at import
        # would read every experiment on each start of every job. Here it costs nothing elsewhere, follows
        # the command line's hydra.searchpath, and works when the config would not compose;
        # `--hydra-help` still reaches Hydra.
        from orchestrator.config.help import command_help

        print(command_help(sys.argv[1:]))
        return
    problems = command_line_problems(sys.argv[1:])
    if problems:
        print("invalid command line:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        sys.exit(2)
    # MLflow's own stderr handler would bypass the log files: its records go through ours
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    try:
        honour_interrupts()  # in every phase, even when SIGINT was inherited ignored (run/interrupts.py)
        main()
        from orchestrator.report.pipeline import study_failed

        if study_failed():  # the arms ran; the report was not written (said above, with how to rebuild it)
            sys.exit(1)
    except KeyboardInterrupt as e:
        console.stop_display()  # the terminal restored before anything is printed
        print(
            f"heisenhunt: {e}" if isinstance(e, Interrupted) else "heisenhunt: interrupted", file=sys.stderr
        )
        console.show_kept()
        sys.exit(130)
    except SystemExit as e:
        if e.code not in (0, None):
            console.show_kept()  # (Hydra printed the error)
        raise
    finally:
        console.stop_display()


if __name__ == "__main__":
    from orchestrator.run.fast_exit import run_then_exit_fast

    run_then_exit_fast(cli)
