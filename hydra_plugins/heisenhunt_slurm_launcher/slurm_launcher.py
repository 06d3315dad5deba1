"""Each arm one SLURM job: a thin launcher on submitit, in the manner of the Ray one.

Each job of a batch (a round of the study's design) is submitted with `sbatch` through submitit (its
pickling of the job and its sbatch script); inside the job, the arm runs exactly as under the basic
launcher, on the job's allocation when `cluster=slurm` (conf/cluster/slurm.yaml) places the roles on it.
What hydra-submitit-launcher (`hydra/launcher=submitit_slurm`) would not do for a study:

- results in the order jobs finish, read from `squeue`, never from `sacct` (which needs SLURM's
  accounting database);
- a job SLURM ends (scancel by someone else, its time limit, preemption, a node failure) is one FAILED
  arm with the reason ("cancelled by SLURM", "time limit hit", ...), not an exception that ends the sweep;
  its MLflow run (found by its `slurm.job_id` tag) ends FAILED even when the job was killed outright;
- nothing is rerun behind the design's back (no checkpoint, no requeue: submitit's own SIGUSR2 handling
  is replaced; SIGUSR2 before the time limit ends the arm with its teardown done);
- Ctrl-C (or SIGTERM) of the driver cancels every job with `scancel` (a queued one never starts; a running
  one gets SIGTERM and tears its servers down, as under the basic launcher), waits `teardown_s` for them,
  kills those still there, then raises.

submitit is an optional extra (`pip install 'heisenhunt[slurm]'`): without it this plugin only says so.
"""

# No `from __future__ import annotations` (see the sweeper's plugin).
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from orchestrator.run.launching import StudyLauncher, import_extra

log = logging.getLogger(__name__)

# the states of a job that is still in SLURM's hands
ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
}
# why SLURM ended a job, as the arm's failure reason says it
ENDED_BY = {
    "CANCELLED": "cancelled by SLURM (scancel)",
    "TIMEOUT": "its SLURM time limit was hit",
    "PREEMPTED": "preempted by SLURM",
    "NODE_FAIL": "its node failed (SLURM NODE_FAIL)",
    "BOOT_FAIL": "its node failed to boot (SLURM BOOT_FAIL)",
    "OUT_OF_MEMORY": "SLURM killed it out of memory",
    "DEADLINE": "its SLURM deadline passed",
    "FAILED": "its SLURM job failed",
}
INTERRUPTED = "heisenhunt.slurm.interrupted"


class SlurmJob:
    """What runs inside each SLURM job (pickled by submitit): the Hydra job, as the basic launcher runs
    it, with the study's signal rules."""

    def __init__(self, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.config = config
        self.warned = False

    def _time_limit_near(self, signum: int, frame: Any) -> None:
        # submitit asks for SIGUSR2 before the time limit (or a preemption): the arm stops now, as on
        # SIGTERM, so its teardown is done before SLURM's SIGKILL
        self.warned = True
        log.warning("SIGUSR2 from SLURM: its time limit is near (or it is preempted); stopping the arm")
        os.kill(os.getpid(), signal.SIGTERM)

    def __call__(self, overrides: list[str], job_num: int, singleton_state: dict) -> Any:
        from orchestrator.run.interrupts import honour_interrupts

        honour_interrupts()  # submitit ignores SIGTERM ("bypass"): here it stops the arm, as everywhere
        signal.signal(signal.SIGUSR2, self._time_limit_near)
        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config.hydra.job):
            sweep_config.hydra.job.id = os.environ.get("SLURM_JOB_ID", f"job_id_for_{job_num}")
            sweep_config.hydra.job.num = job_num
        try:
            return run_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=sweep_config,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            )
        except KeyboardInterrupt as e:  # the run was ended (KILLED) and the servers stopped
            return {INTERRUPTED: str(e) or "interrupted", "time_limit_near": self.warned}


