"""A study's runs as the analysis reads them (one `RunRecord` per MLflow child run), the arm a run
belongs to (`identity`), and which runs an arm pools (`run_used`): the vocabulary the designs
(orchestrator/study/designs.py), the rehearsal and the analysis share. See the package doc for the rules."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LevelSample:
    """One concurrency level of one run's throughput sweep."""

    concurrency: int
    tok_s: float
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    itl_p50_s: float = math.nan
    itl_p99_s: float = math.nan
    errors: int = 0
    request_tokens: tuple[float, ...] = ()
    request_latency_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class RunRecord:
    """What the analysis needs of one child run (an arm x repetition), as read back from MLflow."""

    run_id: str
    status: str  # FINISHED | FAILED | KILLED | RUNNING
    signature: str
    repetition: int
    factors: dict[str, str]
    outcomes: str = "none"  # none | partial | complete: whether stress outcomes were logged
    clean: int = 0
    corrupted: int = 0
    errored: int = 0
    planned: int = 0
    reason: str = ""
    client_bound: bool = False
    missing_usage: int = 0  # bench responses without a usage block (the server's doing)
    # detector family -> sessions with a finding of it, counted or noted beside (absent: not logged)
    families: dict[str, int] = field(default_factory=dict)
    bench: tuple[LevelSample, ...] = ()
    # role -> {"env": {NAME: value}, "flags": "...", "argv": "..."} (already redacted)
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    facts: dict[str, float] = field(default_factory=dict)
    # what else changes what a session measures (deployment, workload settings): part of the arm's identity
    conditions: dict[str, str] = field(default_factory=dict)
    # the decode's load during the stress run (decode_load.from_record): planned, measured, unknown (why),
    # mean, p50, max; {} for runs logged before it was recorded
    decode_load: dict[str, Any] = field(default_factory=dict)
    # where it ran: its `cluster` tag and, on a pool, `cluster_pool`, `cluster_pool.member` and `lease.*`
    # (clusters.placement_of); {} for runs logged before runs recorded it (cluster unknown)
    placement: dict[str, str] = field(default_factory=dict)
    # seconds the run held its servers (first start to the end of teardown: `servers_held_s`) and spent in
    # its stress phase; None where not recorded (older runs, rehearsed ones): what analysis/cost.py measures
    wall_s: float | None = None
    stress_s: float | None = None
    # the differential oracle's record of the run, as its stress/summary.json keeps it: `reference` (the
    # batch-1 reference pass: duration_s, sessions, errored, turns, completion_tokens, with_tokens) and
    # `divergence` (positions, turns, basis of each diverged session); {} for runs of other oracles and runs
    # logged before it
    reference: dict[str, Any] = field(default_factory=dict)
    divergence: dict[str, Any] = field(default_factory=dict)
    # one diverged session's artifact (stress/corrupted/<session>.json), read for one run per arm
    # (`example_run`): the report's example of a divergence; None on every other run
    divergence_example: dict[str, Any] | None = None
    # what each server role ran on, from its `provenance.<role>.*` tags (`machine_of`): role -> {key: value}
    # for the `MACHINE_KEYS` it recorded (hostname, GPUs, driver, torch, CUDA, engine, python); {} for runs
    # that recorded none (failed before their host checks, logged before provenance)
    machine: dict[str, dict[str, str]] = field(default_factory=dict)


def identity(run: RunRecord) -> str:
    """The arm a run belongs to: its signature, and a short hash of its conditions when it has any."""
    if not run.conditions:
        return run.signature
    text = "|".join(f"{k}={v}" for k, v in sorted(run.conditions.items()))
    return f"{run.signature}/{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def run_used(run: RunRecord) -> bool:
    """Whether a run's stress outcomes are pooled: FINISHED with complete outcomes (see the module doc)."""
    return run.status == "FINISHED" and run.outcomes == "complete"


# the condition that names the oracle a run was judged by (config/plan.py measurement_conditions); the
# tool-call oracle, the default, adds none
ORACLE_CONDITION = "workload.oracle"
DEFAULT_ORACLE = "tool_calls"
DIVERGENCE = "divergence"


def oracle_of(conditions: Mapping[str, str]) -> str:
    """The oracle that judged a run (or an arm) of these conditions."""
    return conditions.get(ORACLE_CONDITION, DEFAULT_ORACLE)


def symptom_of(conditions: Mapping[str, str]) -> str:
    """What a corrupted session of these conditions is: the oracle, "+answers" where the families it
    counted include a missed expected answer (a prompts file's `expected`) beside the oracle's own."""
    counted = conditions.get("workload.count", "").split(",")
    return oracle_of(conditions) + ("+answers" if "wrong_answer" in counted else "")


def example_run(runs: Sequence[RunRecord]) -> RunRecord | None:
    """The run whose diverged session an arm shows as its example: the first pooled run (by repetition,
    then id) with a diverged session; None when the arm has none."""
    found = [r for r in runs if run_used(r) and r.divergence.get("positions")]
    return min(found, key=lambda r: (r.repetition, r.run_id), default=None)


# the run tags that say where a run ran (`RunRecord.placement`)
PLACEMENT_TAGS = ("cluster", "cluster_pool", "cluster_pool.member")
LEASE_PREFIX = "lease."


def placement_of(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags of a run that say where it ran and its lease (what `RunRecord.placement` keeps)."""
    return {k: v for k, v in sorted(tags.items()) if k in PLACEMENT_TAGS or k.startswith(LEASE_PREFIX)}


# the `provenance.<role>.<key>` tags that say what a role ran on (arm.host_checks, run/preflight.py
# HostProvenance), in the report's order; a value MLflow keeps as "None" was not known
PROVENANCE_PREFIX = "provenance."
MACHINE_KEYS = (
    "hostname",
    "gpu",
    "driver_version",
    "torch_version",
    "cuda_version",
    "sglang_version",
    "python_version",
)
# the keys that say a run ran on a real machine under a real engine (the embedded default, on a host
# without torch, GPUs or sglang, records only its hostname and python): without one of them on some run,
# the report shows no machine
MACHINE_SIGNS = ("gpu", "driver_version", "torch_version", "cuda_version", "sglang_version")


def machine_of(tags: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """What each role of a run ran on (`RunRecord.machine`), from its provenance tags (pure)."""
    out: dict[str, dict[str, str]] = {}
    for key, value in sorted(tags.items()):
        role, _, name = key.removeprefix(PROVENANCE_PREFIX).partition(".")
        if key.startswith(PROVENANCE_PREFIX) and name in MACHINE_KEYS and value not in ("", "None"):
            out.setdefault(role, {})[name] = value
    return out
