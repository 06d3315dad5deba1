"""A SLURM job's allocation as a cluster: which node each role runs on, and the job's provenance.

`conf/cluster/slurm.yaml` places the roles with two resolvers, read when the arm's job starts (inside its
SLURM job, where `SLURM_JOB_NODELIST` names the allocation):

- `${slurm_node:I}`: the I-th node of the allocation (0 the first; taken modulo the number of nodes, so
  `prefill: 0, decode: 1` puts both on the one node of a single-node job);
- `${slurm_transport:I}`: `local` when that node is the one the job runs on, else `ssh`.

Outside an allocation (the study's driver, composing and checking the sweep before any job is submitted)
both name this machine: 127.0.0.1 through the local transport.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

OUTSIDE = "127.0.0.1"
# provenance of an arm's run: tag -> the job's environment variable
TAGS = {
    "slurm.job_id": "SLURM_JOB_ID",
    "slurm.nodes": "SLURM_JOB_NODELIST",
    "slurm.partition": "SLURM_JOB_PARTITION",
    "slurm.cluster": "SLURM_CLUSTER_NAME",
}


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list as names: `gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1 (the
    forms `scontrol show hostnames` expands, without calling it; one bracket per name)."""
    names: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", nodelist):
        if not ranges:
            names.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                names.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo) if lo.startswith("0") else 0
            names += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
    return names


def allocation(env: Mapping[str, str] | None = None) -> list[str]:
    """The nodes of the SLURM job this process runs in ([] outside one)."""
    env = os.environ if env is None else env
    return expand_nodelist(env.get("SLURM_JOB_NODELIST", ""))


def node(index: int | str, env: Mapping[str, str] | None = None) -> str:
    nodes = allocation(env)
    return nodes[int(index) % len(nodes)] if nodes else OUTSIDE


def _short(name: str) -> str:
    return name.split(".")[0]


def transport(index: int | str, env: Mapping[str, str] | None = None, here: str | None = None) -> str:
    env = os.environ if env is None else env
    nodes = allocation(env)
    if not nodes:
        return "local"
    here = here or env.get("SLURMD_NODENAME") or socket.gethostname()
    return "local" if _short(node(index, env)) == _short(here) else "ssh"


def allocation_tags(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The SLURM job an arm ran in, as its run's tags ({} outside SLURM)."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return {}
    return {tag: env[var] for tag, var in TAGS.items() if env.get(var)}
