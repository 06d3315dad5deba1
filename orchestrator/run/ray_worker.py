"""What the Ray launcher (hydra_plugins/heisenhunt_ray_launcher) runs in Ray's workers, besides the jobs.

- `call_with_env`: a job with the driver's own `HEISENHUNT_*` environment (the sweep's parent run) set for
  its length. Given as the task's argument, not as a Ray `runtime_env`: a task with a runtime env of its
  own needs workers started for it (seconds each, after the sweep was launched), while a task without one
  runs in the workers Ray started with itself and the launcher warmed.
- `warm_up`: the modules a job imports (MLflow, the arm, Hydra's job runner: seconds of a cold
  interpreter), imported in a worker while the sweep is still being validated.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

ENV_PREFIX = "HEISENHUNT_"


def job_env(environ: Mapping[str, str], runtime_env_vars: Mapping[str, str] | None) -> dict[str, str]:
    """The driver's `HEISENHUNT_*` variables a job gets, less those a configured `runtime_env` sets itself
    (those win, as they did when ours were merged into it). Pure."""
    given = runtime_env_vars or {}
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX) and k not in given}


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """`env` set in os.environ for the block, what was there before put back after (a worker runs the
    sweep's later jobs too)."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def call_with_env(env: Mapping[str, str], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) with `env` set (the Ray task of one job)."""
    with environment(env):
        return fn(*args, **kwargs)


def warm_up(modules: Iterable[str]) -> int:
    """Import `modules` in this worker; returns its pid (which worker was warmed)."""
    for name in modules:
        importlib.import_module(name)
    return os.getpid()