class SlurmLauncher(StudyLauncher):
    def __init__(
        self, submitit_folder: str, sbatch: DictConfig, teardown_s: float = 120.0, poll_s: float = 1.0
    ) -> None:
        self.folder = submitit_folder
        self.sbatch = OmegaConf.to_container(sbatch, resolve=True) if OmegaConf.is_config(sbatch) else sbatch
        self.teardown_s = float(teardown_s)
        self.poll_s = float(poll_s)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        (submitit,) = import_extra(["submitit"], "heisenhunt_slurm", "slurm", "submitit")
        config = self.begin_launch()
        executor = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=0)
        params = {k: v for k, v in (self.sbatch or {}).items() if v is not None}
        params.setdefault("job_name", f"heisenhunt-{config.study.name}")
        executor.update_parameters(**params)
        job_fn = SlurmJob(self.hydra_context, self.task_function, self.config)
        jobs: dict[str, tuple] = {}  # SLURM job id -> (submitit job, overrides, sweep config)
        try:
            for i, overrides in enumerate(job_overrides):
                idx = initial_job_idx + i
                sweep_config = self.sweep_config(overrides, idx)
                job = executor.submit(job_fn, list(overrides), idx, Singleton.get_state())
                jobs[job.job_id] = (job, list(overrides), sweep_config)
                log.info("\t#%d : %s (SLURM job %s)", idx, " ".join(filter_overrides(overrides)), job.job_id)
            results: dict[str, JobReturn] = {}
            while len(results) < len(jobs):
                states = queue_states([j for j in jobs if j not in results])
                for job_id, state in states.items():
                    if state["JobState"] not in ACTIVE:
                        results[job_id] = self._result(job_id, state, *jobs[job_id])
                if len(results) < len(jobs):
                    time.sleep(self.poll_s)
        except KeyboardInterrupt:
            self._cancel_all(jobs)
            raise
        return [results[j] for j in jobs]

    def _result(
        self, job_id: str, state: dict[str, str], job: Any, overrides: list[str], cfg: DictConfig
    ) -> JobReturn:
        outcome = _outcome(job, state)
        if outcome is not None and outcome[0] == "success" and isinstance(outcome[1], JobReturn):
            return outcome[1]
        if outcome is not None and outcome[0] == "error":
            reason = f"its SLURM job {job_id} raised: {str(outcome[1]).strip().splitlines()[-1]}"
        elif outcome is not None and outcome[1].get("time_limit_near"):
            reason = "its SLURM time limit was near (SIGUSR2): stopped, its servers torn down"
        else:
            slurm_state = state["JobState"]
            reason = ENDED_BY.get(slurm_state, f"SLURM ended it ({slurm_state})")
            if outcome is None:
                reason += ", before the arm could return"
        if outcome is None:  # killed outright (after KillWait, a lost node): stop what it left running
            teardown_left(cfg, job_id, state.get("NodeList", ""))
        where = f"nodes {state.get('NodeList', '?')}, partition {state.get('Partition', '?')}"
        reason = f"{reason} [SLURM job {job_id}, state {state['JobState']}, {where}]"
        log.error("job %s: %s", " ".join(filter_overrides(overrides)), reason)
        run_id = fail_run(cfg, job_id, reason)
        summary = {"status": "FAILED", "reason": reason, "run_id": run_id, "slurm_job_id": job_id}
        return JobReturn(overrides=overrides, cfg=cfg, status=JobStatus.COMPLETED, _return_value=summary)

    def _cancel_all(self, jobs: dict[str, tuple]) -> None:
        """scancel every job of the batch, give the running ones `teardown_s` to tear down, then kill the
        rest; further interrupts wait (a second Ctrl-C must not leave servers running)."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(
                s, lambda signum, frame: log.warning("signal %d: still cancelling the SLURM jobs", signum)
            )
        try:
            ids = list(jobs)
            if not ids:
                return
            log.warning(
                "interrupted: scancel of %d SLURM job(s); running arms tear down their servers (up to %.0fs)",
                len(ids),
                self.teardown_s,
            )
            _slurm(["scancel", *ids])
            deadline = time.monotonic() + self.teardown_s
            while (left := active(ids)) and time.monotonic() < deadline:
                time.sleep(self.poll_s)
            if left:
                log.error("SLURM jobs %s did not end in %.0fs: killing them", ",".join(left), self.teardown_s)
                _slurm(["scancel", "--signal=KILL", "--full", *left])
                for job_id in left:
                    fail_run(
                        jobs[job_id][2],
                        job_id,
                        "interrupted, and its teardown did not finish: SLURM job killed",
                    )
                    teardown_left(jobs[job_id][2], job_id, queue_states([job_id])[job_id].get("NodeList", ""))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _slurm(argv: list[str], timeout: float = 60.0) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        log.warning("%s: exit %d: %s", " ".join(argv), done.returncode, done.stderr.strip())
    return done.stdout


def queue_states(ids: list[str]) -> dict[str, dict[str, str]]:
    """Each job's state (`JobState`, `Reason`, `NodeList`, `Partition`) as slurmctld has it (finished jobs
    stay there MinJobAge, 300 s by default); a job it no longer knows is asked of sacct, else taken as
    ended (`UNKNOWN`)."""
    out = _slurm(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r|%N|%P"]) if ids else ""
    states: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        job_id, state, reason, nodes, partition = (line.split("|") + [""] * 5)[:5]
        states[job_id.strip()] = {
            "JobState": state,
            "Reason": reason,
            "NodeList": nodes,
            "Partition": partition,
        }
    for job_id in set(ids) - set(states):
        acct = _slurm(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,NodeList,Partition"]).split()
        state, nodes, partition = ((acct[0].split("|") if acct else []) + ["UNKNOWN", "", ""])[:3]
        states[job_id] = {
            "JobState": state.split()[0] if state else "UNKNOWN",
            "NodeList": nodes,
            "Partition": partition,
        }
    return states


def active(ids: list[str]) -> list[str]:
    return [j for j, s in queue_states(ids).items() if s["JobState"] in ACTIVE]


def _outcome(job: Any, state: dict[str, str]) -> Any:
    """What the job returned (submitit's result pickle: ("success", value) or ("error", traceback)), or
    None when it never returned (killed). A COMPLETED job's pickle may take a moment to appear."""
    from submitit.core.utils import pickle_load

    path = job.paths.result_pickle
    deadline = time.monotonic() + (10.0 if state["JobState"] == "COMPLETED" else 2.0)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not path.exists():
        return None
    return pickle_load(path)


def fail_run(sweep_config: DictConfig, job_id: str, reason: str) -> "str | None":
    """End FAILED, with the reason, the MLflow run of the arm that ran as SLURM job `job_id` (its
    `slurm.job_id` tag), unless it FINISHED or FAILED on its own; returns its id (None: no run yet)."""
    from orchestrator.config.load import load_job
    from orchestrator.tracking.layout import make_client
    from orchestrator.tracking.write import end_run_failed, tag_run

    try:
        job = load_job(sweep_config)
        client = make_client(job.tracking.uri)
        experiment = client.get_experiment_by_name(job.study.name)
        if experiment is None:
            return None
        found = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`slurm.job_id` = '{job_id}'", max_results=5
        )
    except Exception:
        log.warning("cannot find the MLflow run of SLURM job %s", job_id, exc_info=True)
        return None
    for run in found:
        if run.info.status in ("RUNNING", "KILLED"):
            end_run_failed(job.tracking.uri, run.info.run_id, reason)
        else:
            tag_run(job.tracking.uri, run.info.run_id, {"slurm.ended": reason})
        return run.info.run_id
    return None


