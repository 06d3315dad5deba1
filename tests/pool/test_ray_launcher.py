"""The Ray launcher's start, without Ray: Ray started and its workers warmed while the sweep is validated,
and what a job gets of the driver's environment; the waits on the pool's actor that lend Ray no CPU."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from omegaconf import OmegaConf

from hydra_plugins.heisenhunt_ray_launcher import pool_ray_launcher as launcher_module
from hydra_plugins.heisenhunt_ray_launcher.pool_ray_launcher import JOB_MODULES, PoolRayLauncher
from orchestrator.run import pool
from orchestrator.run.pool import awaited
from orchestrator.run.ray_worker import call_with_env, job_env, warm_up
from orchestrator.tracking.layout import PARENT_ENV

RAY_CFG = {"init": {"address": None}, "remote": {"max_retries": 0}}
POOL_OF_TWO = {"cluster_pool": {"clusters": {"pd0": {}, "pd1": {}}}}


class FakeRay:
    """What the launcher's start asks of Ray: ray.init (through Hydra's start_ray) and the warm-up tasks."""

    def __init__(self, expected_tasks: int) -> None:
        self.started_in: list[threading.Thread] = []
        self.init: dict = {}
        self.tasks: list[tuple[Any, dict, tuple]] = []
        self.expected_tasks = expected_tasks
        self.done = threading.Event()
        self.lessors: list[Any] = []
        self.lessor_made = threading.Event()

    def start_ray(self, init: Any) -> None:
        self.started_in.append(threading.current_thread())
        self.init = OmegaConf.to_container(init)

    def lessor(self, pool_conf: Any) -> None:
        self.lessors.append(pool_conf)
        self.lessor_made.set()

    def remote(self, fn: Any) -> Any:
        fake = self

        class Options:
            def options(self, **options: Any) -> Any:
                class Task:
                    def remote(self, *args: Any) -> None:
                        fake.tasks.append((fn, options, args))
                        if len(fake.tasks) == fake.expected_tasks:
                            fake.done.set()

                return Task()

        return Options()


def launcher_set_up(monkeypatch: pytest.MonkeyPatch, config: dict) -> FakeRay:
    ray = FakeRay(expected_tasks=3)
    monkeypatch.setattr(launcher_module, "_ray_modules", lambda: (ray, None, ray.start_ray))
    monkeypatch.setattr(pool, "pool_actor", ray.lessor)
    launcher = PoolRayLauncher(ray=OmegaConf.create(RAY_CFG))
    launcher.setup(hydra_context=None, task_function=None, config=OmegaConf.create(config))
    return ray


def test_ray_starts_and_warms_a_worker_per_job_slot_at_setup_before_any_launch(monkeypatch):
    """A pool of two: a job slot per member and one more (a job ready for the first member that comes
    free), as the CPUs of the Ray started here and as its warmed workers."""
    ray = launcher_set_up(monkeypatch, POOL_OF_TWO)
    assert ray.done.wait(30)
    # not in the main thread: the sweeper validates meanwhile
    assert [thread.name for thread in ray.started_in] == ["ray-start"]
    # and that thread lives on: the Ray it started dies with it (Linux's parent-death signal)
    time.sleep(0.5)
    assert ray.started_in[0].is_alive()
    assert (ray.init["num_cpus"], ray.init["include_dashboard"]) == (3, False)
    # the jobs' own remote options: the workers warmed are the ones the jobs run in
    assert ray.tasks == [(warm_up, {"max_retries": 0}, (JOB_MODULES,))] * 3
    # and the pool's lessor made (its actor's worker starts cold: the first lease would wait for it)
    assert ray.lessor_made.wait(30) and [sorted(p["clusters"]) for p in ray.lessors] == [["pd0", "pd1"]]


@pytest.mark.parametrize("launches_nothing", ["dry_run", "preflight_only"])
def test_a_sweep_that_launches_nothing_starts_no_ray(monkeypatch, launches_nothing):
    ray = launcher_set_up(monkeypatch, {**POOL_OF_TWO, launches_nothing: True})
    assert not ray.done.wait(1) and ray.started_in == [] and ray.lessors == []


def test_the_warm_up_imports_what_a_job_imports():
    assert warm_up(JOB_MODULES) == os.getpid()


def test_a_job_gets_the_drivers_heisenhunt_env_for_its_length_and_a_configured_runtime_env_wins(monkeypatch):
    driver = {PARENT_ENV: "parent", "HEISENHUNT_VERBOSE": "1", "PATH": "/bin"}
    assert job_env(driver, {"HEISENHUNT_VERBOSE": "0"}) == {PARENT_ENV: "parent"}
    assert job_env(driver, None) == {PARENT_ENV: "parent", "HEISENHUNT_VERBOSE": "1"}
    monkeypatch.delenv(PARENT_ENV, raising=False)
    monkeypatch.setenv("HEISENHUNT_VERBOSE", "worker's")
    seen = call_with_env(
        job_env(driver, None), lambda: (os.environ[PARENT_ENV], os.environ["HEISENHUNT_VERBOSE"])
    )
    assert seen == ("parent", "1")
    # put back for the worker's next job
    assert PARENT_ENV not in os.environ and os.environ["HEISENHUNT_VERBOSE"] == "worker's"


class Ref:
    """An object ref whose value comes from another thread after `after_s` (None: never)."""

    def __init__(self, value: Any, after_s: float | None) -> None:
        self.value, self.after_s = value, after_s

    def future(self) -> Future:
        future: Future = Future()
        if self.after_s is not None:
            threading.Timer(self.after_s, future.set_result, [self.value]).start()
        return future


def test_a_wait_on_the_pools_actor_returns_its_answer_or_times_out():
    assert awaited(Ref("grant", after_s=0.3), poll_s=0.05) == "grant"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer from the pool's lessor"):
        awaited(Ref("grant", after_s=None), timeout_s=0.3, poll_s=0.05)
    assert time.monotonic() - started < 5
