"""The fault model of the simulated target: which configurations corrupt tool calls, how often, how, and
how fast the simulated GPU runs. Loaded from a YAML file (format in docs/fault-model.md); the built-in
model (`builtin_fault_model.yaml`, next to this file) reproduces the original investigation.

Pure: `load_fault_model(path)` / `validate_fault_model(data)` turn a file / a mapping into a checked
`FaultModel` or raise `FaultModelError` naming the bad key and what is accepted; the orchestrator calls
them in its preflight. `FaultModel.rule_for(prefill, decode)` picks the first rule whose conditions
hold over the effective config of both roles; `Rule.probability(batch)` and `ThroughputModel.step_s`
are plain interpolations.

Between-start variation (`restart_icc`): a real heisenbug's rate moves from one server start to the
next (what a captured graph happens to alias is decided once per start). A rule with `restart_icc` rho
> 0 makes each decode start draw one quantile u ~ U(0, 1) for the rule (`draw_restart_quantiles`); a
session whose rate would be q (`session_rate`) then has rate `restart_rate(q, u, rho)`, the u-quantile
of the Beta distribution with mean q and intra-class correlation rho. Over starts that rate has mean
q (the start's multiplier, restart_rate / q, has mean 1) and variance rho q (1 - q), so the sessions
of one start have intra-class correlation rho whatever q is: outcomes of one start are beta-binomial.
The same u serves every load, so a start that is unlucky at one batch is unlucky at all of them.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.sim.args import arg_types
from orchestrator.sim.envs import ENV_VARS

BUILTIN_PATH = Path(__file__).with_name("builtin_fault_model.yaml")
# the env var naming a fault-model file for a sim server (unset: the built-in model)
FAULT_MODEL_ENV = "HEISENHUNT_SIM_FAULT_MODEL"
FORMAT_VERSION = 1
ROLES = ("prefill", "decode")
SHAPES = (
    "truncated_arguments",
    "invalid_json",
    "unknown_tool",
    "leaked_text",
    "repetition",
    "wrong_arguments",
)
TOP_KEYS = ("version", "name", "description", "seed", "rules", "batch_variance", "throughput")
BATCH_VARIANCE_KEYS = ("probability", "restart_icc")
RULE_KEYS = ("name", "when", "probability", "shapes", "restart_icc")
THROUGHPUT_KEYS = (
    "graph_step_ms",
    "eager_step_ms",
    "multi_stream_overhead",
    "deterministic_overhead",
    "prefill_base_ms",
    "prefill_per_token_ms",
    "startup_s",
)


class FaultModelError(ValueError):
    """A fault-model file or mapping that does not follow the documented format."""


# --- effective config of a role ---------------------------------------------------------------


@dataclass(frozen=True)
class RoleConfig:
    """What a role actually runs with: parsed `SGLANG_*` env and resolved flags (by argparse dest)."""

    role: str
    env: Mapping[str, Any]
    args: Mapping[str, Any]

    def get(self, path: str) -> Any:
        """`env.NAME` or `args.dest`."""
        kind, _, name = path.partition(".")
        return (self.env if kind == "env" else self.args).get(name)

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "env": dict(self.env), "args": dict(self.args)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoleConfig:
        return cls(role=str(data["role"]), env=dict(data["env"]), args=dict(data["args"]))


# --- curves -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """Points (x ascending) joined by straight lines. Flat outside the points, or, with `extrapolate`,
    continued past the last point along the last segment's slope."""

    points: tuple[tuple[float, float], ...]
    extrapolate: bool = False

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        if x <= xs[0]:
            return self.points[0][1]
        if x >= xs[-1]:
            if self.extrapolate and len(xs) > 1:
                (x0, y0), (x1, y1) = self.points[-2], self.points[-1]
                return y1 + (x - x1) * (y1 - y0) / (x1 - x0)
            return self.points[-1][1]
        i = bisect.bisect_right(xs, x)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


