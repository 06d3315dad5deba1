"""The study report: report.json's facts rendered as markdown (pure), then written with the plots.

`render_markdown(result)` turns the typed result that `analysis.analyse` returns (`analysis.result`) into a
report that reads like a resolved bug report: the headline verdict, the hypothesis table, the minimal
cause, the arm table, where the arms ran (clusters), the throughput table, the failed and partial runs,
the configuration to deploy, the machines the runs ran on and the commands that reproduce it.
The pipeline from MLflow (`report.pipeline.build_report`, used at the end of a multirun and by this package's
CLI) lets the report be rebuilt from the tracking store alone:

    python -m orchestrator.report --tracking-uri sqlite:///mlruns.db --study dsv4_corruption --out reports

report.json holds no timestamps and is written with sorted keys: the same MLflow content gives the same
bytes.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
import shlex
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.analysis.cost import FIGURES
from orchestrator.analysis.ddmin import STEER
from orchestrator.analysis.result import (
    Arm,
    Cell,
    Clusters,
    Conjunction,
    Cost,
    DdminSearch,
    Deploy,
    DivergenceExample,
    Families,
    MachineRow,
    Machines,
    MinimalCause,
    ProblemRun,
    RatioLevel,
    StudyResult,
    ThroughputLevel,
    Trial,
    to_json,
)
from orchestrator.analysis.runs import symptom_of
from orchestrator.analysis.study import oracle_phrase
from orchestrator.config.shell import command_line
from orchestrator.workload.decode_load import SHORT_FRACTION

log = logging.getLogger(__name__)

# start order of a PD deployment, for the deploy commands
ROLE_ORDER = ("prefill", "decode", "router")
VERDICT_MARK = {
    "implicated": "**implicated**",
    "partial": "partial",
    "exonerated": "exonerated",
    "inconclusive": "inconclusive",
}


def pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x * 100:.{digits}f}%"


def interval(ci: Sequence[float | None] | None, digits: int = 1, signed: bool = False) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return "–"
    if signed:
        return f"[{ci[0] * 100:+.{digits}f}, {ci[1] * 100:+.{digits}f}] pp"
    return f"[{pct(ci[0], digits)}, {pct(ci[1], digits)}]"


def pval(p: float | None) -> str:
    if p is None:
        return "–"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def num(x: float | None, fmt: str = ".0f") -> str:
    return "–" if x is None else format(x, fmt)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
        *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows),
        "",
    ]


def launch_command(role_config: Mapping[str, Any]) -> str:
    """`env NAME=value ... argv` for one role (values already redacted)."""
    return command_line(shlex.split(role_config.get("argv") or ""), role_config.get("env") or {})


def reproduce_commands(result: StudyResult, tracking_uri: str | None) -> list[str]:
    study = result.study.name
    overrides = result.context.get("overrides") or []
    uri = tracking_uri or "<tracking uri>"
    return [
        "# the study (resume=true skips arms that already have a FINISHED run)",
        "python -m orchestrator -m" + ("" if not overrides else " " + shlex.join(overrides)),
        "# this report, from MLflow alone",
        f"python -m orchestrator.report --tracking-uri {shlex.quote(uri)} --study {shlex.quote(study)} "
        "--out reports",
        "# the runs, side by side",
        f"mlflow ui --backend-store-uri {shlex.quote(uri)}",
    ]


# --- sections: each takes the typed result, or the section it reads, and returns its markdown lines ----


def title_section(result: StudyResult) -> list[str]:
    study = result.study
    conf = f"{result.confidence:.0%}"
    out = [f"# {study.name}: {result.headline}", ""]
    if study.description:
        out += [f"> {study.description.strip()}", ""]
    base_desc = ", ".join(f"{k}={v}" for k, v in sorted(study.baseline.items()))
    family = len(result.hypotheses)
    relative = study.min_effect_relative
    margin = (
        f"±{pct(study.min_effect, 0)} of the baseline's rate" if relative else f"±{pct(study.min_effect)}"
    )
    if result.ddmin:
        search = result.ddmin
        ids = {d.id for d in search.differences}
        good = ", ".join(f"{k}={v}" for k, v in sorted(study.baseline.items()) if k not in ids)
        out += [
            f"Good configuration: `{good}`; the bad one adds {len(search.differences)} differences. "
            f"Delta debugging (ddmin) for the smallest subset of them that still corrupts, each subset tried "
            f"an arm judged by anytime-valid e-values on its runs (beta-binomial, the restart-to-restart "
            f"variation included) against the ceiling {pct(study.ceiling)}: corrupting above it, clean "
            f"under it; each subset at its own share of alpha {study.alpha}, planned before any run (the "
            f"shares sum to it), so every verdict of the search is right with probability at least "
            f"{1 - study.alpha:.0%}.",
            "",
        ]
    elif result.stopping:
        out += [
            f"Baseline arm: `{base_desc}`. Sequential design: after every round, anytime-valid e-values "
            f"on the runs (beta-binomial, the restart-to-restart variation included) decide each "
            f"hypothesis at family-wise alpha {study.alpha} across {family} "
            f"hypothes{'i' if family == 1 else 'e'}s (closed testing on e-values), however many rounds "
            f"were looked at; implicated needs a reduction and the changed arm's rate under "
            f"{pct(study.ceiling)}; exonerated needs the rates equal within {margin}.",
            "",
        ]
    else:
        out += [
            f"Baseline arm: `{base_desc}`. Test: {study.test} (two-sided) on effective counts (sessions "
            f"divided by the design effect of the restart-to-restart variation), Holm across {family} "
            f"hypothes{'i' if family == 1 else 'e'}s at alpha {study.alpha}; implicated needs the changed "
            f"arm's upper bound under {pct(study.ceiling)}; exonerated needs the difference's {conf} "
            f"interval within {margin} (a change that removes corruption is never exonerated).",
            "",
        ]
    between = result.between_runs
    if between:
        out += [f"Between server starts ({between.method}): {between.note}.", ""]
    context = result.context
    if context.get("pooled"):
        out += [f"Runs counted: {context['pooled']}.", ""]
    if context.get("parent_run_id"):
        out += [f"MLflow parent run: `{context['parent_run_id']}`", ""]
    return out


def e_value(log_e: float | None) -> str:
    """An e-value for a table (its log is what the study keeps)."""
    if log_e is None:
        return "–"
    return f"{math.exp(log_e):.3g}" if log_e < 50 else f"e^{log_e:.0f}"


def hypotheses_section(result: StudyResult) -> list[str]:
    if not result.hypotheses and result.ddmin:
        return []  # a ddmin study asks which differences, not which hypotheses
    if result.stopping:
        return sequential_hypotheses_section(result)
    conf = f"{result.confidence:.0%}"
    head = [
        "hypothesis",
        "change",
        "baseline",
        "changed arm",
        f"difference ({conf} Newcombe)",
        "p",
        "p (Holm)",
        "verdict",
        "why",
    ]
    rows = [
        [
            f"{h.id}: {h.statement}",
            f"{h.factor}: {h.baseline_level} → {h.treatment_level}",
            f"{h.baseline_counts[0]}/{h.baseline_counts[1]}",
            f"{h.treatment_counts[0]}/{h.treatment_counts[1]}",
            interval(h.diff_ci, signed=True),
            pval(h.p),
            pval(h.p_holm),
            VERDICT_MARK[h.verdict],
            h.note,
        ]
        for h in result.hypotheses
    ]
    return ["## Hypotheses", "", *_table(head, rows)]


def sequential_hypotheses_section(result: StudyResult) -> list[str]:
    """A sequential study's verdicts rest on its e-values (fixed-design p-values are void after looks)."""
    th = result.stopping.thresholds
    head = [
        "hypothesis",
        "change",
        "baseline",
        "changed arm",
        f"closed e reduction (needs {e_value(th.comparison)})",
        f"closed e equal (needs {e_value(th.comparison)})",
        f"e under ceiling (needs {e_value(th.ceiling)})",
        "verdict",
        "why",
    ]
    rows = []
    for h in result.hypotheses:
        ev = h.evidence  # None before the first look
        rows.append(
            [
                f"{h.id}: {h.statement}",
                f"{h.factor}: {h.baseline_level} → {h.treatment_level}",
                f"{h.baseline_counts[0]}/{h.baseline_counts[1]}",
                f"{h.treatment_counts[0]}/{h.treatment_counts[1]}",
                e_value(ev.reduction if ev else None),
                e_value(ev.equivalence if ev else None),
                e_value(ev.under if ev else None),
                VERDICT_MARK[h.verdict],
                h.note,
            ]
        )
    return ["## Hypotheses", "", *_table(head, rows)]


