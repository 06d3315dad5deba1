"""Hydra's Ray launcher (hydra-ray-launcher) with what a study needs of it.

Each job is a Ray task that runs it as Hydra's `ray` launcher does (its `start_ray` and `_run_job`, the
same `ray.init` / `ray.remote` options). What differs is how jobs start and how results come back:

- a job is composed and sent when a job slot is free for it (`job_slots`), not every job before the
  first starts; results come back in the order jobs finish (`ray.wait`), so a lost worker is noticed
  while the others run;
- a task whose worker or node died is one FAILED arm, not a failed sweep: its MLflow run ends FAILED with
  Ray's reason, and its pool member is declared lost at once (pool.py), to be torn down before any other
  arm runs there. Hydra's own launcher would raise on it and end the whole sweep;
- Ctrl-C (or SIGTERM) cancels every job (a queued one never starts; a running one gets KeyboardInterrupt
  and tears its servers down, as under the basic launcher), waits `teardown_s` for them, kills those that
  did not finish and stops what they left running, then raises. Hydra's own launcher leaves that to
  Ray, which kills the workers and leaves their servers running.
- the orchestrator's own `HEISENHUNT_*` environment (the sweep's parent run) reaches the workers, as each
  job's argument (orchestrator/run/ray_worker.py): no runtime env, so the jobs run in the workers Ray
  starts with itself;
- Ray starts while the sweep is validated: `setup` (before the sweeper composes and checks the arms on
  their hosts) starts `ray.init` in a thread and has a worker per job slot (`job_slots`: one per pool
  member, and one more ready to take the first member that comes free) import what a job imports, so the
  first jobs start in warm workers as soon as the sweep is accepted (the pool's lessor actor is made then
  too). A Ray started here has that many CPUs and no dashboard unless `hydra.launcher.ray.init.num_cpus`
  / `.include_dashboard` say otherwise. A sweep that launches nothing (dry_run, preflight_only) starts no
  Ray.

Ray is an optional extra: without it this plugin only says how to install it.
"""

# No `from __future__ import annotations` (see the sweeper's plugin).
import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import DictConfig, OmegaConf

from orchestrator.run.launching import StudyLauncher, import_extra

log = logging.getLogger(__name__)

# what a job imports that a fresh interpreter has not (seconds of a cold worker): warmed before the launch
JOB_MODULES = (
    "hydra_plugins.hydra_ray_launcher._launcher_util",
    "orchestrator.arm",
    "orchestrator.config.load",
    "orchestrator.run.pool",
    "orchestrator.tracking.read",
    "orchestrator.tracking.write",
    "orchestrator.workload.stress",
)


def _ray_modules() -> tuple[Any, Any, Any]:
    """(ray, Hydra's job runner for a Ray worker, its start_ray), or an ImportError that says how to
    install them."""
    ray, util = import_extra(
        ["ray", "hydra_plugins.hydra_ray_launcher._launcher_util"],
        "heisenhunt_ray",
        "ray",
        "Ray and Hydra's Ray launcher",
    )
    return ray, util._run_job, util.start_ray


def job_slots(config: DictConfig) -> int:
    """How many jobs are to run at once: one per member of the pool (one cluster without a pool), and one
    more, ready (started, planned, waiting on the pool) to take the first member that comes free."""
    pool = config.get("cluster_pool")
    return (len(pool.clusters) if pool is not None else 1) + 1


# how often the driver, waiting on its jobs, lets a Ctrl-C or SIGTERM through (seconds)
WAIT_FOR_SIGNALS_S = 0.1


def init_options(init_cfg: DictConfig, slots: int) -> DictConfig:
    """ray.init's options: as configured. A Ray started here is small, as Hydra's launcher makes it for
    CI machines, has `slots` CPUs (a job's CPU is a slot: its arm's load runs in its servers) and no
    dashboard (its processes start with Ray: seconds of CPU beside the sweep's validation) unless told
    otherwise."""
    init = OmegaConf.to_container(init_cfg, resolve=True)
    if not init.get("address"):
        init.setdefault("object_store_memory", 78643200)
        init.setdefault("num_cpus", slots)
        init.setdefault("include_dashboard", False)
    return OmegaConf.create(init)


def remote_options(ray_cfg: DictConfig) -> dict[str, Any]:
    """ray.remote's options for every task, as configured."""
    return OmegaConf.to_container(ray_cfg.remote, resolve=True)


def _start_lessor(config: DictConfig) -> None:
    """The pool's lessor actor (pool.py), made now rather than by the first job: an actor's worker starts
    cold, and the first lease waited for it."""
    if config.get("cluster_pool") is None:
        return
    from orchestrator.run import pool

    pool.pool_actor(OmegaConf.to_object(config.cluster_pool))


