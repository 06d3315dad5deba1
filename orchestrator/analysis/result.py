"""The typed study result: report.json as frozen dataclasses, from analysis to rendering.

`analysis.study.analyse` builds these from the start, each question's function returning its own part,
and returns a `StudyResult`; the Markdown, the plots, the MLflow headline and report.json itself
(`to_json`) read that one object.

The converter is driven by type hints: a dataclass is a JSON object with exactly its fields, `tuple[X, ...]`
(or `list[X]`) an array, `Mapping[str, X]` / `dict[str, X]` an object with free keys (factors, conditions,
config, ...), `X | None` null or X, `Literal[...]` one of its values, `Any` a value kept as it is.
`from_json` refuses an unknown key and a missing one, naming its path (`arms[2].foo`). The same walk of
the same hints gives report.json's JSON Schema (`json_schema`; orchestrator/report/report.schema.json is
its output, committed, and a test keeps the two equal): the JSON, its reader and its schema have one
definition, these dataclasses.

Absent vs null: a field whose default is `ABSENT` may be left out of report.json (a key only some designs
write, e.g. a hypothesis' `evidence`, only in sequential studies); `from_json` gives ABSENT for a missing
key and `to_json` leaves an ABSENT field out, so `to_json(from_json(cls, d)) == d` holds either way. Every
other field is always written; null is `None`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from orchestrator.config.schema import StudyConf


class _Absent:
    """The value of a field whose key report.json leaves out (falsy, like a missing key)."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()

# an arm's one state against the ceiling (analysis/states.py), what judged it, and a hypothesis' verdict
State = Literal["corrupting", "clean", "undetermined"]
StateSource = Literal["interval", "sequential", "ddmin"]
Verdict = Literal["implicated", "partial", "exonerated", "inconclusive"]


class ResultError(ValueError):
    """report.json's content does not match the typed result: the message names the path (`arms[2].foo`)."""

    def __init__(self, what: str, path: tuple[str | int, ...] = ()):
        self.what, self.path = what, path
        text = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
        super().__init__(f"{text or '$'}: {what}")


# --- arms --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunRow:
    """One run of an arm, pooled (`used`) or not."""

    run_id: str
    repetition: int
    status: str
    outcomes: str
    corrupted: int
    clean: int
    errored: int
    planned: int
    used: bool
    reason: str
    # seconds the run held its servers and spent in its stress phase (absent: not known, e.g. rehearsed)
    wall_s: float | None = dataclasses.field(default=ABSENT, kw_only=True)
    stress_s: float | None = dataclasses.field(default=ABSENT, kw_only=True)
    # seconds of its batch-1 reference pass (part of stress_s), of a run judged by the differential oracle
    reference_s: float | None = dataclasses.field(default=ABSENT, kw_only=True)


@dataclasses.dataclass(frozen=True)
class ThroughputLevel:
    """An arm's means over its FINISHED runs at one concurrency."""

    concurrency: int
    runs: int
    tok_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    errors: int


@dataclasses.dataclass(frozen=True)
class RunLoad:
    repetition: int
    mean: float | None
    p50: float | None
    max: float | None
    unknown: str


@dataclasses.dataclass(frozen=True)
class ArmDecodeLoad:
    """The decode's load over an arm's pooled runs (`analysis.arm_decode_load`)."""

    planned: int | None
    runs: int
    runs_measured: int
    mean: float | None
    p50: float | None
    max: float | None
    fraction: float | None
    short: bool
    unknown: tuple[str, ...]
    per_run: tuple[RunLoad, ...]


@dataclasses.dataclass(frozen=True)
class DivergedOutput:
    """One output of a diverged turn, as an example shows it (`analysis.divergence.example`)."""

    excerpt: str  # its text from the example's `start` on, bounded
    chars: int  # its whole text's length
    finish_reason: str | None
    completion_tokens: int | None


@dataclasses.dataclass(frozen=True)
class DivergenceExample:
    """One diverged session of an arm: where it first parted from its batch-1 reference, both outputs
    around that point."""

    run_id: str
    repetition: int
    session_id: str
    turn: int  # the turn (round index, from 0) that diverged
    detector: str  # diverged_early | diverged
    position: int  # the first differing token (or word, on the text basis), from 0
    basis: str  # tokens | text
    reference_token: str  # the reference's token there ("" past its end)
    under_load_token: str
    start: int  # the character both excerpts start at
    at: int  # the first character at which the two texts differ
    reference: DivergedOutput
    under_load: DivergedOutput