# --- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    name: str
    when: Mapping[str, tuple[Any, ...]]  # "decode.env.X" -> accepted values
    curve: Curve  # per-turn corruption probability over the decode batch
    shapes: Mapping[str, float]  # shape -> weight (> 0 only)
    # intra-class correlation of session outcomes within one server start (0: sessions independent)
    restart_icc: float = 0.0

    def matches(self, prefill: RoleConfig, decode: RoleConfig) -> bool:
        roles = {"prefill": prefill, "decode": decode}
        for key, accepted in self.when.items():
            role, _, path = key.partition(".")
            if roles[role].get(path) not in accepted:
                return False
        return True

    def probability(self, batch: int) -> float:
        """Per-turn probability for a request admitted into a decode batch of `batch` requests.
        A request alone in its batch is never corrupted: the modelled fault is a race between requests."""
        if batch <= 1:
            return 0.0
        return min(1.0, max(0.0, self.curve(batch)))

    def turn_probability(self, batch: int, turns: int, quantile: float | None) -> float:
        """`probability(batch)` as this server start sees it: the per-turn probability that gives a
        session of `turns` planned tool calls at this batch the start's rate (see the module doc)."""
        p = self.probability(batch)
        if quantile is None or self.restart_icc == 0 or turns < 1 or p in (0.0, 1.0):
            return p
        rate = restart_rate(session_rate(p, turns), quantile, self.restart_icc)
        return 1.0 - (1.0 - rate) ** (1.0 / turns)


def session_rate(p_turn: float, turns: int) -> float:
    """Probability that a session of `turns` planned tool calls, each corrupted with probability
    `p_turn` independently, has at least one corrupted turn (it ends at the first)."""
    return 1.0 - (1.0 - p_turn) ** turns


@functools.lru_cache(maxsize=4096)
def restart_rate(q: float, quantile: float, icc: float) -> float:
    """The session rate of a server start whose draw is `quantile`: the quantile of Beta(mean q, ICC
    icc), i.e. Beta(q (1 - icc) / icc, (1 - q) (1 - icc) / icc); q itself when icc is 0. Cached: a
    start asks it at every turn with its one quantile and the few rates its rules give (7% of a
    decode's CPU under a study's load, before)."""
    if icc <= 0 or q <= 0 or q >= 1:
        return q
    if icc >= 1:  # every session of a start alike: the start is all corrupted or all clean
        return 1.0 if quantile < q else 0.0
    scale = (1 - icc) / icc
    return beta_quantile(q * scale, (1 - q) * scale, quantile)


def beta_quantile(a: float, b: float, quantile: float) -> float:
    """The `quantile` of Beta(a, b) (scipy's betaincinv): Newton's method on the regularized incomplete
    beta, kept inside a bisection bracket. Written out because importing scipy.special costs a sim server
    ~0.35 s of CPU at every start, for one number per rule; tests/sim/test_fault_model.py checks it
    against scipy."""
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    low, high, x = 0.0, 1.0, a / (a + b)
    for _ in range(200):
        miss = _regularized_beta(a, b, x) - quantile
        if miss < 0:
            low = x
        else:
            high = x
        density = math.exp((a - 1) * math.log(x) + (b - 1) * math.log1p(-x) - log_beta)
        step = x - miss / density if density > 0 else math.nan
        new = step if low < step < high else (low + high) / 2  # a step out of the bracket: bisect
        if abs(new - x) <= 1e-15 * x or new in (low, high):
            return new
        x = new
    return x