def _no_sigterm_note(record: logging.LogRecord) -> bool:
    """Ray's note that a ray.init outside the main thread set no SIGTERM handler, left out: the launch
    sets the study's own (honour_interrupts)."""
    return "SIGTERM handler is not set" not in record.getMessage()


class PoolRayLauncher(StudyLauncher):
    def __init__(self, ray: DictConfig, teardown_s: float = 120.0) -> None:
        self.ray_cfg = ray
        self.teardown_s = float(teardown_s)
        self._ray_ready: threading.Event | None = None  # set once the start at setup is done

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        if not (config.get("dry_run") or config.get("preflight_only")):
            # Ray's start (seconds) and its workers' imports overlap the sweep's validation
            self._ray_ready = threading.Event()
            threading.Thread(
                target=self._start_ray_warm, args=(job_slots(config),), name="ray-start", daemon=True
            ).start()

    def _start_ray_warm(self, slots: int) -> None:
        """ray.init, then a task per job slot importing what a job imports (left running: the launch does
        not wait for them). A failure is logged; `launch` starts Ray again and raises it there. The thread
        then lives as long as the process: a Ray started here dies with the thread that started it (Ray's
        fate sharing is Linux's parent-death signal, which follows the parent thread, not the process)."""
        assert self._ray_ready is not None
        try:
            ray, _, start_ray = _ray_modules()
            logging.getLogger("ray._private.worker").addFilter(_no_sigterm_note)
            start_ray(init_options(self.ray_cfg.init, slots))
            from orchestrator.run.ray_worker import warm_up

            # the jobs' own options: the workers warmed are the ones the jobs will run in
            warm = ray.remote(warm_up).options(**remote_options(self.ray_cfg))
            for _ in range(slots):
                warm.remote(JOB_MODULES)
            _start_lessor(self.config)
        except Exception as e:
            log.warning("Ray did not start ahead of the launch (%s: %s); starting now", type(e).__name__, e)
        finally:
            self._ray_ready.set()
        threading.Event().wait()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        ray, run_job_in_worker, start_ray = _ray_modules()
        from hydra.core.singleton import Singleton

        from orchestrator.run.ray_worker import call_with_env, job_env

        self.begin_launch()
        if self._ray_ready is not None:
            self._ray_ready.wait()  # started at setup, while the sweep was validated
        start_ray(init_options(self.ray_cfg.init, job_slots(self.config)))  # (running already: a no-op)
        from orchestrator.run.interrupts import honour_interrupts

        honour_interrupts()  # ray.init made SIGTERM a sys.exit, which would skip cancelling the jobs
        remote = remote_options(self.ray_cfg)
        env = job_env(os.environ, (remote.get("runtime_env") or {}).get("env_vars"))
        task = ray.remote(call_with_env).options(**remote)
        # what every job shares, serialized once rather than once per job
        context, task_function, singletons = (
            ray.put(x) for x in (self.hydra_context, self.task_function, Singleton.get_state())
        )
        log.info("Ray launcher: %d jobs", len(job_overrides))
        jobs: dict[Any, tuple] = {}  # in job order

        def send(idx: int, overrides: Sequence[str]) -> Any:
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            sweep_config = self.sweep_config(overrides, idx, job_id=f"job_id_for_{idx}")
            ref = task.remote(env, run_job_in_worker, context, sweep_config, task_function, singletons)
            jobs[ref] = (list(overrides), sweep_config)
            return ref

        slots = job_slots(self.config)
        unsent = list(enumerate(job_overrides, start=initial_job_idx))[::-1]  # popped in job order
        results: dict[Any, JobReturn] = {}
        pending: list[Any] = []
        try:
            while unsent or pending:
                # a job is composed (Hydra: ~0.3 s of the driver's CPU) and sent when a job slot is free
                # for it, not all before the first: the first arms start at once, and the rest are
                # composed while arms run (20 jobs composed up front held the first lease back ~5 s)
                while unsent and len(pending) < slots:
                    pending.append(send(*unsent.pop()))
                # a signal reaches Python only when ray.wait returns to it: without a timeout a Ctrl-C
                # waited for the next arm to end (seed 804765948, Ray: a SIGINT mid-stress took effect
                # 0.6 s later, after the interrupted arm had ended FINISHED)
                done, pending = ray.wait(pending, num_returns=1, timeout=WAIT_FOR_SIGNALS_S)
                for ref in done:
                    results[ref] = self._result(ref, *jobs[ref])
        except KeyboardInterrupt:
            # every job sent and not come back (one sent as the interrupt came is in `jobs` only)
            self._stop_all([ref for ref in jobs if ref not in results], jobs)
            raise
        return [results[ref] for ref in jobs]

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
