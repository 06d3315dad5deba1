"""Where a study's arms ran, and whether it mattered (pure: run records in, report.json's `clusters` out).

An arm's run carries the cluster it ran on (tag `cluster`, on every run since cluster pools exist) and,
when it held a member of a pool (`cluster_pool=NAME`), its lease: `cluster_pool`, `cluster_pool.member`,
`lease.by`, `lease.start`, `lease.end` (ISO-8601 UTC), `lease.holder`, `lease.recovered_from` (it took
a member over from a lost holder) and `lease.lost` (its own holder was lost: the run ended FAILED).
`analysis.RunRecord.placement` holds those tags; a run logged before them has none (cluster unknown:
shown as such, left out of the check).

What the block says: the clusters the arms ran on; per arm and cluster the runs, sessions and corrupted
of the runs the verdicts use; per cluster the leases (arms, first start, last end, busy time: the
union of the lease intervals); the runs lost with their lease; and the cluster check below.

The cluster check. Two clusters are two sources of variation, like two restarts; the verdicts already
widen every count for the restart-to-restart variation (one ICC for the study, beta-binomial runs) and
pool an arm's runs over whatever clusters they ran on. The check asks whether the cluster matters beyond
that: for each arm with used runs on two or more clusters, the exact test of one rate for all of them on
the runs model (`stats.runs_split_test`: Fisher's test with each run beta-binomial; a plain binomial test
would alarm on restart variation alone), Holm across the arms tested at the study's alpha.
- The ICC is estimated within (arm, cluster) cells (`stats.dispersion` over the runs of one arm on one
  cluster), never across clusters: a cluster effect would otherwise count as restart variation and hide
  itself. The study's `assumed_icc` is its floor, as for the verdicts.
- That estimate rests on few degrees of freedom (an arm of 4 runs on 2 clusters gives 2), and plugged in
  as if known the test alarms on restart variation alone in 7-10% of null studies at nominal 5%; each
  p-value is therefore referred to Student's t on those degrees of freedom (`stats.t_reference`).
- Without two runs with corruption on any one cluster the ICC cannot be estimated within clusters: the
  check then uses the study's ICC (`analysis.between_runs`: within arms, a cluster effect included,
  so the check is conservative then) and says so.
- An arm without corruption on any cluster (or with nothing but) has nothing to compare and is not
  counted in Holm's family.
Measured by tests/test_clusters.py (restart ICC 0.02-0.05, 60 sessions a run, runs split over 2 clusters,
no cluster effect): false alarms in 1.7% of 1,500 dsv4-like studies with 3-6 runs per arm (a plain
binomial test: 29%). With rate 15% on one cluster and 2% on the other for two arms: found in 77% of
studies with 6 runs per arm, 41% with 3-6: the price of an ICC estimated within clusters on few runs.
The check is reported, never folded into a verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from orchestrator.analysis import stats
from orchestrator.analysis.result import (
    Balance,
    Cell,
    CheckIcc,
    ClusterArm,
    ClusterCheck,
    ClusterCounts,
    Clusters,
    ClusterTest,
    Lease,
    PlacedRun,
)
from orchestrator.config.plan import BASELINE_LABEL, arm_label

UNKNOWN = "unknown"


def cluster_of(run: Any) -> str:
    """The cluster a run ran on, or `UNKNOWN` for runs logged before runs recorded it."""
    return run.placement.get("cluster") or UNKNOWN


def _time(text: str | None) -> datetime | None:
    """A lease tag's time (UTC when it names no zone); None when missing or unreadable."""
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _cluster_order(names: set[str]) -> list[str]:
    return sorted(names - {UNKNOWN}) + ([UNKNOWN] if UNKNOWN in names else [])


def _label(run: Any, baseline: Mapping[str, str]) -> str:
    return arm_label(run.factors, baseline)


def _arm_key(item: tuple[str, str]) -> tuple:
    label, signature = item
    return (label != BASELINE_LABEL, label, signature)


def arms_by_cluster(
    runs: Sequence[Any], baseline: Mapping[str, str], used: Callable[[Any], bool], identity: Callable
) -> list[ClusterArm]:
    """Per arm (its identity), per cluster: the used runs, their sessions and corrupted, the rate, and
    the arm's share of used runs per known cluster."""
    arms: dict[tuple[str, str], dict[str, list[Any]]] = {}
    for run in runs:
        cells = arms.setdefault((_label(run, baseline), identity(run)), {})
        if used(run):
            cells.setdefault(cluster_of(run), []).append(run)
    rows = []
    for (label, signature), cells in sorted(arms.items(), key=lambda item: _arm_key(item[0])):
        out = {name: _cell(cells[name]) for name in _cluster_order(set(cells))}
        known = {c: v.runs for c, v in out.items() if c != UNKNOWN}
        total = sum(known.values())
        share = {c: v / total for c, v in known.items()} if total else {}
        rows.append(ClusterArm(label=label, signature=signature, cells=out, share=share))
    return rows


