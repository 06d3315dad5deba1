"""The study sweeper's config node (`hydra/sweeper=heisenhunt`), as Hydra's own sweeper plugins do it."""

# No `from __future__ import annotations`: Hydra loads plugins outside sys.modules, where dataclasses
# cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class StudySweeperConf:
    _target_: str = "hydra_plugins.heisenhunt_sweeper.study_sweeper.StudySweeper"
    max_batch_size: Optional[int] = None  # noqa: UP045 - OmegaConf needs typing.Optional here
    # key -> comma-separated values, as hydra.sweeper.params of the basic sweeper
    params: Optional[dict[str, str]] = None  # noqa: UP045
    # factorial: every combination. ofat: baseline + one factor changed at a time (see study.baseline)
    design: str = "factorial"
    # swept when neither params nor the command line sweep anything
    default_params: Optional[dict[str, str]] = field(default=None)  # noqa: UP045
    default_design: str = "ofat"


ConfigStore.instance().store(
    group="hydra/sweeper", name="heisenhunt", node=StudySweeperConf, provider="heisenhunt"
)