def stopping_section(result: StudyResult) -> list[str]:
    """A sequential study's stopping trace: per round the arms run and each hypothesis' evidence."""
    stop = result.stopping
    if not stop:
        return []
    th = stop.thresholds
    hyps = [h.id for h in result.hypotheses]
    out = [
        "## Stopping trace",
        "",
        f"Sequential design: {stop.rounds} round(s), {stop.sessions} sessions; a fixed design running "
        f"every arm for as many rounds: {stop.fixed_design_sessions}. Evidence is an e-value per claim "
        f"({stop.method}): a comparison is decided when its closed e-value reaches "
        f"{e_value(th.comparison)}, "
        f"the ceiling at {e_value(th.ceiling)}; budget {stop.max_runs_per_arm} runs per arm"
        + (f", {stop.max_sessions} sessions" if stop.max_sessions else "")
        + ".",
        "",
    ]
    head = ["round", "arms run", "sessions", "ICC", *hyps]
    rows = []
    for look in stop.trace:
        cells = []
        for h in hyps:
            row = look.hypotheses[h]
            ev = row.evidence
            cells.append(
                f"red {e_value(ev.reduction)}, eq {e_value(ev.equivalence)}, under "
                f"{e_value(ev.under)}: **{row.verdict or 'undecided'}**"
            )
        rows.append([look.round, ", ".join(look.arms_run), look.sessions, f"{look.icc:.3f}", *cells])
    out += _table(head, rows)
    spent = ", ".join(f"{label} {n}" for label, n in stop.sessions_per_arm.items())
    benched = ", ".join(stop.benched) or "none"
    out += ["", f"Sessions per arm: {spent}. Throughput sweeps ran on: {benched}.", ""]
    return out


def _levels(levels: Mapping[str, str]) -> str:
    """`capture=graph` AND `multi_stream=on` (or "no level" for the empty conjunction)."""
    return " AND ".join(f"`{f}={v}`" for f, v in sorted(levels.items())) or "no level"