def _cell(group: Sequence[Any]) -> Cell:
    """One arm's used runs on one cluster."""
    n = sum(r.corrupted + r.clean for r in group)
    k = sum(r.corrupted for r in group)
    return Cell(
        runs=len(group),
        sessions=n,
        corrupted=k,
        rate=k / n if n else None,
        run_counts=tuple((r.corrupted, r.corrupted + r.clean) for r in sorted(group, key=_rep)),
    )


def _rep(run: Any) -> tuple:
    return (run.repetition, run.run_id)


def _union_s(intervals: list[tuple[datetime, datetime]]) -> float:
    busy, end = 0.0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            busy += (hi - lo).total_seconds()
            end = hi
        elif hi > end:
            busy += (hi - end).total_seconds()
            end = hi
    return busy


def leases(runs: Sequence[Any], baseline: Mapping[str, str]) -> list[Lease]:
    """Per cluster with lease tags: how its leases were held (`lease.by`), the pool members, the arms and
    runs that held it, first start, last end, busy time (the union of the intervals), the time leases
    overlapped (two holders at once: 0 unless something held a member outside the pool) and the leases
    still open (no end recorded: running, or its holder gone before it was tagged)."""
    by_cluster: dict[str, list[Any]] = {}
    for run in runs:
        if "lease.start" in run.placement:
            by_cluster.setdefault(cluster_of(run), []).append(run)
    out = []
    for name in _cluster_order(set(by_cluster)):
        group = sorted(by_cluster[name], key=lambda r: (r.placement["lease.start"], r.run_id))
        closed, open_runs = [], 0
        starts = [t for r in group if (t := _time(r.placement.get("lease.start")))]
        ends = [t for r in group if (t := _time(r.placement.get("lease.end")))]
        for r in group:
            lo, hi = _time(r.placement.get("lease.start")), _time(r.placement.get("lease.end"))
            if lo is not None and hi is not None and hi >= lo:
                closed.append((lo, hi))
            else:
                open_runs += 1
        busy = _union_s(closed)
        leased_s = sum((hi - lo).total_seconds() for lo, hi in closed)  # overlaps counted twice
        first, last = (min(starts) if starts else None), (max(ends) if ends else None)
        span = (last - first).total_seconds() if first and last and last >= first else None
        out.append(
            Lease(
                cluster=name,
                pools=_tags(group, "cluster_pool"),
                members=_tags(group, "cluster_pool.member"),
                by=_tags(group, "lease.by"),
                arms=tuple(
                    sorted({_label(r, baseline) for r in group}, key=lambda s: (s != BASELINE_LABEL, s))
                ),
                runs=len(group),
                first_start=first.isoformat(timespec="microseconds") if first else None,
                last_end=last.isoformat(timespec="microseconds") if last else None,
                busy_s=round(busy, 6),
                span_s=round(span, 6) if span is not None else None,
                busy_fraction=round(busy / span, 6) if span else None,
                overlap_s=round(leased_s - busy, 6),
                open=open_runs,
            )
        )
    return out


def _tags(runs: Sequence[Any], tag: str) -> tuple[str, ...]:
    """The distinct values of a placement tag over these runs, sorted."""
    return tuple(sorted({r.placement[tag] for r in runs if tag in r.placement}))


def _run_entry(run: Any, baseline: Mapping[str, str], identity: Callable, reason_tag: str) -> PlacedRun:
    return PlacedRun(
        arm=_label(run, baseline),
        signature=identity(run),
        run_id=run.run_id,
        repetition=run.repetition,
        status=run.status,
        cluster=cluster_of(run),
        member=run.placement.get("cluster_pool.member"),
        lease_start=run.placement.get("lease.start"),
        lease_end=run.placement.get("lease.end"),
        reason=run.placement.get(reason_tag) or run.reason,
    )


def _counts(cell: ClusterCounts) -> str:
    return f"{cell.corrupted}/{cell.sessions} ({cell.rate:.1%})" if cell.sessions else "0/0"