def teardown_left(sweep_config: DictConfig, job_id: str, nodes: str) -> None:
    """Stop what the arm of a killed job left running on its nodes (their pid files), from here, under the
    hosts' leases: the arm's cluster as the job saw it (its SLURM_JOB_NODELIST). Where the next arm holds
    them already, its co-restart stops the leftovers instead; a node this machine cannot reach is left to
    that too."""
    import dataclasses

    from orchestrator.config.load import load_job
    from orchestrator.config.plan import plan_arm
    from orchestrator.remote import close_all, make_transports
    from orchestrator.run import lease as host_lease
    from orchestrator.run.deploy import Deployment

    if not nodes or nodes.startswith("("):
        return  # never started (squeue's "(reason)")
    saved = os.environ.get("SLURM_JOB_NODELIST")
    os.environ["SLURM_JOB_NODELIST"] = nodes
    try:
        job = load_job(sweep_config)
    finally:
        if saved is None:
            os.environ.pop("SLURM_JOB_NODELIST", None)
        else:
            os.environ["SLURM_JOB_NODELIST"] = saved
    plan = plan_arm(job)
    transports = {}
    try:
        transports = make_transports({role: rp.host for role, rp in plan.roles.items()})
        holder = host_lease.Holder.this_process(
            f"study {job.study.name}: tearing down after SLURM job {job_id}"
        )
        work_dirs = {role: rp.host.work_dir for role, rp in plan.roles.items()}
        conf = dataclasses.replace(job.cluster.lease, wait_s=5.0)
        with host_lease.hosts_held(host_lease.cluster_leases(transports, work_dirs), holder, conf):
            problems = Deployment(plan, transports, run_label="slurm-recovery").stop_all()
        if problems:
            log.error("tearing down after SLURM job %s: %s", job_id, problems)
        else:
            log.info("after SLURM job %s was killed: its servers on %s are stopped", job_id, nodes)
    except host_lease.LeaseHeld:
        log.warning(
            "after SLURM job %s: its nodes are held by the next arm, whose co-restart stops what it left",
            job_id,
        )
    except Exception:
        log.warning(
            "after SLURM job %s: could not tear down what it left on %s", job_id, nodes, exc_info=True
        )
    finally:
        close_all(transports)