@dataclasses.dataclass(frozen=True)
class ArmDivergence:
    """An arm judged by the differential oracle (`analysis.divergence.arm_divergence`): each diverged
    session's first differing position and turn (pooled runs), the reference pass's cost, an example."""

    positions: tuple[int, ...]
    turns: tuple[int, ...]
    basis: Mapping[str, int]  # tokens | text -> diverged sessions compared on it
    early_tokens: int | None  # diverged_early below this position
    reference_runs: int
    reference_s: float  # the reference pass's seconds, summed over the arm's runs that recorded one
    reference_sessions: int
    reference_errored: int
    stress_s: float | None  # the same runs' stress phases (which include the reference pass)
    example: DivergenceExample | None


@dataclasses.dataclass(frozen=True)
class Arm:
    label: str
    signature: str
    deployment_signature: str
    conditions: Mapping[str, str]
    factors: Mapping[str, str]
    n: int
    corrupted: int
    clean: int
    errored: int
    rate: float | None
    run_counts: tuple[tuple[int, ...], ...]
    mean_run_size: float
    design_effect: float
    effective_n: int
    effective_corrupted: int
    ci: tuple[float | None, ...] | None
    upper_bound: float | None
    partial: bool
    client_bound: bool
    missing_usage: int
    # detector family -> sessions with a finding of it; metric name -> summed value
    families: Mapping[str, int]
    runs: tuple[RunRow, ...]
    facts: Mapping[str, float]
    # role -> {"env": ..., "flags": ..., "argv": ..., "origin": ...}, as the run logged it (redacted)
    config: Mapping[str, Any]
    throughput: tuple[ThroughputLevel, ...]
    decode_load: ArmDecodeLoad | None
    state: State | None
    # an arm judged by the differential oracle (workload.oracle=divergence); absent for the other oracles
    divergence: ArmDivergence | None = ABSENT


@dataclasses.dataclass(frozen=True)
class ArmStateRow:
    """One arm's state of the study (`states.ArmState.to_dict`)."""

    label: str
    signature: str
    factors: Mapping[str, str]
    corrupted: int
    n: int
    rate: float | None
    state: State
    bounds: tuple[float, ...] | None
    confidence: float | None
    leaning: str | None
    sessions_needed: int | None
    source: StateSource


@dataclasses.dataclass(frozen=True)
class Policy:
    name: Literal["per-arm"]
    design: str | None
    alpha: float
    confidence: float
    ceiling: float
    icc: float
    text: str


@dataclasses.dataclass(frozen=True)
class BetweenRuns:
    method: str
    estimated: bool
    dispersion: float | None
    df: int
    icc: float
    mean_run_size: float | None
    note: str


# --- hypotheses ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Log e-values of one hypothesis' claims at one look (`sequential.Evidence.as_dict`)."""

    reduction: float
    increase: float
    equivalence: float
    under: float
    over: float


@dataclasses.dataclass(frozen=True)
class MoreSessions:
    baseline: int
    treatment: int


@dataclasses.dataclass(frozen=True)
class HypothesisRow:
    id: str
    factor: str
    statement: str
    baseline_level: str
    treatment_level: str
    baseline_arm: str | None
    treatment_arm: str | None
    treatment_label: str
    baseline_counts: tuple[int, ...]
    treatment_counts: tuple[int, ...]
    baseline_runs: tuple[tuple[int, ...], ...]
    treatment_runs: tuple[tuple[int, ...], ...]
    design_effect: tuple[float, ...]
    effective_counts: tuple[tuple[int, ...], ...]
    margin: float | None
    diff: float | None
    diff_ci: tuple[float, ...] | None
    p: float
    p_holm: float
    test: str
    verdict: Verdict
    note: str
    sessions_needed_per_arm: int | None
    more_sessions: MoreSessions | None
    treatment_state: State | None
    # a sequential study's last look (None before any look); absent in a fixed design
    evidence: Evidence | None = ABSENT