def cluster_icc(arms: Sequence[ClusterArm], assumed: float, between: stats.Dispersion) -> CheckIcc:
    """The ICC the check uses, its degrees of freedom (0: taken as known) and how it was found: within
    (arm, cluster) cells, floored at `assumed`; else the study's (`between`, as `analysis.between_runs`
    found it: within arms, or assumed) (module doc)."""
    cells = [c.run_counts for a in arms for c in a.cells.values()]
    found = stats.dispersion(cells)
    if found.estimated:
        icc = stats.floored(found, assumed).icc
        note = (
            f"restart-to-restart ICC estimated within each arm's runs on one cluster: dispersion "
            f"{found.phi:.2f} on {_df(found.df)}, ICC {found.icc:.3f}"
            + (
                f", below the study's floor: assumed ICC {assumed:g} (study.assumed_icc)"
                if found.icc < assumed
                else ""
            )
            + f"; p-values referred to Student's t on {_df(found.df)}"
        )
        return CheckIcc(source="within clusters", dispersion=found.phi, df=found.df, icc=icc, note=note)
    if between.estimated:
        note = (
            f"no arm has two runs with corruption on one cluster, so the restart variation cannot be "
            f"estimated within clusters: the study's ICC {between.icc:.3f} is used (estimated within arms, "
            f"a cluster effect included: the check is conservative then)"
        )
        source = "study"
    else:
        note = (
            f"the restart variation cannot be estimated (no arm has two runs with corruption): assumed ICC "
            f"{between.icc:g} (study.assumed_icc), so a difference between clusters may be restart variation"
        )
        source = "assumed"
    return CheckIcc(source=source, dispersion=None, df=0, icc=between.icc, note=note)


def _df(df: int) -> str:
    return f"{df} degree{'s' if df != 1 else ''} of freedom"


def effect_check(arms: Sequence[ClusterArm], spec: Any, between: stats.Dispersion) -> ClusterCheck:
    """Whether an arm's rate differs between the clusters it ran on beyond restart variation (module
    doc): per arm with used runs on two or more known clusters, its clusters' counts, the p-value on the
    runs model and Holm's; a verdict line."""
    alpha = float(spec.alpha)
    icc = cluster_icc(arms, float(getattr(spec, "assumed_icc", 0.0)), between)
    compared = [(a, known) for a in arms if len(known := _known_cells(a)) >= 2]
    ps = [_split_p(known, icc) for _, known in compared]
    # Holm across the arms tested, in their order
    holm = iter(stats.holm([p for p in ps if p is not None]))
    rows = [
        _cluster_test(a, known, p, None if p is None else next(holm), alpha)
        for (a, known), p in zip(compared, ps, strict=True)
    ]
    tested = [r for r in rows if r.tested]
    return ClusterCheck(
        method=(
            "per arm, the exact conditional test of one rate on every cluster on the runs model, each run "
            "beta-binomial with the restart-to-restart ICC; Holm across the arms tested"
        ),
        alpha=alpha,
        icc=icc,
        arms=tuple(rows),
        tested=len(tested),
        alarm=any(r.differs for r in rows),
        verdict=_verdict(rows, tested, alpha),
    )


def _known_cells(arm: ClusterArm) -> dict[str, Cell]:
    """An arm's cells on a known cluster, with sessions."""
    return {c: v for c, v in arm.cells.items() if c != UNKNOWN and v.sessions}


def _split_p(known: Mapping[str, Cell], icc: CheckIcc) -> float | None:
    """The p-value of one rate on every cluster; None with nothing to compare (no session corrupted, or
    every one)."""
    k = sum(v.corrupted for v in known.values())
    n = sum(v.sessions for v in known.values())
    if not 0 < k < n:
        return None
    return stats.t_reference(stats.runs_split_test([v.run_counts for v in known.values()], icc.icc), icc.df)


def _cluster_test(
    arm: ClusterArm, known: Mapping[str, Cell], p: float | None, p_holm: float | None, alpha: float
) -> ClusterTest:
    k = sum(v.corrupted for v in known.values())
    n = sum(v.sessions for v in known.values())
    counts = {
        c: ClusterCounts(runs=v.runs, sessions=v.sessions, corrupted=v.corrupted, rate=v.rate)
        for c, v in known.items()
    }
    nothing = f"nothing to compare: {'no' if k == 0 else 'every'} session corrupted ({k}/{n})"
    return ClusterTest(
        label=arm.label,
        signature=arm.signature,
        clusters=counts,
        tested=p is not None,
        p=p,
        p_holm=p_holm,
        differs=p_holm is not None and p_holm < alpha,
        note="" if p is not None else nothing,
    )


