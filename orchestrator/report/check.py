"""A report never contradicts itself: every section that says something about an arm's state says what
the study's one arm states say (`report.json`'s `arm_states`, analysis/states.py).

    python -m orchestrator.report --check reports/<study>/report.json

`disagreements(report)` (pure) lists each contradiction in words; none is the contract. What is checked:
- one state per arm: every arm of today's conditions has exactly one entry in `arm_states`, and the arms
  table, the minimal cause's arms and the hypotheses' treatment states repeat it (state, bounds,
  confidence);
- ties: arms with the same runs have the same state and confidence;
- a state and its bounds agree: "clean" is wholly under the ceiling, "corrupting" wholly over it,
  "undetermined" across it, for an arm judged by its interval;
- the hypotheses: "implicated" (corruption gone) only with the treatment arm clean; "partial" (reduced,
  not gone) never with it clean;
- the headline: names exactly the implicated hypotheses, and its fix is an arm shown clean;
- the minimal cause: its corrupting and clean arms are the states' (checked above), its conjunction
  separates them (every corrupting arm has it, no clean arm has it), and "no corruption to explain" only
  when no arm is corrupting;
- ddmin: each checked subset's last verdict is its arm's state (a steering lean is no verdict).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.analysis.result import Trial, from_json
from orchestrator.analysis.states import ddmin_checks
from orchestrator.analysis.study import HEADLINE_GROUPS

TOLERANCE = 1e-9
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")


def schema_problems(report: Mapping[str, Any]) -> list[str]:
    """Where report.json departs from its JSON Schema (report.schema.json), one line each."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    return [
        f"schema: {'/'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(validator.iter_errors(report), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _same_bounds(a: Sequence[float] | None, b: Sequence[float] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(abs(x - y) <= TOLERANCE for x, y in zip(a, b, strict=True))


def _state_problems(states: Mapping[str, Mapping[str, Any]], ceiling: float) -> list[str]:
    out = []
    for sig, s in states.items():
        bounds = s.get("bounds")
        if s["state"] not in ("clean", "corrupting", "undetermined"):
            out.append(f"arm {s['label']} ({sig}): unknown state {s['state']!r}")
        if not bounds or s.get("source", "interval") != "interval":
            continue
        lo, hi = bounds
        if s["state"] == "clean" and not hi < ceiling:
            out.append(
                f"arm {s['label']}: clean, but its upper bound {hi:.4f} is not under the ceiling {ceiling}"
            )
        if s["state"] == "corrupting" and not lo > ceiling:
            out.append(f"arm {s['label']}: corrupting, but its lower bound {lo:.4f} is not over the ceiling")
        if s["state"] == "undetermined" and (hi < ceiling or lo > ceiling):
            out.append(f"arm {s['label']}: undetermined, but its bounds clear the ceiling")
    return out