# --- throughput, problem runs, deploy, families ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RatioLevel:
    concurrency: int
    ratio: float | None
    ci: tuple[float | None, ...]
    method: str
    clears_floor: bool


@dataclasses.dataclass(frozen=True)
class ThroughputRow:
    """One arm's tok/s against the baseline's (`analysis.throughput`)."""

    arm: str
    label: str
    client_bound: bool
    verdict: str
    levels: tuple[RatioLevel, ...]


@dataclasses.dataclass(frozen=True)
class ProblemRun(RunRow):
    """A run failed, interrupted or with errored sessions: its `RunRow` fields, and its arm."""

    arm: str
    signature: str


@dataclasses.dataclass(frozen=True)
class Deploy:
    arm: str
    label: str
    hypothesis: str | None
    factors: Mapping[str, str]
    throughput_verdict: str
    config: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ArmFamilies:
    label: str
    signature: str
    sessions: int
    counted: Mapping[str, int]
    noted: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Families:
    counted: tuple[str, ...]
    same_in_every_arm: bool
    by_arm: tuple[ArmFamilies, ...]


# --- sequential design ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class LookRow:
    """One hypothesis at one look."""

    evidence: Evidence
    verdict: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class Look:
    round: int
    icc: float
    arms_run: tuple[str, ...]
    sessions: int
    hypotheses: Mapping[str, LookRow]  # by hypothesis id


@dataclasses.dataclass(frozen=True)
class Thresholds:
    comparison: float
    ceiling: float


@dataclasses.dataclass(frozen=True)
class Stopping:
    """A sequential study's stopping trace (`sequential.stopping_block`)."""

    method: str
    thresholds: Thresholds
    max_runs_per_arm: int
    max_sessions: int | None
    rounds: int
    trace: tuple[Look, ...]
    decisions: Mapping[str, Decision]  # by hypothesis id
    sessions_per_arm: Mapping[str, int]  # by arm label
    sessions: int
    fixed_design_sessions: int
    benched: tuple[str, ...]


# --- cost --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CostFigures:
    """The cost model (analysis/cost.py): seconds per restart, session and sweep, GPUs, and the source of
    each figure."""

    restart_s: float
    session_s: float
    bench_s: float
    gpus: int
    sources: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class ArmCost:
    gpu_hours: float
    starts: int
    sessions: int


@dataclasses.dataclass(frozen=True)
class Cost:
    """GPU time the study's runs held (`cost.cost_block`)."""

    model: CostFigures
    gpu_hours: float
    wall_s: float
    starts: int
    sessions: int
    modelled_runs: int
    model_gpu_hours: float
    per_arm: Mapping[str, ArmCost]
    fixed_design_gpu_hours: float | None
    remaining_gpu_hours: float | None