def _conjunction_lines(conj: Conjunction) -> list[str]:
    head = ["conjunct", "necessary", "evidence"]
    rows = [
        [f"`{f}={e.level}`", "shown" if e.evidence == "pair" else "inferred only", e.note]
        for f, e in conj.necessary.items()
    ]
    out = [f"{_levels(conj.levels)}: {conj.verdict}.", ""]
    return out + (_table(head, rows) if rows else [])


def minimal_cause_section(block: MinimalCause | None) -> list[str]:
    """The smallest conjunction(s) of factor levels the arms say corruption needs (report.json:
    `minimal_cause`): the verdict in a sentence, each conjunct's evidence, each arm's state, what
    modulates the rate, the factorial effects, and what the design cannot tell."""
    if not block:
        return []
    out = ["## Minimal cause", "", f"**{block.verdict}**: {block.summary}", ""]
    for conj in block.conjunctions:
        out += _conjunction_lines(conj)
    if block.provisional and block.provisional.conjunctions:
        guess = " or ".join(_levels(c) for c in block.provisional.conjunctions)
        out += [f"Provisional, {block.provisional.note}: {guess}.", ""]
    head = ["arm", "corrupted/n", "interval", "at", f"state (ceiling {pct(block.ceiling, 0)})"]
    rows = [
        [
            a.label,
            f"{a.counts[0]}/{a.counts[1]}",
            interval(a.bounds, 2),
            f"{a.confidence:.2%}" if a.confidence else "–",
            a.state,
        ]
        for a in block.arms
    ]
    out += [
        f"Each arm's state (the study's arm states: see Arms for how they are judged); {block.method}:",
        "",
        *_table(head, rows),
    ]
    for mod in block.modulators:
        (first, second), (lo, hi) = mod.arms, mod.ci
        out.append(
            f"- Modulator **{mod.factor}** ({mod.levels[0]} → {mod.levels[1]}): {first.label} "
            f"{first.counts[0]}/{first.counts[1]} vs {second.label} {second.counts[0]}/"
            f"{second.counts[1]}, difference {interval([lo, hi], signed=True)} "
            f"({mod.confidence:.1%} Newcombe, effective counts)"
        )
    if block.modulators:
        out.append("")
    if block.effects:
        fixed = ", ".join(f"{f}={v}" for f, v in sorted(block.factorial.fixed.items())) or "none"
        out += [
            f"Factorial effects on the rate ({', '.join(block.factorial.factors)}, the others fixed: "
            f"{fixed}; {block.factorial.method}):",
            "",
            *_table(
                ["effect", "kind", "estimate", "interval", "excludes 0"],
                [
                    [
                        e.description,
                        e.kind,
                        f"{e.estimate * 100:+.1f} pp",
                        interval(e.ci, signed=True),
                        "yes" if e.excludes_zero else "no",
                    ]
                    for e in block.effects
                ],
            ),
        ]
    if block.limits:
        out += ["What the design cannot tell:", "", *(f"- {line}" for line in block.limits), ""]
    return out


def _batches(facts: Mapping[str, float]) -> str:
    if "capture_batches" not in facts and "eager_batches" not in facts:
        return "–"
    return f"{int(facts.get('capture_batches', 0))}/{int(facts.get('eager_batches', 0))}"


def arms_section(result: StudyResult) -> list[str]:
    conf = f"{result.confidence:.0%}"
    head = [
        "arm",
        "signature",
        "runs used",
        "corrupted per run",
        "corrupted/n",
        "rate",
        f"{conf} CI",
        "design effect",
        "effective n",
        "errored",
        "captured/eager batches",
        "state",
        "note",
    ]
    rows = [
        [
            a.label,
            f"`{a.signature}`",
            f"{sum(r.used for r in a.runs)}/{len(a.runs)}",
            _per_run(a),
            f"{a.corrupted}/{a.n}",
            pct(a.rate),
            interval(a.ci),
            num(a.design_effect, ".2f"),
            num(a.effective_n, ".0f"),
            a.errored,
            _batches(a.facts),
            a.state or "–",
            "partial" if a.partial else "",
        ]
        for a in result.arms
    ]
    return [
        "## Arms",
        "",
        f"An arm pools its FINISHED runs with complete outcomes (same signature and workload); a killed "
        f"or failed run is listed below with its counts, never pooled (its outcomes are biased: a "
        f"corrupted session ends at its first bad turn). Errored sessions are counted apart and are not in "
        f"n. Intervals: {conf}, exact, widened for the restart-to-restart variation.",
        "",
        *([f"Arm states, which every section reads: {result.policy.text}.", ""] if result.policy else []),
        *_table(head, rows),
        *reference_pass_lines(result.arms),
    ]


def reference_pass_lines(arms: Sequence[Arm]) -> list[str]:
    """Below the arms table, for arms judged by the differential oracle: each arm's count in the oracle's
    words and what its batch-1 reference pass cost (GPU time too); nothing for the other oracles."""
    judged = [a for a in arms if a.divergence]
    if not judged:
        return []
    out = [
        "Judged by the differential oracle (`workload.oracle=divergence`): each session's turns are sent "
        "once alone (the batch-1 reference pass) and again under load, and a session is corrupted when its "
        "output under load differs from its reference. The reference pass runs on the same servers, one "
        "session at a time: GPU time too.",
        "",
    ]
    for a in judged:
        d = a.divergence
        cost = f"its reference pass took {duration(d.reference_s)} over {d.reference_runs} run(s)"
        if d.stress_s:
            cost += f" ({pct(d.reference_s / d.stress_s, 0)} of their stress phase)"
        if d.reference_errored:
            cost += f", {d.reference_errored} of its {d.reference_sessions} reference sessions errored"
        out.append(f"- **{a.label}** {oracle_phrase(symptom_of(a.conditions), a.corrupted, a.n)}; {cost}.")
    return [*out, ""]