def _tie_problems(states: Mapping[str, Mapping[str, Any]], arms: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    by_runs: dict[str, list[str]] = {}
    for arm in arms:
        if arm["signature"] in states and arm["n"]:
            key = json.dumps(sorted(arm["run_counts"]))
            by_runs.setdefault(key, []).append(arm["signature"])
    for sigs in by_runs.values():
        seen = {
            (states[s]["state"], states[s]["confidence"])
            for s in sigs
            if states[s].get("source", "interval") == "interval"
        }
        if len(seen) > 1:
            labels = ", ".join(states[s]["label"] for s in sigs)
            out.append(
                f"arms {labels} have the same runs but different states or confidences: {sorted(seen)}"
            )
    return out


def _hypothesis_problems(report: Mapping[str, Any], states: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = []
    for row in report.get("hypotheses") or []:
        state = states.get(row.get("treatment_arm") or "")
        said = row.get("treatment_state")
        if state is None:
            if said is not None:
                out.append(f"{row['id']}: a treatment state {said!r} for an arm without one")
            continue
        if said != state["state"]:
            out.append(
                f"{row['id']}: the row says {said!r} of {state['label']}, its state is {state['state']!r}"
            )
        if row["verdict"] == "implicated" and state["state"] != "clean":
            out.append(f"{row['id']}: implicated (corruption gone), but {state['label']} is {state['state']}")
        if row["verdict"] == "partial" and state["state"] == "clean":
            out.append(f"{row['id']}: partial (corruption remains), but {state['label']} is clean")
    return out


def _headline_problems(report: Mapping[str, Any], states: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = []
    headline = report.get("headline") or ""
    implicated = [r["id"] for r in report.get("hypotheses") or [] if r["verdict"] == "implicated"]
    if not report.get("ddmin"):
        named = headline.split("Implicated: ", 1)[1].split(";")[0] if "Implicated: " in headline else ""
        for rid in implicated:
            if f"{rid} (" not in named:
                out.append(f"headline: {rid} is implicated in the hypotheses but not named as implicated")
        for row in report.get("hypotheses") or []:
            if row["id"] not in implicated and f"{row['id']} (" in named:
                out.append(f"headline: names {row['id']} implicated; the hypotheses say {row['verdict']}")
        out += _group_problems(headline, report.get("hypotheses") or [])
    deploy = report.get("deploy") or {}
    fix = deploy.get("arm")
    if fix and fix in states and states[fix]["state"] != "clean":
        out.append(f"the fix to deploy, {states[fix]['label']}, is {states[fix]['state']}, not clean")
    return out


def _group_problems(headline: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A headline that implicates nothing lists the other verdicts (`analysis.verdict_groups`): each list
    must be exactly the hypotheses with that verdict."""
    if not headline.startswith("No hypothesis implicated"):
        return []
    out = []
    for verdict in HEADLINE_GROUPS:
        want = sorted(r["id"] for r in rows if r["verdict"] == verdict)
        found = re.search(rf"; {verdict}: (.+?)(?=;| \(|\.$)", headline)
        named = sorted(x.strip() for x in found.group(1).split(",")) if found else []
        if named != want:
            out.append(f"headline: names {named or 'none'} {verdict}; the hypotheses say {want or 'none'}")
    return out


def _minimal_cause_problems(
    block: Mapping[str, Any] | None, states: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    if not block:
        return []
    out = []
    arms = block.get("arms") or []
    for arm in arms:
        state = states.get(arm["signature"])
        if state is None:
            out.append(f"minimal cause: arm {arm['label']} has no study state")
            continue
        if arm["state"] != state["state"]:
            out.append(f"minimal cause says {arm['label']} is {arm['state']}, its state is {state['state']}")
        if not _same_bounds(arm.get("bounds"), state.get("bounds")) or arm.get("confidence") != state.get(
            "confidence"
        ):
            out.append(f"minimal cause shows {arm['label']} at other bounds or confidence than its state")
    corrupting = [a for a in arms if a["state"] == "corrupting"]
    clean = [a for a in arms if a["state"] == "clean"]
    for conj in block.get("conjunctions") or []:
        levels = conj["levels"].items()
        for a in corrupting:
            if not all(a["factors"].get(f) == v for f, v in levels):
                out.append(f"minimal cause: corrupting {a['label']} lacks the conjunction {dict(levels)}")
        for a in clean:
            if levels and all(a["factors"].get(f) == v for f, v in levels):
                out.append(f"minimal cause: clean {a['label']} has the whole conjunction {dict(levels)}")
    if block.get("verdict") == "no corruption to explain" and corrupting:
        out.append("minimal cause: 'no corruption to explain' beside a corrupting arm")
    return out


def _ddmin_problems(block: Mapping[str, Any] | None, arms: Sequence[Mapping[str, Any]], states) -> list[str]:
    if not block:
        return []
    ids = [d["id"] for d in block["differences"]]
    by_subset = {
        frozenset(d for d in ids if a["factors"].get(d) == "bad"): a["signature"]
        for a in arms
        if a["signature"] in states
    }
    out = []
    for trial in ddmin_checks([from_json(Trial, t) for t in block.get("trials") or []]):
        sig = by_subset.get(frozenset(trial.subset))
        if sig is None:
            continue
        said = trial.verdict if trial.verdict in ("clean", "corrupting") else "undetermined"
        if states[sig]["state"] != said:
            out.append(f"ddmin trial {trial.label}: {said}, its arm's state is {states[sig]['state']}")
    return out


def disagreements(report: Mapping[str, Any]) -> list[str]:
    """Every contradiction between the report's sections about arm states (module doc); [] when none."""
    if "arm_states" not in report:
        return ["report.json has no arm_states (written before schema 2)"]
    states = {s["signature"]: s for s in report["arm_states"]}
    if len(states) != len(report["arm_states"]):
        return ["an arm has two entries in arm_states"]
    ceiling = float(report["study"]["ceiling"])
    out = _state_problems(states, ceiling)
    for arm in report["arms"]:
        said = arm.get("state")
        if arm["signature"] in states and said != states[arm["signature"]]["state"]:
            out.append(
                f"arms table says {arm['label']} is {said}, its state is {states[arm['signature']]['state']}"
            )
    out += _tie_problems(states, report["arms"])
    out += _hypothesis_problems(report, states)
    out += _headline_problems(report, states)
    out += _minimal_cause_problems(report.get("minimal_cause"), states)
    out += _ddmin_problems(report.get("ddmin"), report["arms"], states)
    return out


def main(paths: Sequence[str]) -> int:
    """Check each report.json; prints every disagreement; exit 1 when any."""
    failed = 0
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        found = schema_problems(report) or disagreements(report)
        for line in found:
            print(f"{path}: {line}")
        print(f"{path}: {'consistent' if not found else f'{len(found)} disagreement(s)'}")
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