# --- ddmin -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DifferenceRow:
    id: str
    description: str
    # role -> {"env NAME": value, "flag --x": value or None}
    sets: Mapping[str, Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class TrialEvidence:
    over: float
    under: float


@dataclasses.dataclass(frozen=True)
class Trial:
    index: int
    subset: tuple[str, ...]
    label: str
    role: str
    alpha: float
    log_threshold: float
    runs: tuple[tuple[int, ...], ...]
    corrupted: int
    sessions: int
    verdict: str | None
    evidence: TrialEvidence
    # the candidate this trial belongs to (0: the good and bad checks); absent before checks on fresh runs
    attempt: int = ABSENT


@dataclasses.dataclass(frozen=True)
class DdminSearch:
    """A ddmin study's search (`ddmin.search_block`)."""

    method: str
    differences: tuple[DifferenceRow, ...]
    icc: float
    trials: tuple[Trial, ...]
    steps: tuple[str, ...]
    done: bool
    waiting_for: tuple[str, ...] | None  # the labels of the subsets the search needs runs of next
    minimal: tuple[str, ...] | None
    deploy: tuple[str, ...] | None
    outcome: str
    error_bound: float
    error_bound_covers: str
    sessions: int
    one_at_a_time_sessions: int
    runs_started: int


# --- minimal cause -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArmCounts:
    label: str
    counts: tuple[int, ...]
    state: str


@dataclasses.dataclass(frozen=True)
class CauseArm:
    label: str
    signature: str
    factors: Mapping[str, str]
    state: State
    bounds: tuple[float, ...] | None
    counts: tuple[int, ...]
    confidence: float | None
    leaning: str | None
    sessions_needed: int | None


@dataclasses.dataclass(frozen=True)
class Necessity:
    """Whether one conjunct is shown necessary: by a pair of arms, or inferred only."""

    level: str
    evidence: str
    with_: ArmCounts | None  # report.json: `with`
    without: ArmCounts | None
    note: str
    pending: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FactorSufficiency:
    levels_with_cause: tuple[str, ...]
    levels_not_tried_with_cause: tuple[str, ...]
    status: str


@dataclasses.dataclass(frozen=True)
class Sufficiency:
    factors: Mapping[str, FactorSufficiency]
    verdict: str


@dataclasses.dataclass(frozen=True)
class Conjunction:
    levels: Mapping[str, str]
    necessary: Mapping[str, Necessity]  # by factor
    sufficient: Sufficiency
    verdict: str


@dataclasses.dataclass(frozen=True)
class Provisional:
    conjunctions: tuple[Mapping[str, str], ...]
    rests_on: tuple[str, ...]
    note: str


@dataclasses.dataclass(frozen=True)
class Modulator:
    factor: str
    within: Mapping[str, str]
    levels: tuple[str, ...]
    arms: tuple[ArmCounts, ...]
    rates: tuple[float, ...]
    difference: float
    ci: tuple[float, ...]
    confidence: float
    pairs_compared: int


@dataclasses.dataclass(frozen=True)
class Factorial:
    factors: tuple[str, ...]
    fixed: Mapping[str, str]
    arms: tuple[ArmCounts, ...]
    method: str


@dataclasses.dataclass(frozen=True)
class Effect:
    kind: str
    factors: tuple[str, ...]
    levels: Mapping[str, tuple[str, ...]]  # factor -> its two levels
    description: str
    estimate: float
    ci: tuple[float, ...]
    confidence: float
    excludes_zero: bool


@dataclasses.dataclass(frozen=True)
class MinimalCause:
    """The smallest conjunctions of factor levels the arms' states say corruption needs (`cause`)."""

    confidence: float
    arm_confidence: float
    method: str
    ceiling: float
    arms: tuple[CauseArm, ...]
    conjunctions: tuple[Conjunction, ...]
    provisional: Provisional | None
    modulators: tuple[Modulator, ...]
    factorial: Factorial | None
    effects: tuple[Effect, ...] | None
    limits: tuple[str, ...]
    verdict: str
    summary: str


# --- clusters ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cell:
    """One arm's used runs on one cluster."""

    runs: int
    sessions: int
    corrupted: int
    rate: float | None
    run_counts: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class ClusterArm:
    label: str
    signature: str
    cells: Mapping[str, Cell]  # by cluster
    share: Mapping[str, float]  # by known cluster


@dataclasses.dataclass(frozen=True)
class Lease:
    cluster: str
    pools: tuple[str, ...]
    members: tuple[str, ...]
    by: tuple[str, ...]
    arms: tuple[str, ...]
    runs: int
    first_start: str | None
    last_end: str | None
    busy_s: float
    span_s: float | None
    busy_fraction: float | None
    overlap_s: float
    open: int


@dataclasses.dataclass(frozen=True)
class PlacedRun:
    """A run lost with its lease, or one that took a member over from a lost holder."""

    arm: str
    signature: str
    run_id: str
    repetition: int
    status: str
    cluster: str
    member: str | None
    lease_start: str | None
    lease_end: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class ClusterCounts:
    runs: int
    sessions: int
    corrupted: int
    rate: float | None


@dataclasses.dataclass(frozen=True)
class ClusterTest:
    """One arm's test of one rate on every cluster."""

    label: str
    signature: str
    clusters: Mapping[str, ClusterCounts]
    tested: bool
    p: float | None
    p_holm: float | None
    differs: bool
    note: str


@dataclasses.dataclass(frozen=True)
class CheckIcc:
    source: str
    dispersion: float | None
    df: int
    icc: float
    note: str


@dataclasses.dataclass(frozen=True)
class ClusterCheck:
    method: str
    alpha: float
    icc: CheckIcc
    arms: tuple[ClusterTest, ...]
    tested: int
    alarm: bool
    verdict: str


@dataclasses.dataclass(frozen=True)
class Balance:
    balanced: bool
    shares: Mapping[str, Mapping[str, float]]  # arm -> cluster -> share of its runs
    note: str


@dataclasses.dataclass(frozen=True)
class Clusters:
    """Where the arms ran (`clusters.clusters_report`)."""

    clusters: tuple[str, ...]
    unknown_runs: int
    pools: tuple[str, ...]
    sentence: str
    by_arm: tuple[ClusterArm, ...]
    leases: tuple[Lease, ...]
    lost: tuple[PlacedRun, ...]
    recovered: tuple[PlacedRun, ...]
    check: ClusterCheck
    balance: Balance | None


# --- machines ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MachineRow:
    """One server role on one machine and engine, and the runs that ran on it (`machines.machines_block`);
    a field the runs did not record is null."""

    role: str
    hostname: str | None
    gpu: str | None  # e.g. "1 x NVIDIA H200"
    driver: str | None
    torch: str | None
    cuda: str | None  # the CUDA torch was built for
    sglang: str | None  # the engine's version
    python: str | None
    runs: tuple[str, ...]  # run ids


@dataclasses.dataclass(frozen=True)
class Machines:
    """What the study's runs ran on, from their provenance tags (`machines.machines_block`)."""

    rows: tuple[MachineRow, ...]
    differs: Mapping[str, tuple[str, ...]]  # role -> the fields that differ between its runs
    unrecorded: int  # runs that recorded no machine


# --- the study ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StudyResult:
    """report.json (schema `analysis.SCHEMA_VERSION`), section by section."""

    schema: int
    study: StudyConf  # the study as configured (schema.py: its one definition)
    # what the report quotes verbatim: parent run id, overrides, design, conditions, pooled runs
    context: Mapping[str, Any]
    headline: str
    confidence: float
    between_runs: BetweenRuns
    policy: Policy
    arm_states: tuple[ArmStateRow, ...]
    arms: tuple[Arm, ...]
    hypotheses: tuple[HypothesisRow, ...]
    throughput: tuple[ThroughputRow, ...]
    problem_runs: tuple[ProblemRun, ...]
    deploy: Deploy | None
    stopping: Stopping | None
    families: Families
    ddmin: DdminSearch | None
    minimal_cause: MinimalCause | None
    clusters: Clusters | None
    # absent in reports written before GPU time was reported
    cost: Cost | None = ABSENT
    # absent where no run recorded a GPU, driver, torch, CUDA or engine version (the embedded default),
    # and in reports written before the runs' machines were reported
    machines: Machines | None = ABSENT


# --- the converter -----------------------------------------------------------------------------------


def _key(field: dataclasses.Field) -> str:
    """A field's JSON key: a Python keyword gets a trailing underscore (`with_`)."""
    return field.name[:-1] if field.name.endswith("_") else field.name


def from_json(cls: Any, data: Any) -> Any:
    """`data` (report.json's content, or a part of it) as `cls`; ResultError naming the path on an unknown
    or missing key, or a value of another type."""
    return _loader(cls)(data)


def _under(key: str | int, load: Loader, value: Any) -> Any:
    """`load(value)`, an error's path prefixed with `key` (paths are built only when something fails)."""
    try:
        return load(value)
    except ResultError as e:
        raise ResultError(e.what, (key, *e.path)) from None


Loader = Callable[[Any], Any]


@functools.cache
def _loader(tp: Any) -> Loader:
    """The function that reads a JSON value as `tp`, built once per type (analysis runs often)."""
    origin = get_origin(tp)
    if tp is Any:
        return lambda value: value
    if origin in (Union, types.UnionType):
        others = [a for a in get_args(tp) if a is not type(None)]
        if len(others) != 1 or len(get_args(tp)) != 2:
            raise TypeError(f"only `X | None` unions are supported, not {tp}")
        inner = _loader(others[0])
        return lambda value: None if value is None else inner(value)
    if origin is Literal:
        return _literal_loader(get_args(tp))
    if origin in (tuple, list):
        return _array_loader(_loader(get_args(tp)[0]), tuple if origin is tuple else list)
    if origin in (dict, Mapping):
        return _map_loader(_loader(get_args(tp)[1]))
    if dataclasses.is_dataclass(tp):
        return _dataclass_loader(tp)
    if tp in _PRIMITIVES:
        return _primitive_loader(tp, _PRIMITIVES[tp])
    raise TypeError(f"unsupported type {tp!r}")


def _literal_loader(values: tuple[Any, ...]) -> Loader:
    def load(value: Any) -> Any:
        if value not in values or isinstance(value, bool) != isinstance(values[0], bool):
            raise ResultError(f"expected one of {list(values)}, got {value!r}")
        return value

    return load


def _array_loader(item: Loader, make: type) -> Loader:
    def load(value: Any) -> Any:
        if not isinstance(value, (list, tuple)):  # a tuple: analysis' own value, before it is JSON
            raise ResultError(f"expected an array, got {type(value).__name__}")
        return make(_under(i, item, v) for i, v in enumerate(value))

    return load


def _map_loader(item: Loader) -> Loader:
    def load(value: Any) -> Any:
        if not isinstance(value, dict):
            raise ResultError(f"expected an object, got {type(value).__name__}")
        return {k: _under(k, item, v) for k, v in value.items()}

    return load


def _dataclass_loader(cls: type) -> Loader:
    hints = get_type_hints(cls)
    # JSON key -> (field name, its loader, whether the key may be absent)
    fields = {_key(f): (f.name, _loader(hints[f.name]), f.default is ABSENT) for f in dataclasses.fields(cls)}

    def load(value: Any) -> Any:
        if not isinstance(value, dict):
            raise ResultError(f"expected an object ({cls.__name__}), got {type(value).__name__}")
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ResultError(f"unknown key (not a field of {cls.__name__})", (unknown[0],))
        values = {}
        for key, (name, field_load, may_be_absent) in fields.items():
            if key in value:
                values[name] = _under(key, field_load, value[key])
            elif may_be_absent:
                values[name] = ABSENT
            else:
                raise ResultError(f"missing key (a field of {cls.__name__})", (key,))
        return cls(**values)

    return load


# a float accepts an int (a study's settings may be written as ints); a bool is no int
_PRIMITIVES: dict[type, Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _primitive_loader(tp: type, ok: Callable[[Any], bool]) -> Loader:
    def load(value: Any) -> Any:
        if not ok(value):
            raise ResultError(f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value

    return load


def to_json(obj: Any) -> Any:
    """report.json's content of a typed result (or a part of it): a dataclass gives every field (but an
    ABSENT one), tuples give lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            _key(f): to_json(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if getattr(obj, f.name) is not ABSENT
        }
    if isinstance(obj, Mapping):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


# --- the JSON Schema ---------------------------------------------------------------------------------

_SCHEMA_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `cls` as `from_json` reads it: each dataclass a `$defs` entry, an
    object with exactly its keys (those whose default is ABSENT not required), the rest as `_loader`."""
    defs: dict[str, Any] = {}
    root = _schema(cls, defs)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = get_origin(tp)
    if tp is Any:
        return {}
    if origin in (Union, types.UnionType):
        inner = next(a for a in get_args(tp) if a is not type(None))
        return {"anyOf": [_schema(inner, defs), {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    if origin in (tuple, list):
        return {"type": "array", "items": _schema(get_args(tp)[0], defs)}
    if origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _schema(get_args(tp)[1], defs)}
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # a placeholder first: a type may name itself
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if tp in _SCHEMA_TYPES:
        return {"type": _SCHEMA_TYPES[tp]}
    raise TypeError(f"unsupported type {tp!r}")


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    return {
        "type": "object",
        "properties": {_key(f): _schema(hints[f.name], defs) for f in fields},
        "required": [_key(f) for f in fields if f.default is not ABSENT],
        "additionalProperties": False,
    }


def report_schema() -> dict[str, Any]:
    """report.json's JSON Schema: orchestrator/report/report.schema.json is this, committed (regenerate it
    with `python -m orchestrator.report --schema > orchestrator/report/report.schema.json`)."""
    return {
        "$id": "heisenhunt/report.schema.json",
        "title": "heisenhunt report.json",
        "description": (
            "A study's report, generated from its types (orchestrator/analysis/result.py), which "
            "orchestrator.analysis.analyse returns; checked by python -m orchestrator.report --check."
        ),
        **json_schema(StudyResult),
    }