# where write_report puts the plot of the first divergence per arm (linked from report.md)
DIVERGENCE_PLOT = "divergence.png"
# an example's outputs are diffed in lines of at most this many characters (a free-text output is often one
# long line)
DIFF_WIDTH = 100


def has_divergence_positions(result: StudyResult) -> bool:
    """Whether a study's arms have any diverged session to plot (`DIVERGENCE_PLOT` is written, linked)."""
    return any(a.divergence and a.divergence.positions for a in result.arms)


def _spread(values: Sequence[int]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):g} ({min(values)}–{max(values)})"


def _by_turn(turns: Sequence[int]) -> str:
    counts: dict[int, int] = {}
    for t in turns:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{t}: {k}" for t, k in sorted(counts.items())) or "–"


def divergence_section(result: StudyResult) -> list[str]:
    """Where the first divergence falls, per arm judged by the differential oracle (a table and the plot
    `DIVERGENCE_PLOT`), and one example diff per arm with a diverged session."""
    judged = [a for a in result.arms if a.divergence]
    if not judged:
        return []
    head = [
        "arm",
        "diverged sessions",
        "compared on",
        "first differing position: median (range)",
        "early",
        "by turn",
    ]
    rows = []
    for a in judged:
        d = a.divergence
        early = (
            f"{sum(p < d.early_tokens for p in d.positions)} (< {d.early_tokens})"
            if d.early_tokens is not None
            else "–"
        )
        basis = ", ".join(f"{name} {k}" for name, k in d.basis.items()) or "–"
        rows.append(
            [a.label, f"{len(d.positions)}/{a.n}", basis, _spread(d.positions), early, _by_turn(d.turns)]
        )
    out = [
        "## Where the outputs diverged",
        "",
        "Per arm, where each diverged session's output under load first differed from its batch-1 "
        "reference: the position of the first differing token (or word, where a turn was compared on its "
        "text), from 0, on the turn (from 0) where it happened; `early`: within the first "
        "`workload.early_tokens` positions (`diverged_early`).",
        "",
        *_table(head, rows),
    ]
    if has_divergence_positions(result):
        out += [f"![first differing position per arm]({DIVERGENCE_PLOT})", ""]
    for a in judged:
        if a.divergence.example:
            out += example_lines(a.label, a.divergence.example)
    return out