def _verdict(rows: Sequence[ClusterTest], tested: Sequence[ClusterTest], alpha: float) -> str:
    if not rows:
        return "not checked: no arm has used runs on two clusters"
    if not tested:
        return "not checked: no arm that ran on two clusters has corruption to compare"
    differs = [r for r in tested if r.differs]
    family = f"Holm over {len(tested)} arm{'s' if len(tested) != 1 else ''}, alpha {alpha:g}"
    if not differs:
        lowest = min(r.p_holm for r in tested if r.p_holm is not None)
        return f"no cluster effect seen (p >= {_p(lowest)}, {family})"
    parts = []
    for r in differs:
        by_rate = sorted(r.clusters.items(), key=lambda item: (-(item[1].rate or 0.0), item[0]))
        (hi_name, hi), (lo_name, lo) = by_rate[0], by_rate[-1]
        parts.append(
            f"cluster {hi_name}'s rate differs from {lo_name}'s for arm {r.label} "
            f"({hi_name} {_counts(hi)} vs {lo_name} {_counts(lo)}, p = {_p(r.p or 0.0)}, "
            f"{_p(r.p_holm or 0.0)} after {family})"
        )
    return (
        "; ".join(parts)
        + ": the verdicts pool clusters, so an arm that ran mostly on one cluster is confounded with it; "
        "give each arm runs on every cluster"
    )


def _p(p: float) -> str:
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def balance(arms: Sequence[ClusterArm], clusters: Sequence[str]) -> Balance | None:
    """Whether every arm's used runs are spread over every known cluster as evenly as their number
    allows; each arm's share per cluster. None with fewer than two clusters."""
    known = [c for c in clusters if c != UNKNOWN]
    if len(known) < 2:
        return None
    uneven = []
    for a in arms:
        runs = [a.cells[c].runs if c in a.cells else 0 for c in known]
        if sum(runs) and max(runs) - min(runs) > 1:
            uneven.append(a)
    if not uneven:
        note = f"balanced: each arm's runs are split over {', '.join(known)} as evenly as their number allows"
    else:
        shares = "; ".join(
            f"{a.label} " + ", ".join(f"{a.share.get(c, 0.0):.0%} {c}" for c in known) for a in uneven
        )
        note = f"not balanced over {', '.join(known)}: {shares}"
    return Balance(
        balanced=not uneven,
        shares={a.label + (f" ({a.signature})" if _dup(arms, a) else ""): a.share for a in arms},
        note=note,
    )


def _dup(arms: Sequence[ClusterArm], arm: ClusterArm) -> bool:
    return sum(a.label == arm.label for a in arms) > 1


def clusters_report(
    spec: Any,
    runs: Sequence[Any],
    used: Callable[[Any], bool],
    identity: Callable[[Any], str],
    between: stats.Dispersion,
) -> Clusters | None:
    """report.json's `clusters`: None when no run carries a cluster tag (module doc)."""
    if not any(run.placement.get("cluster") for run in runs):
        return None
    names = _cluster_order({cluster_of(r) for r in runs})
    known = [c for c in names if c != UNKNOWN]
    arms = arms_by_cluster(runs, spec.baseline, used, identity)
    unknown = sum(cluster_of(r) == UNKNOWN for r in runs)
    if len(known) > 1:
        sentence = (
            f"This study's arms ran on {len(known)} clusters ({', '.join(known)}): the verdicts pool each "
            f"arm's runs over them, so a cluster that corrupts more than another moves an arm's rate by "
            f"where its runs ran; the check below asks whether the cluster matters beyond the "
            f"restart-to-restart variation."
        )
    else:
        sentence = f"This study's arms ran on 1 cluster ({known[0]})."
    if unknown:
        sentence += (
            f" {unknown} run{'s' if unknown != 1 else ''} carr{'y' if unknown != 1 else 'ies'} no "
            f"cluster tag (logged before runs recorded where they ran): cluster unknown, left out of the "
            f"check."
        )
    lost = [r for r in runs if r.placement.get("lease.lost")]
    recovered = [r for r in runs if r.placement.get("lease.recovered_from")]
    return Clusters(
        clusters=tuple(known),
        unknown_runs=unknown,
        pools=tuple(sorted({r.placement["cluster_pool"] for r in runs if r.placement.get("cluster_pool")})),
        sentence=sentence,
        by_arm=tuple(arms),
        leases=tuple(leases(runs, spec.baseline)),
        lost=tuple(_run_entry(r, spec.baseline, identity, "lease.lost") for r in sorted(lost, key=_order)),
        recovered=tuple(
            _run_entry(r, spec.baseline, identity, "lease.recovered_from")
            for r in sorted(recovered, key=_order)
        ),
        check=effect_check(arms, spec, between),
        balance=balance(arms, names),
    )


def _order(run: Any) -> tuple:
    return (run.placement.get("lease.start") or "", run.repetition, run.run_id)
