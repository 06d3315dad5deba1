"""What the study's own Hydra launchers (hydra_plugins/heisenhunt_ray_launcher, heisenhunt_slurm_launcher)
share: Hydra's `setup`, the preamble of a launch as Hydra's own launchers do it (its globals, its logging,
the sweep dir), each job's sweep config, and the message for a missing optional extra.

`StudyLauncher` leaves `launch` abstract, so Hydra's plugin scan never takes it for a launcher itself."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra.core.utils import configure_log, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict


def import_extra(modules: Sequence[str], launcher: str, extra: str, what: str) -> list[ModuleType]:
    """`modules` imported, or an ImportError naming the launcher and how to install what it needs."""
    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError as e:
        raise ImportError(
            f"hydra/launcher={launcher} needs {what}: pip install 'heisenhunt[{extra}]' ({e})"
        ) from e


class StudyLauncher(Launcher):
    hydra_context: Any = None
    task_function: Any = None
    config: DictConfig | None = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def begin_launch(self) -> DictConfig:
        """Hydra's globals and logging set up, the sweep dir made, as Hydra's launchers begin a launch;
        the sweep's config."""
        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        return self.config

    def sweep_config(self, overrides: Sequence[str], idx: int, job_id: str | None = None) -> DictConfig:
        """Job `idx`'s config: the sweep's with its overrides, numbered (and given `job_id`) as Hydra does."""
        assert self.config is not None and self.hydra_context is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.num = idx
            if job_id is not None:
                config.hydra.job.id = job_id
        return config