def _code(text: str) -> str:
    """`text` as an inline code span of its repr (whitespace visible), whatever backticks it holds."""
    shown = repr(text)
    ticks = "`" * (max((len(m) for m in re.findall("`+", shown)), default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{ticks}{pad}{shown}{pad}{ticks}"


def _lines(text: str) -> list[str]:
    """A text's lines, each cut into pieces of at most DIFF_WIDTH characters (lossless but for the line
    breaks)."""
    return [
        line[i : i + DIFF_WIDTH] for line in text.split("\n") for i in range(0, max(len(line), 1), DIFF_WIDTH)
    ]


def example_lines(label: str, ex: DivergenceExample) -> list[str]:
    """One diverged session of an arm: the turn, the first difference (position, both tokens) and a
    unified diff of the two outputs around it, bounded."""
    unit = "token" if ex.basis == "tokens" else "word"
    ref, load = ex.reference, ex.under_load

    def side(name: str, output: Any) -> str:
        end = ex.start + len(output.excerpt)
        return (
            f"{name}: characters {ex.start}-{end} of {output.chars}, finish {output.finish_reason or '–'}, "
            f"{num(output.completion_tokens)} tokens"
        )

    diff = list(
        difflib.unified_diff(
            _lines(ref.excerpt),
            _lines(load.excerpt),
            side("reference (batch 1)", ref),
            side("under load", load),
            lineterm="",
        )
    )
    if not diff:  # the same text, told apart by its tokens only
        diff = ["# the two texts read the same here; they differ in their tokens", *_lines(ref.excerpt)]
    ticks = "`" * max(3, max((len(m) for line in diff for m in re.findall("`+", line)), default=0) + 1)
    return [
        f"Example, **{label}**: run `{ex.run_id}` (#{ex.repetition}), session `{ex.session_id}`, turn "
        f"{ex.turn}: first difference at {unit} {ex.position} (`{ex.detector}`): reference "
        f"{_code(ex.reference_token)}, under load {_code(ex.under_load_token)}.",
        "",
        f"{ticks}diff",
        *diff,
        ticks,
        "",
    ]


# what each oracle's families mean, said for the oracle whose families the verdicts count
FAMILY_WORDS = {
    ("structural", "plan_drift"): "`structural`: what no healthy server emits whatever its model decides "
    "(malformed or leaked calls, unknown tools, schema breaks, missing calls, repetition, bad UTF-8, "
    "truncation). `plan_drift`: a well-formed call that is not the plan's next one (model quality against "
    "a weak model). ",
    ("diverged_early", "diverged"): "`diverged_early`: a turn under load whose output differs from its "
    "batch-1 reference within its first `workload.early_tokens` tokens; `diverged`: one that differs "
    "later. ",
}


def families_section(block: Families) -> list[str]:
    """Which detector families the verdicts count, and per arm every family's sessions beside."""
    rows = block.by_arm
    if not rows:
        return []
    shown = [*block.counted, *sorted({f for r in rows for f in r.noted})]
    head = ["arm", "sessions", *(f if f in block.counted else f"{f} (not counted)" for f in shown)]
    table = [[r.label, r.sessions, *({**r.noted, **r.counted}.get(f, "–") for f in shown)] for r in rows]
    lines = [
        "## Detector families",
        "",
        f"The verdicts count {' and '.join(f'`{f}`' for f in block.counted)} findings as corruption. "
        + "".join(FAMILY_WORDS[group] for group in FAMILY_WORDS if set(group) & set(block.counted))
        + "Sessions with at least one finding of each family:",
        "",
        *_table(head, table),
    ]
    if not block.same_in_every_arm:
        lines += ["", "**Arms counted different families: their rates are not comparable.**"]
    return lines


def decode_load_section(arms: Sequence[Arm]) -> list[str]:
    """Per arm, the decode's load during its stress runs against the planned concurrency, and a plain
    sentence for each arm whose load fell short or is unknown (report.json: `arms[].decode_load`)."""
    arms = [a for a in arms if a.decode_load]
    if not arms:
        return []
    head = ["arm", "planned concurrency", "decode load mean", "p50", "max", "of planned", "runs measured"]
    rows, notes = [], []
    for a in arms:
        d = a.decode_load
        rows.append(
            [
                a.label,
                num(d.planned),
                num(d.mean, ".1f"),
                num(d.p50, ".1f"),
                num(d.max),
                pct(d.fraction, 0),
                f"{d.runs_measured}/{d.runs}",
            ]
        )
        if d.short:
            notes.append(
                f"**{a.label}** fell short: the decode held {d.mean:.1f} requests on average against "
                f"{d.planned} planned ({pct(d.fraction, 0)}), so its rate was measured at a lighter "
                f"load than planned (its sessions spent much of their time away from the decode: a slow or "
                f"busy client host, the prefill, the network)."
            )
        if d.runs_measured < d.runs:
            missing = d.runs - d.runs_measured
            which = "in every run" if not d.runs_measured else f"in {missing} of {d.runs} runs"
            notes.append(f"**{a.label}**: decode load unknown {which} ({'; '.join(d.unknown)}).")
    out = [
        "## Decode load",
        "",
        "The decode's load while the stress sessions ran, as its `/metrics` reported it (SGLang's "
        "`sglang:num_running_reqs` + `sglang:num_queue_reqs`, and the PD decode queues where present; the "
        "simulated target reports its modelled load there), against the sessions the workload ran at once. "
        f"The corruption grows with the decode's load: a mean under {SHORT_FRACTION:.0%} of planned falls "
        "short.",
        "",
        *_table(head, rows),
    ]
    if notes:
        out += [*(f"- {note}" for note in notes), ""]
    else:
        out += ["Every arm reached its planned concurrency.", ""]
    return out


def duration(seconds: float | None) -> str:
    """`1 h 02 min`, `3 min 05 s`, `42 s`."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"


def gpu_time_section(block: Cost | None) -> list[str]:
    """What the study's runs held in GPU time, by arm, and the cost model with where each figure came
    from (analysis/cost.py)."""
    if not block:
        return []
    m = block.model
    # in the model's order, not the mapping's: report.json keeps its keys sorted, and the report rebuilt
    # from it must read as the one written
    sources = "; ".join(f"{k} from {m.sources[k]}" for k in FIGURES if k in m.sources)
    sentence = (
        f"{block.gpu_hours:.2f} GPU hours: {block.starts} server starts, {block.sessions} sessions, "
        f"{duration(block.wall_s)} of servers held on {m.gpus} GPU(s)"
    )
    if block.modelled_runs:
        sentence += f" ({block.modelled_runs} run(s) without a wall time counted by the model)"
    if block.fixed_design_gpu_hours:
        sentence += (
            f". By the cost model these runs take {block.model_gpu_hours:.2f} GPU hours, the fixed design of "
            f"as many starts per arm as this design's budget {block.fixed_design_gpu_hours:.2f} "
            f"({block.model_gpu_hours / block.fixed_design_gpu_hours:.2f}x)"
        )
    if block.remaining_gpu_hours:
        sentence += (
            f". Undecided when it stopped: at most {block.remaining_gpu_hours:.2f} GPU hours more would "
            f"settle or exhaust the budget (`resume=true`)"
        )
    rows = [[label, f"{a.gpu_hours:.3f}", a.starts, a.sessions] for label, a in block.per_arm.items()]
    return [
        "## GPU time",
        "",
        sentence + ".",
        "",
        f"Cost model: a restart {m.restart_s:.1f} s, a session {m.session_s:.3f} s, a throughput sweep "
        f"{m.bench_s:.1f} s ({sources}).",
        "",
        *_table(["arm", "GPU hours", "starts", "sessions"], rows),
        "",
    ]


# report.json's machine fields -> the Machine table's columns
MACHINE_COLUMNS = {
    "hostname": "host",
    "gpu": "GPU",
    "driver": "driver",
    "torch": "torch",
    "cuda": "CUDA",
    "sglang": "engine",
    "python": "python",
}


def machine_section(block: Machines | None, arms: Sequence[Arm]) -> list[str]:
    """What the runs ran on (report.json: `machines`, from their provenance tags): one row per role and
    machine, with its runs; runs that ran on different machines or engines said first."""
    if not block:
        return []
    label = {run.run_id: f"{a.label} #{run.repetition}" for a in arms for run in a.runs}
    per_role: dict[str, int] = {}
    for row in block.rows:
        per_role[row.role] = per_role.get(row.role, 0) + len(row.runs)
    if block.differs:
        # in the table's order, not the mapping's: report.json keeps its keys sorted
        roles = [r for r in dict.fromkeys(row.role for row in block.rows) if r in block.differs]
        what = "; ".join(
            f"{role}: {', '.join(MACHINE_COLUMNS[f] for f in MACHINE_COLUMNS if f in block.differs[role])}"
            for role in roles
        )
        sentence = (
            f"**The runs did not all run on the same machine and engine** ({what} differ between runs): a "
            "difference between arms may be the machine's or the engine's, not the factor's."
        )
    else:
        sentence = "Every run of a role ran on the same machine and engine."
    if block.unrecorded:
        sentence += f" {block.unrecorded} run(s) recorded no machine (stopped before their host checks)."

    def runs(row: MachineRow) -> str:
        if len(row.runs) == per_role[row.role]:
            return f"all {len(row.runs)}"
        return f"{len(row.runs)}: " + ", ".join(label.get(run_id, run_id) for run_id in row.runs)

    rows = [
        [
            row.role,
            *(
                "–" if (v := getattr(row, f)) is None else f"sglang {v}" if f == "sglang" else v
                for f in MACHINE_COLUMNS
            ),
            runs(row),
        ]
        for row in block.rows
    ]
    return [
        "## Machine",
        "",
        "What each server ran on, as the runs recorded it (`provenance.<role>.*`; –: not recorded). "
        + sentence,
        "",
        *_table(["role", *MACHINE_COLUMNS.values(), "runs"], rows),
    ]


def _utc(text: str | None) -> str:
    """An ISO-8601 lease time as `2026-12-01 22:06:18 UTC` (the tag keeps the microseconds)."""
    if not text:
        return "–"
    day, _, clock = text.partition("T")
    return f"{day} {clock[:8]} UTC" if clock.endswith("+00:00") else text


def _cell(cell: Cell | None) -> str:
    if not cell or not cell.runs:
        return "–"
    return f"{cell.runs} run{'s' if cell.runs != 1 else ''}, {cell.corrupted}/{cell.sessions}"


def clusters_section(block: Clusters | None) -> list[str]:
    """Where the arms ran (report.json: `clusters`): the clusters, arms x clusters (runs, corrupted of
    sessions, of the runs the verdicts use), each cluster's leases, runs lost with their lease, and
    whether an arm's rate differs between clusters beyond restart variation."""
    if not block:
        return []
    names = [*block.clusters, *(["unknown"] if block.unknown_runs else [])]
    out = ["## Clusters", "", block.sentence, ""]
    several = len(block.clusters) > 1
    head = ["arm", *(f"{c} (runs, corrupted/sessions)" for c in names)]
    if several:
        head.append("share of runs")
    rows = []
    for a in block.by_arm:
        row = [a.label, *(_cell(a.cells.get(c)) for c in names)]
        if several:
            row.append(", ".join(f"{a.share.get(c, 0.0):.0%} {c}" for c in block.clusters) or "–")
        rows.append(row)
    out += [
        "Runs the verdicts use (FINISHED, complete outcomes), per arm and cluster:",
        "",
        *_table(head, rows),
    ]
    if block.leases:
        head = [
            "cluster",
            "pool member",
            "lease by",
            "arms",
            "runs",
            "first start",
            "last end",
            "busy",
            "of span",
        ]
        rows = [
            [
                le.cluster,
                ", ".join(le.members) or "–",
                ", ".join(le.by) or "–",
                ", ".join(le.arms),
                le.runs if not le.open else f"{le.runs} ({le.open} without an end)",
                _utc(le.first_start),
                _utc(le.last_end),
                duration(le.busy_s),
                pct(le.busy_fraction, 0),
            ]
            for le in block.leases
        ]
        out += [
            "Leases (every run that held one; busy: the union of its lease intervals):",
            "",
            *_table(head, rows),
        ]
        for le in block.leases:
            if le.overlap_s > 0:
                out += [
                    f"- **{le.cluster}**: leases overlapped for {duration(le.overlap_s)} (two holders "
                    f"at once: something held it outside the pool).",
                    "",
                ]
    if block.lost:
        out += ["Runs lost with their pool lease (FAILED, never pooled):", ""]
        out += [
            f"- **{r.arm} #{r.repetition}** (run `{r.run_id}`) on {r.cluster}"
            + (f" ({r.member})" if r.member else "")
            + f", lease {_utc(r.lease_start)} to {_utc(r.lease_end)}: {r.reason}"
            for r in block.lost
        ]
        out.append("")
    if block.recovered:
        out += [
            *(
                f"- {r.arm} #{r.repetition} on {r.cluster}"
                + (f" ({r.member})" if r.member else "")
                + f" took the member over from a lost holder: {r.reason}"
                for r in block.recovered
            ),
            "",
        ]
    check = block.check
    if check.arms:
        note = check.icc.note
        clusters = block.clusters
        head = ["arm", *(f"{c} corrupted/n (rate)" for c in clusters), "p", "p (Holm)", "differs"]
        rows = [
            [
                r.label,
                *(
                    f"{v.corrupted}/{v.sessions} ({pct(v.rate)})" if (v := r.clusters.get(c)) else "–"
                    for c in clusters
                ),
                pval(r.p),
                pval(r.p_holm),
                ("**yes**" if r.differs else "no") if r.tested else r.note,
            ]
            for r in check.arms
        ]
        out += [
            f"Cluster effect beyond restart variation: {check.method}. {note[0].upper()}{note[1:]}:",
            "",
            *_table(head, rows),
        ]
    out += [f"**Cluster check**: {check.verdict}.", ""]
    if block.balance:
        out += [f"Balance: {block.balance.note}.", ""]
    return out


def _per_run(arm: Arm) -> str:
    """`16/60, 9/60, 11/60`: each pooled run's corrupted/n, in repetition order."""
    used = [r for r in arm.runs if r.used]
    return ", ".join(f"{r.corrupted}/{r.corrupted + r.clean}" for r in used) or "–"


def _throughput_rows(
    levels: Sequence[RatioLevel], base_tok: Mapping[int, float | None], arm_tok: Mapping[int, ThroughputLevel]
) -> list:
    rows = []
    for lv in levels:
        arm = arm_tok[lv.concurrency]
        rows.append(
            [
                lv.concurrency,
                num(base_tok.get(lv.concurrency)),
                num(arm.tok_s),
                num(lv.ratio, ".3f"),
                "–" if lv.ci[0] is None else f"[{lv.ci[0]:.3f}, {lv.ci[1]:.3f}]",
                f"{num(arm.ttft_p50_s, '.3f')}/{num(arm.ttft_p99_s, '.3f')}",
                f"{num(_ms(arm.itl_p50_s), '.1f')}/{num(_ms(arm.itl_p99_s), '.1f')}",
                arm.errors,
                "yes" if lv.clears_floor else "no",
            ]
        )
    return rows


def throughput_section(result: StudyResult) -> list[str]:
    study = result.study
    conf = f"{result.confidence:.0%}"
    out = ["## Throughput", ""]
    base_arm = next((a for a in result.arms if a.label == "baseline"), None)
    base_tok = {lv.concurrency: lv.tok_s for lv in base_arm.throughput} if base_arm else {}
    if not result.throughput:
        out += ["No throughput comparison (no baseline or no bench data).", ""]
    head = [
        "C",
        "baseline tok/s",
        "arm tok/s",
        "ratio",
        f"{conf} CI",
        "TTFT p50/p99 s",
        "ITL p50/p99 ms",
        "errors",
        "clears floor",
    ]
    for t in result.throughput:
        arm = next(a for a in result.arms if a.signature == t.arm)
        arm_tok = {lv.concurrency: lv for lv in arm.throughput}
        swept = max((lv.runs for lv in arm.throughput), default=0)
        base_runs = max((lv.runs for lv in base_arm.throughput), default=0) if base_arm else 0
        out += [
            f"**{t.label}** vs baseline: {t.verdict} (floor {pct(study.throughput_floor, 0)} of "
            f"baseline, lower bound of a {conf} bootstrap interval; the sweep ran on {swept} run(s) of this "
            f"arm and {base_runs} of the baseline: `bench.repetitions`).",
            "",
            *_table(head, _throughput_rows(t.levels, base_tok, arm_tok)),
        ]
    return out


def problem_runs_section(problems: Sequence[ProblemRun]) -> list[str]:
    out = ["## Failed and partial runs", ""]
    if not problems:
        return [*out, "None: every run finished.", ""]
    head = [
        "arm",
        "repetition",
        "status",
        "outcomes",
        "counted",
        "sessions (corrupted/clean/errored of planned)",
        "why",
    ]
    rows = [
        [
            p.arm,
            p.repetition,
            p.status,
            p.outcomes,
            "yes (partial)" if p.used else "no",
            f"{p.corrupted}/{p.clean}/{p.errored} of {p.planned}",
            (p.reason or "–") + ("" if p.used else " (outcomes not pooled)"),
        ]
        for p in problems
    ]
    return [*out, *_table(head, rows)]


def _ordered_roles(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    order = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted(config.items(), key=lambda item: (order.get(item[0], 99), item[0]))


def origin_table(config: Mapping[str, Any]) -> list[str]:
    """Per role, every env var and flag of a configuration and what set it (a factor level, the
    deployment, or the cluster's topology)."""
    rows = []
    for role, rc in _ordered_roles(config):
        for key, source in sorted((rc.get("origin") or {}).items()):
            kind, _, name = key.partition(" ")
            value = rc.get("env", {}).get(name, "") if kind == "env" else ""
            rows.append([role, kind, f"`{name}`" + (f" = `{value}`" if value else ""), source])
    if not rows:
        return []
    return ["Where each setting comes from:", "", *_table(["role", "kind", "setting", "set by"], rows)]


def deploy_section(deploy: Deploy | None) -> list[str]:
    out = ["## Configuration to deploy", ""]
    if deploy is None:
        return [*out, "No arm removed the corruption under the ceiling; nothing to deploy yet.", ""]
    levels = ", ".join(f"{k}={v}" for k, v in sorted(deploy.factors.items()))
    out += [
        f"Arm `{deploy.label}` (signature `{deploy.arm}`, {deploy.hypothesis}; throughput: "
        f"{deploy.throughput_verdict}). Factor levels: `{levels}`. Secret values are shown as ***.",
        "",
        "```sh",
    ]
    for role, rc in _ordered_roles(deploy.config):
        out += [f"# {role}", launch_command(rc)]
    return [*out, "```", "", *origin_table(deploy.config)]


def ddmin_section(search: DdminSearch | None) -> list[str]:
    """The search of a ddmin study: the differences, every subset tried with its verdict, the steps,
    the minimal set and what the error bound covers."""
    if not search:
        return []
    out = ["## Delta debugging", ""]
    if search.minimal is not None:
        minimal = ", ".join(f"`{d}`" for d in search.minimal)
        out += [
            f"**Minimal set: {minimal}** ({len(search.minimal)} of {len(search.differences)} "
            f"differences). {search.outcome[0].upper()}{search.outcome[1:]}. Error bound: "
            f"{search.error_bound:.3f} ({search.error_bound_covers}). Sessions: {search.sessions} "
            f"(a one-at-a-time sweep over every difference, {len(search.differences) + 1} arms x 4 "
            f"starts: {search.one_at_a_time_sessions}).",
            "",
        ]
    else:
        out += [f"{search.outcome[0].upper()}{search.outcome[1:]}.", ""]
    head = ["id", "sets"]
    rows = [
        [
            f"`{d.id}`" + (" **(minimal set)**" if d.id in (search.minimal or []) else ""),
            "; ".join(
                f"{role}: " + ", ".join(k if v is None else f"{k}={v}" for k, v in sets.items())
                for role, sets in d.sets.items()
            ),
        ]
        for d in search.differences
    ]
    out += ["Differences (the bad configuration = the good one with all of them):", "", *_table(head, rows)]
    head = ["#", "subset tried", "role", "runs", "corrupted/n", "log e over / under", "needs", "verdict"]
    rows = [
        [
            t.index,
            t.label,
            t.role,
            len(t.runs),
            f"{t.corrupted}/{t.sessions}",
            f"{t.evidence.over:.2f} / {t.evidence.under:.2f}",
            f"{t.log_threshold:.2f}",
            _trial_verdict(t),
        ]
        for t in search.trials
    ]
    out += [
        "Subsets tried, in order. The steering (`steer`) leans on one start at a time (its log likelihood "
        "ratio against the ceiling must reach `needs`): it only chooses what to ask next. The answer is "
        "then checked on runs started after it was chosen (`candidate`, `without <id>`, `deploy`; the "
        "good and bad configurations first), each at its own alpha: log e must reach `needs`.",
        "",
        *_table(head, rows),
    ]
    if search.steps:
        out += ["Steps:", "", *[f"{i}. {step}" for i, step in enumerate(search.steps, 1)], ""]
    return out


def _trial_verdict(trial: Trial) -> str:
    if trial.verdict is None:
        return "running"
    return f"leans {trial.verdict}" if trial.role == STEER else trial.verdict


def reproduce_section(result: StudyResult, tracking_uri: str | None) -> list[str]:
    return ["## Reproduce", "", "```sh", *reproduce_commands(result, tracking_uri), "```", ""]


def render_markdown(result: StudyResult, tracking_uri: str | None = None) -> str:
    """The markdown report of a study's typed result. Pure."""
    sections = [
        title_section(result),
        hypotheses_section(result),
        stopping_section(result),
        ddmin_section(result.ddmin),
        minimal_cause_section(result.minimal_cause),
        arms_section(result),
        clusters_section(result.clusters),
        decode_load_section(result.arms),
        families_section(result.families),
        divergence_section(result),
        throughput_section(result),
        problem_runs_section(result.problem_runs),
        deploy_section(result.deploy),
        gpu_time_section(result.cost),
        machine_section(result.machines, result.arms),
        reproduce_section(result, tracking_uri),
    ]
    return "\n".join(line for section in sections for line in section)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def dumps(result: StudyResult) -> str:
    """report.json's exact text: every field of the typed result, sorted keys, fixed indentation, a final
    newline."""
    return json.dumps(to_json(result), indent=1, sort_keys=True, allow_nan=False) + "\n"


def write_report(
    result: StudyResult, out_dir: Path, plots: bool = True, tracking_uri: str | None = None
) -> list[Path]:
    """Write reports/<study>/report.md, report.json and the PNGs; returns the paths, report.md first."""
    target = Path(out_dir) / result.study.name
    target.mkdir(parents=True, exist_ok=True)
    md, js = target / "report.md", target / "report.json"
    md.write_text(render_markdown(result, tracking_uri))
    js.write_text(dumps(result))
    paths = [md, js]
    if plots:
        from orchestrator.report.plots import corruption_plot, throughput_plot

        if any(a.n for a in result.arms):
            paths.append(corruption_plot(result, target / "corruption.png"))
        if any(a.throughput for a in result.arms):
            paths.append(throughput_plot(result, target / "throughput.png"))
        if has_divergence_positions(result):
            from orchestrator.report.plots import divergence_plot

            paths.append(divergence_plot(result, target / DIVERGENCE_PLOT))
    return paths
