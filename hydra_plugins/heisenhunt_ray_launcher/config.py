"""`hydra/launcher=heisenhunt_ray`: Hydra's Ray launcher, with its `ray.init` and `ray.remote` options, and
what a study needs of it (pool_ray_launcher.py)."""

# No `from __future__ import annotations`: Hydra loads plugins outside sys.modules (see the sweeper's).
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class PoolRayConf:
    # ray.init(**init): address null starts a Ray on this machine; `auto` or host:port joins a running one
    init: dict[str, Any] = field(default_factory=lambda: {"address": None})
    # ray.remote(**remote) for every job. max_retries 0: a lost worker is a FAILED arm, never rerun behind
    # the study's back (the sequential and ddmin designs ask for more runs where they need them)
    remote: dict[str, Any] = field(default_factory=lambda: {"max_retries": 0})


@dataclass
class PoolRayLauncherConf:
    _target_: str = "hydra_plugins.heisenhunt_ray_launcher.pool_ray_launcher.PoolRayLauncher"
    ray: PoolRayConf = field(default_factory=PoolRayConf)
    # after Ctrl-C, how long the running arms get to tear down their servers before their workers are
    # killed (then the launcher stops what they left running itself)
    teardown_s: float = 120.0


ConfigStore.instance().store(
    group="hydra/launcher", name="heisenhunt_ray", node=PoolRayLauncherConf, provider="heisenhunt"
)
