"""What the differential oracle's runs say beyond their counts (pure): per arm, where each diverged session
first parted from its batch-1 reference, what the reference pass cost, and one diverged session as an
example, bounded (report.json: `arms[].divergence`, only for arms judged by `workload.oracle=divergence`).

The runs' records carry what their stress/summary.json said (`RunRecord.reference`, `.divergence`) and,
on one run per arm (`runs.example_run`), one diverged session's artifact (`RunRecord.divergence_example`:
`stress/corrupted/<session>.json`, see workload/divergence.py); `tracking.read` reads them for these runs
only.

Positions, turns and the basis are pooled over the arm's pooled runs (those its counts use); the
reference pass's seconds over every run of the arm that recorded one (its GPU time was spent whether the
run is pooled or not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.analysis.result import ArmDivergence, DivergedOutput, DivergenceExample
from orchestrator.analysis.runs import DIVERGENCE, RunRecord, example_run, oracle_of, run_used

# what an example keeps of each output around the first difference: the common text before it, and each
# output's text from it on (a report shows an excerpt, the artifact keeps the outputs whole)
BEFORE_CHARS = 240
AFTER_CHARS = 480


def arm_divergence(conditions: Mapping[str, str], runs: Sequence[RunRecord]) -> ArmDivergence | None:
    """An arm's divergence block (None for an arm of another oracle): the first differing position and
    turn of each diverged session of its pooled runs, the basis they were compared on, the reference
    pass's seconds (and the stress phases' that include them), and its example."""
    if oracle_of(conditions) != DIVERGENCE:
        return None
    used = [r for r in runs if run_used(r)]
    positions = [int(p) for r in used for p in r.divergence.get("positions") or ()]
    turns = [int(t) for r in used for t in r.divergence.get("turns") or ()]
    basis: dict[str, int] = {}
    for r in used:
        for name, count in (r.divergence.get("basis") or {}).items():
            basis[name] = basis.get(name, 0) + int(count)
    referenced = [r for r in runs if r.reference.get("duration_s") is not None]
    reference_s = sum(float(r.reference["duration_s"]) for r in referenced)
    stress = [r.stress_s for r in referenced]
    chosen = example_run(runs)
    found = chosen.divergence_example if chosen is not None else None
    return ArmDivergence(
        positions=tuple(positions),
        turns=tuple(turns),
        basis={name: count for name, count in sorted(basis.items()) if count},
        early_tokens=_int(conditions.get("workload.early_tokens")),
        reference_runs=len(referenced),
        reference_s=round(reference_s, 3),
        reference_sessions=sum(int(r.reference.get("sessions") or 0) for r in referenced),
        reference_errored=sum(int(r.reference.get("errored") or 0) for r in referenced),
        # the stress phase's seconds of the same runs (the reference pass is part of them), where all know it
        stress_s=round(sum(stress), 3) if referenced and None not in stress else None,
        example=example(found, chosen) if found is not None and chosen is not None else None,
    )


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def example(artifact: Mapping[str, Any], run: RunRecord) -> DivergenceExample:
    """One diverged session as a report shows it: where it first differed (turn, position, both tokens
    there) and both outputs around that point, bounded: the common text before the first differing
    character (at most BEFORE_CHARS of it) and each output's next AFTER_CHARS from there."""
    diff = artifact.get("difference") or {}
    finding = artifact.get("finding") or {}
    ref = _output(artifact.get("reference"))
    load = _output(artifact.get("under_load"))
    ref_text, load_text = ref["text"], load["text"]
    at = next(
        (i for i, (a, b) in enumerate(zip(ref_text, load_text, strict=False)) if a != b),
        min(len(ref_text), len(load_text)),
    )
    start = max(0, at - BEFORE_CHARS)
    return DivergenceExample(
        run_id=run.run_id,
        repetition=run.repetition,
        session_id=str(artifact.get("session_id", "")),
        turn=int(artifact.get("round_index") or 0),
        detector=str(finding.get("detector", "")),
        position=int(diff.get("position") or 0),
        basis=str(diff.get("basis", "")),
        reference_token=str(diff.get("reference", "")),
        under_load_token=str(diff.get("under_load", "")),
        start=start,
        at=at,
        reference=_excerpt(ref, start, at),
        under_load=_excerpt(load, start, at),
    )


def _excerpt(output: Mapping[str, Any], start: int, at: int) -> DivergedOutput:
    """One output as an example shows it: its text from `start`, up to AFTER_CHARS past the difference."""
    return DivergedOutput(
        excerpt=output["text"][start : at + AFTER_CHARS],
        chars=len(output["text"]),
        finish_reason=output["finish_reason"],
        completion_tokens=output["completion_tokens"],
    )


# the artifact's JSON read at the input boundary (one output's fields, normalised), not a result shape
def _output(value: Any) -> dict[str, Any]:
    value = value if isinstance(value, Mapping) else {}
    tokens = value.get("completion_tokens")
    return {
        "text": str(value.get("text") or ""),
        "finish_reason": None if value.get("finish_reason") is None else str(value["finish_reason"]),
        "completion_tokens": tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
    }
