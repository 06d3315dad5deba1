"""`hydra/launcher=heisenhunt_slurm`: each arm one SLURM job, submitted with submitit (slurm_launcher.py)."""

# No `from __future__ import annotations` (see the sweeper's plugin).
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class SlurmLauncherConf:
    _target_: str = "hydra_plugins.heisenhunt_slurm_launcher.slurm_launcher.SlurmLauncher"
    # where submitit keeps each job's pickles, sbatch script and stdout/stderr (%j: the job id); on a
    # filesystem the nodes share
    submitit_folder: str = "${hydra.sweep.dir}/.slurm/%j"
    # sbatch options, as submitit's SlurmExecutor takes them (time in minutes, partition, nodes, account,
    # qos, gpus_per_node, mem_gb, additional_parameters, setup, ...). exclusive: the allocation is the
    # arm's whole cluster, so two arms never share its nodes (and their ports). signal_delay_s: SIGUSR2
    # this long before the time limit, which ends the arm (FAILED, "time limit") with its teardown done
    # before SLURM kills the job
    sbatch: dict[str, Any] = field(
        default_factory=lambda: {
            "time": 60,
            "nodes": 1,
            "exclusive": True,
            "cpus_per_task": 1,
            "signal_delay_s": 60,
            # null: not passed (SLURM's default); other options with +hydra.launcher.sbatch.NAME=...
            "partition": None,
            "account": None,
            "qos": None,
            "gpus_per_node": None,
            "mem_gb": None,
            "constraint": None,
        }
    )
    # after Ctrl-C, how long the running arms get to tear down their servers after `scancel` before their
    # jobs are killed (SLURM's own KillWait bounds it too)
    teardown_s: float = 120.0
    # how often squeue is asked for the jobs' states
    poll_s: float = 1.0


ConfigStore.instance().store(
    group="hydra/launcher", name="heisenhunt_slurm", node=SlurmLauncherConf, provider="heisenhunt"
)