def _regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), by its continued fraction on the side where it converges fast (Numerical Recipes 6.4)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method."""
    tiny = 1e-300

    def nonzero(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1.0 / nonzero(1.0 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 10_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 / nonzero(1.0 + numerator * d)
            c = nonzero(1.0 + numerator / c)
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def draw_restart_quantiles(rules: Sequence[Rule], rng: Any) -> dict[str, float]:
    """One quantile per rule with restart_icc > 0, drawn once per server start (`rng.random()`)."""
    return {rule.name: rng.random() for rule in rules if rule.restart_icc > 0}


@dataclass(frozen=True)
class ThroughputModel:
    graph_step: Curve  # ms per decode step in a captured graph, over the running batch
    eager_step: Curve  # ms per eager decode step, over the running batch
    multi_stream_overhead: float  # fraction added to captured steps when multi-stream overlap is on
    prefill_base_ms: float
    prefill_per_token_ms: float
    startup_s: float  # load + capture before /health turns 200 (modelled seconds)
    # fraction added to every decode step on a decode with --enable-deterministic-inference
    deterministic_overhead: float = 0.0

    def step_s(self, batch: int, captured: bool, multi_stream: bool, deterministic: bool = False) -> float:
        """Modelled seconds of one decode step that advances `batch` requests by one token."""
        if captured:
            ms = self.graph_step(batch) * (1.0 + (self.multi_stream_overhead if multi_stream else 0.0))
        else:
            ms = self.eager_step(batch)
        return ms * (1.0 + (self.deterministic_overhead if deterministic else 0.0)) / 1000.0

    def prefill_s(self, tokens: int) -> float:
        return (self.prefill_base_ms + self.prefill_per_token_ms * tokens) / 1000.0


@dataclass(frozen=True)
class BatchVariance:
    """Benign batch variance: a turn of free text that joins a decode load of `batch` requests comes out
    different from its batch-1 output with probability `curve(batch)`, in every configuration, with no
    fault at all (a near-tie's argmax flips with the reduction order a batch size picks). A tool call's
    tokens are near-certain, so only free text flips. Batch 1 never flips: it is the reference."""

    curve: Curve
    restart_icc: float = 0.0

    def probability(self, batch: int) -> float:
        return 0.0 if batch <= 1 else min(1.0, max(0.0, self.curve(batch)))


@dataclass(frozen=True)
class FaultModel:
    name: str
    description: str
    seed: int | None
    rules: tuple[Rule, ...]
    throughput: ThroughputModel
    source: str = "<mapping>"
    # argmax flips that batching alone causes, with no fault (module doc); None: batch-invariant
    batch_variance: BatchVariance | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def rule_for(self, prefill: RoleConfig, decode: RoleConfig) -> Rule | None:
        """The first rule whose conditions hold for this pair of roles, or None (never corrupts)."""
        for rule in self.rules:
            if rule.matches(prefill, decode):
                return rule
        return None


# --- loading and validation -------------------------------------------------------------------


def condition_keys() -> dict[str, type]:
    """Every key a rule's `when` may test, with the type of its value."""
    keys: dict[str, type] = {}
    types = arg_types()
    for role in ROLES:
        for name, spec in ENV_VARS.items():
            keys[f"{role}.env.{name}"] = spec.kind
        for dest, kind in types.items():
            keys[f"{role}.args.{dest}"] = kind
    return keys


def load_fault_model(path: str | Path | None = None) -> FaultModel:
    """Read and validate a fault-model YAML file; `None` gives the built-in model.
    Raises FaultModelError (a ValueError) with the file name, the bad key and what is accepted."""
    source = Path(path) if path is not None else BUILTIN_PATH
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as e:
        raise FaultModelError(f"fault model {source}: cannot read: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise FaultModelError(f"fault model {source}: not valid YAML: {e}") from e
    return validate_fault_model(data, source=str(source))


def validate_fault_model(data: Any, source: str = "<mapping>") -> FaultModel:
    """Check a parsed fault model (see docs/fault-model.md) and build it. Missing `throughput` keys
    are taken from the built-in model."""

    def fail(where: str, message: str) -> FaultModelError:
        return FaultModelError(f"fault model {source}: {where}: {message}")

    if not isinstance(data, Mapping):
        raise fail("top level", f"expected a mapping with keys {', '.join(TOP_KEYS)}, got {_kind(data)}")
    _no_unknown(data, TOP_KEYS, "top level", fail)
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise fail("version", f"unsupported format version {version!r}; accepted: {FORMAT_VERSION}")
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        raise fail("name", "expected a non-empty string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail("description", "expected a string")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise fail("seed", f"expected an integer or null, got {seed!r}")
    rules_data = data.get("rules", [])
    if not isinstance(rules_data, list):
        raise fail("rules", f"expected a list of rules, got {_kind(rules_data)}")
    keys = condition_keys()
    rules = tuple(_rule(r, f"rules[{i}]", keys, fail) for i, r in enumerate(rules_data))
    names = [r.name for r in rules]
    for rule_name in names:
        if names.count(rule_name) > 1:
            raise fail("rules", f"rule name {rule_name!r} is used twice; names must be unique")
    throughput = _throughput(data.get("throughput", {}), fail, source)
    variance = (
        _batch_variance(data["batch_variance"], fail) if data.get("batch_variance") is not None else None
    )
    return FaultModel(
        name, description, seed, rules, throughput, source=source, raw=dict(data), batch_variance=variance
    )


def _batch_variance(data: Any, fail) -> BatchVariance:
    if not isinstance(data, Mapping) or "probability" not in data:
        raise fail("batch_variance", f"expected a mapping with keys {', '.join(BATCH_VARIANCE_KEYS)}")
    _no_unknown(data, BATCH_VARIANCE_KEYS, "batch_variance", fail)
    icc = data.get("restart_icc", 0.0)
    if isinstance(icc, bool) or not isinstance(icc, int | float) or not 0 <= icc <= 1:
        raise fail("batch_variance.restart_icc", f"expected a number from 0 to 1, got {icc!r}")
    curve = _curve(data["probability"], "batch_variance.probability", fail, y_max=1.0)
    return BatchVariance(curve, float(icc))


def _rule(data: Any, where: str, keys: Mapping[str, type], fail) -> Rule:
    if not isinstance(data, Mapping):
        raise fail(where, f"expected a mapping with keys {', '.join(RULE_KEYS)}, got {_kind(data)}")
    _no_unknown(data, RULE_KEYS, where, fail)
    for required in ("name", "when", "probability", "shapes"):
        if required not in data:
            raise fail(where, f"missing required key {required!r}")
    name = data["name"]
    if not isinstance(name, str) or not name:
        raise fail(f"{where}.name", "expected a non-empty string")
    where = f"{where} ({name})"
    when_data = data["when"]
    if not isinstance(when_data, Mapping):
        raise fail(f"{where}.when", f"expected a mapping of condition key -> value, got {_kind(when_data)}")
    when: dict[str, tuple[Any, ...]] = {}
    for key, value in when_data.items():
        if key not in keys:
            raise fail(
                f"{where}.when",
                f"unknown key {key!r}; accepted: <role>.env.<NAME> or <role>.args.<flag dest>, "
                f"role one of {', '.join(ROLES)}, NAME one of {', '.join(ENV_VARS)}, "
                f"flag dest one of {', '.join(sorted(arg_types()))}",
            )
        values = tuple(value) if isinstance(value, list) else (value,)
        if not values:
            raise fail(f"{where}.when.{key}", "an empty list matches nothing; give at least one value")
        for v in values:
            if not _is_type(v, keys[key]):
                raise fail(
                    f"{where}.when.{key}", f"expected {keys[key].__name__} (or a list of them), got {v!r}"
                )
        when[key] = values
    curve = _curve(data["probability"], f"{where}.probability", fail, y_max=1.0)
    shapes_data = data["shapes"]
    if not isinstance(shapes_data, Mapping) or not shapes_data:
        raise fail(f"{where}.shapes", f"expected a mapping shape -> weight over {', '.join(SHAPES)}")
    shapes: dict[str, float] = {}
    for shape, weight in shapes_data.items():
        if shape not in SHAPES:
            raise fail(f"{where}.shapes", f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or weight < 0
            or not math.isfinite(weight)
        ):
            raise fail(f"{where}.shapes.{shape}", f"expected a weight >= 0, got {weight!r}")
        if weight > 0:
            shapes[shape] = float(weight)
    if not shapes:
        raise fail(f"{where}.shapes", "at least one shape needs a weight > 0")
    icc = data.get("restart_icc", 0.0)
    if isinstance(icc, bool) or not isinstance(icc, int | float) or not 0 <= icc <= 1:
        raise fail(f"{where}.restart_icc", f"expected a number from 0 to 1, got {icc!r}")
    return Rule(name, when, curve, shapes, float(icc))


def _curve(data: Any, where: str, fail, y_max: float | None = None, extrapolate: bool = False) -> Curve:
    if not isinstance(data, list) or not data:
        raise fail(where, "expected a non-empty list of [batch, value] pairs, batch ascending")
    points: list[tuple[float, float]] = []
    for i, point in enumerate(data):
        if (
            not isinstance(point, list | tuple)
            or len(point) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | float) for v in point)
        ):
            raise fail(f"{where}[{i}]", f"expected a pair [batch, value] of numbers, got {point!r}")
        x, y = float(point[0]), float(point[1])
        if not isinstance(point[0], int) or x < 1:
            raise fail(f"{where}[{i}]", f"batch must be an integer >= 1, got {point[0]!r}")
        if points and x <= points[-1][0]:
            raise fail(
                f"{where}[{i}]", f"batches must be strictly ascending ({point[0]} after {points[-1][0]:g})"
            )
        if y < 0 or (y_max is not None and y > y_max) or not math.isfinite(y):
            bound = f"between 0 and {y_max:g}" if y_max is not None else ">= 0"
            raise fail(f"{where}[{i}]", f"value must be {bound}, got {point[1]!r}")
        points.append((x, y))
    return Curve(tuple(points), extrapolate)


def _throughput(data: Any, fail, source: str) -> ThroughputModel:
    if not isinstance(data, Mapping):
        raise fail("throughput", f"expected a mapping with keys {', '.join(THROUGHPUT_KEYS)}")
    _no_unknown(data, THROUGHPUT_KEYS, "throughput", fail)
    merged = dict(data)
    missing = [k for k in THROUGHPUT_KEYS if k not in merged]
    if missing:
        if source == str(BUILTIN_PATH):
            raise fail("throughput", f"missing keys {', '.join(missing)}")
        builtin = yaml.safe_load(BUILTIN_PATH.read_text(encoding="utf-8"))["throughput"]
        merged.update({k: builtin[k] for k in missing})
    for key in ("graph_step_ms", "eager_step_ms"):
        for i, point in enumerate(merged[key] if isinstance(merged[key], list) else []):
            if (
                isinstance(point, list | tuple)
                and len(point) == 2
                and isinstance(point[1], int | float)
                and point[1] <= 0
            ):
                raise fail(f"throughput.{key}[{i}]", f"step time must be > 0 ms, got {point[1]!r}")
    scalars = {}
    for key in (
        "multi_stream_overhead",
        "deterministic_overhead",
        "prefill_base_ms",
        "prefill_per_token_ms",
        "startup_s",
    ):
        value = merged[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or value < 0
            or not math.isfinite(value)
        ):
            raise fail(f"throughput.{key}", f"expected a number >= 0, got {value!r}")
        scalars[key] = float(value)
    return ThroughputModel(
        graph_step=_curve(merged["graph_step_ms"], "throughput.graph_step_ms", fail, extrapolate=True),
        eager_step=_curve(merged["eager_step_ms"], "throughput.eager_step_ms", fail, extrapolate=True),
        **scalars,
    )


def _no_unknown(data: Mapping[str, Any], accepted: Sequence[str], where: str, fail) -> None:
    for key in data:
        if key not in accepted:
            raise fail(where, f"unknown key {key!r}; accepted: {', '.join(accepted)}")


def _is_type(value: Any, kind: type) -> bool:
    if value is None:  # flags whose default is None (e.g. --tool-call-parser not given)
        return kind is not bool
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def _kind(value: Any) -> str:
    return type(value).__name__ if value is not None else "nothing"
