"""What the study's runs ran on (report.json: `machines`), from each run's provenance tags
(`RunRecord.machine`): per server role, each distinct combination of hostname, GPUs, driver, torch, the
CUDA torch was built for, the engine (sglang) and python, with the runs that had it. Usually one row per
role for the whole study; more when runs differ, which the block says (`differs`): a difference between
arms may then be the machine's or the engine's. Pure.

No block (None) when no run recorded a GPU, driver, torch, CUDA or sglang version (`runs.MACHINE_SIGNS`):
the embedded default, on a host without torch, GPUs or sglang, records only a hostname and python, and its
reports stay as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.analysis.result import MachineRow, Machines
from orchestrator.analysis.runs import MACHINE_KEYS, MACHINE_SIGNS, RunRecord

# RunRecord.machine's keys (the provenance tags' names) -> report.json's
FIELDS = {
    "hostname": "hostname",
    "gpu": "gpu",
    "driver_version": "driver",
    "torch_version": "torch",
    "cuda_version": "cuda",
    "sglang_version": "sglang",
    "python_version": "python",
}
assert tuple(FIELDS) == MACHINE_KEYS
# the roles in the order a PD deployment starts them; any other after them, by name
ROLE_ORDER = ("prefill", "decode", "router")


def _role_key(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


def machines_block(runs: Sequence[RunRecord]) -> Machines | None:
    """report.json's `machines`: `rows` (role, the machine's fields, the ids of the runs that had it; by
    role, the machine most runs had first, then by each one's first run in `runs`' order), `differs`
    (role -> the fields that differ between its runs; empty when every role ran on one machine),
    `unrecorded` (runs that recorded no machine for any role). None when no run shows a real machine or
    engine (module doc)."""
    if not any(key in found for r in runs for found in r.machine.values() for key in MACHINE_SIGNS):
        return None
    combos: dict[tuple[str, tuple[str | None, ...]], list[str]] = {}
    for r in runs:
        for role, found in r.machine.items():
            values = tuple(found.get(key) for key in MACHINE_KEYS)
            combos.setdefault((role, values), []).append(r.run_id)
    rows = [
        MachineRow(
            role=role, **{FIELDS[k]: v for k, v in zip(MACHINE_KEYS, values, strict=True)}, runs=tuple(ids)
        )
        # by role; within a role, the machine most runs ran on first (ties: the first run's order)
        for (role, values), ids in sorted(
            combos.items(), key=lambda item: (_role_key(item[0][0]), -len(item[1]))
        )
    ]
    differs: dict[str, tuple[str, ...]] = {}
    for role in sorted({row.role for row in rows}, key=_role_key):
        mine = [row for row in rows if row.role == role]
        fields = tuple(f for f in FIELDS.values() if len({getattr(row, f) for row in mine}) > 1)
        if fields:
            differs[role] = fields
    return Machines(rows=tuple(rows), differs=differs, unrecorded=sum(1 for r in runs if not r.machine))
