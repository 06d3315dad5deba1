"""Hydra's Ray launcher (hydra-ray-launcher) with what a study needs of it.

Each job is a Ray task, started as Hydra's `ray` launcher starts it (its `start_ray` and
`launch_job_on_ray`, the same `ray.init` / `ray.remote` options). What differs is how results come back:

- in the order jobs finish (`ray.wait`), so a lost worker is noticed while the others run;
- a task whose worker or node died is one FAILED arm, not a failed sweep: its MLflow run ends FAILED with
  Ray's reason, and its pool member is declared lost at once (pool.py), to be torn down before any other
  arm runs there. Hydra's own launcher would raise on it and end the whole sweep;
- Ctrl-C (or SIGTERM) cancels every job (a queued one never starts; a running one gets KeyboardInterrupt
  and tears its servers down, as under the basic launcher), waits `teardown_s` for them, kills those that
  did not finish and stops what they left running, then raises. Hydra's own launcher leaves that to
  Ray, which kills the workers and leaves their servers running.
- the orchestrator's own `HEISENHUNT_*` environment (the sweep's parent run) reaches the workers.

Ray is an optional extra: without it this plugin only says how to install it.
"""

# No `from __future__ import annotations` (see the sweeper's plugin).
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import DictConfig, OmegaConf

from orchestrator.run.launching import StudyLauncher, import_extra

log = logging.getLogger(__name__)

ENV_PREFIX = "HEISENHUNT_"


class PoolRayLauncher(StudyLauncher):
    def __init__(self, ray: DictConfig, teardown_s: float = 120.0) -> None:
        self.ray_cfg = ray
        self.teardown_s = float(teardown_s)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        ray, launcher_util = import_extra(
            ["ray", "hydra_plugins.hydra_ray_launcher._launcher_util"],
            "heisenhunt_ray",
            "ray",
            "Ray and Hydra's Ray launcher",
        )
        from hydra.core.singleton import Singleton

        self.begin_launch()
        init = OmegaConf.to_container(self.ray_cfg.init, resolve=True)
        if not init.get("address"):  # a Ray started here: as Hydra's launcher, small for CI machines
            init.setdefault("object_store_memory", 78643200)
        launcher_util.start_ray(OmegaConf.create(init))
        from orchestrator.run.interrupts import honour_interrupts

        honour_interrupts()  # ray.init made SIGTERM a sys.exit, which would skip cancelling the jobs
        remote = self._remote_options()
        log.info("Ray launcher: %d jobs", len(job_overrides))
        jobs: dict[Any, tuple] = {}
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            sweep_config = self.sweep_config(overrides, idx, job_id=f"job_id_for_{idx}")
            ref = launcher_util.launch_job_on_ray(
                self.hydra_context, remote, sweep_config, self.task_function, Singleton.get_state()
            )
            jobs[ref] = (list(overrides), sweep_config)
        results: dict[Any, JobReturn] = {}
        pending = list(jobs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    results[ref] = self._result(ref, *jobs[ref])
        except KeyboardInterrupt:
            self._stop_all(pending, jobs)
            raise
        return [results[ref] for ref in jobs]

    def _remote_options(self) -> DictConfig:
        remote = OmegaConf.to_container(self.ray_cfg.remote, resolve=True)
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
        if env:
            runtime_env = dict(remote.get("runtime_env") or {})
            runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
            remote["runtime_env"] = runtime_env
        return OmegaConf.create(remote)

    def _result(self, ref: Any, overrides: list[str], sweep_config: DictConfig) -> JobReturn:
        import ray
        from ray.exceptions import RayError, RayTaskError

        try:
            return ray.get(ref)
        except RayTaskError as e:
            if isinstance(e.cause, BaseException) and not isinstance(e.cause, Exception):
                raise  # an interrupt inside the job: the sweep stops, as under the basic launcher
            reason = f"its Ray task failed: {str(e).splitlines()[0]}"
        except RayError as e:  # the worker or its node died: one arm lost, the sweep goes on
            reason = f"its Ray worker was lost: {' '.join(str(e).split())[:500]}"
        log.error("job %s: %s", " ".join(filter_overrides(overrides)), reason)
        run_id = _lose(ref, sweep_config, reason)
        summary = {"status": "FAILED", "reason": reason, "run_id": run_id}
        return JobReturn(
            overrides=overrides, cfg=sweep_config, status=JobStatus.COMPLETED, _return_value=summary
        )

    def _stop_all(self, pending: list[Any], jobs: dict[Any, tuple]) -> None:
        """Cancel every job still out, give the running ones `teardown_s` to tear down, then kill the rest
        and stop what they left running; further interrupts wait (a second Ctrl-C must not leave servers
        running)."""
        import ray

        log.warning(
            "interrupted: cancelling %d job(s); running arms tear down their servers (up to %.0fs)",
            len(pending),
            self.teardown_s,
        )
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, lambda signum, frame: log.warning("signal %d: still tearing down", signum))
        try:
            for ref in pending:
                ray.cancel(ref)
            _, stuck = ray.wait(pending, num_returns=len(pending), timeout=self.teardown_s)
            for ref in stuck:
                log.error("a job did not finish its teardown in %.0fs: killing its worker", self.teardown_s)
                ray.cancel(ref, force=True)
                _lose(ref, jobs[ref][1], "interrupted, and its teardown did not finish: worker killed")
            if stuck:
                _clean_up(jobs[stuck[0]][1])
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _pool_job(sweep_config: DictConfig) -> Any:
    """The job's typed config when it runs on a cluster pool (None: no pool, nothing to recover)."""
    if sweep_config.get("cluster_pool") is None:
        return None
    from orchestrator.config.load import load_job

    return load_job(sweep_config)


def _lose(ref: Any, sweep_config: DictConfig, reason: str) -> str | None:
    """Declare the task's pool lease lost now and end its run FAILED; returns that run's id."""
    import ray

    from orchestrator.run import pool

    job = _pool_job(sweep_config)
    if job is None:
        return None
    actor = pool.pool_actor(job.cluster_pool, create=False)
    if actor is None:
        return None
    lost = ray.get(actor.lose_task.remote(ref.task_id().hex(), reason))
    if lost is None:
        return None
    pool.mark_lost_run(lost, "by the launcher")
    return lost.lease.holder.run_id


def _clean_up(sweep_config: DictConfig) -> None:
    job = _pool_job(sweep_config)
    if job is not None:
        from orchestrator.run import pool

        pool.clean_up_lost(job)
