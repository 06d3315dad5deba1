"""Where the arms ran (report.json `clusters`, the report's "## Clusters"): hand-made runs with and without
cluster and lease tags, the cluster check's test on the runs model, and a Monte Carlo through the same
pure function the report uses (`study.clusters_block`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats as sps

from orchestrator.analysis import HypothesisSpec, RunRecord, StudySpec, analyse, arm_label, stats, study
from orchestrator.analysis.result import StudyResult, to_json
from orchestrator.analysis.runs import placement_of
from orchestrator.report.render import clusters_section, dumps, duration, render_markdown

BASE = {"hicache": "on", "multi_stream": "on"}
SPEC = StudySpec(
    name="t",
    baseline=BASE,
    hypotheses=(
        HypothesisSpec("H-ms", "multi_stream", "needs multi-stream overlap", "on", "off"),
        HypothesisSpec("H-hicache", "hicache", "needs HiCache", "on", "off"),
    ),
    alpha=0.05,
    min_effect=0.5,
    ceiling=0.03,
    throughput_floor=0.95,
)
T0 = "2026-12-01T10:"


def lease(member: str, start: str, end: str | None = None, **extra: str) -> dict[str, str]:
    name = "local" if member == "pd0" else "local2-pd1"
    tags = {
        "cluster": name,
        "cluster_pool": "local2",
        "cluster_pool.member": member,
        "lease.by": "host leases",
        "lease.holder": f"pid 1 on host (member {member})",
        "lease.start": f"{T0}{start}.000000+00:00",
    }
    if end:
        tags["lease.end"] = f"{T0}{end}.000000+00:00"
    return tags | extra


def run(
    delta: dict[str, str],
    rep: int,
    corrupted: int,
    placement: dict[str, str] | None = None,
    sessions: int = 60,
    status: str = "FINISHED",
    reason: str = "",
) -> RunRecord:
    factors = {**BASE, **delta}
    label = arm_label(factors, BASE)
    return RunRecord(
        run_id=f"{label}-{rep}",
        status=status,
        signature=f"sig[{label}]",
        repetition=rep,
        factors=factors,
        outcomes="complete" if status == "FINISHED" else "partial",
        corrupted=corrupted,
        clean=sessions - corrupted,
        planned=sessions,
        reason=reason,
        placement=placement or {},
    )


MS_OFF, HC_OFF = {"multi_stream": "off"}, {"hicache": "off"}


def section(result: StudyResult) -> str:
    md = render_markdown(result)
    assert md.count("## Clusters") == 1
    return md.split("## Clusters")[1].split("\n## ")[0]


# --- the tags ---------------------------------------------------------------------------------------


def test_placement_keeps_the_cluster_and_lease_tags_only():
    tags = {
        "cluster": "local2-pd1",
        "cluster_pool": "local2",
        "cluster_pool.member": "pd1",
        "lease.start": "2026-12-01T10:00:00.000001+00:00",
        "lease.lost": "holder gone",
        "signature": "abc",
        "failure_reason": "holder gone",
        "provenance.decode.host": "h",
    }
    assert placement_of(tags) == {
        "cluster": "local2-pd1",
        "cluster_pool": "local2",
        "cluster_pool.member": "pd1",
        "lease.lost": "holder gone",
        "lease.start": "2026-12-01T10:00:00.000001+00:00",
    }
    assert placement_of({"signature": "abc"}) == {}


# --- the section ------------------------------------------------------------------------------------


def test_runs_without_cluster_tags_have_no_section():
    runs = [run({}, r, 9) for r in range(3)] + [run(MS_OFF, r, 0) for r in range(3)]
    result = analyse(SPEC, runs)
    assert result.clusters is None
    assert clusters_section(result.clusters) == []
    assert "## Clusters" not in render_markdown(result)
    dumps(result)


def test_one_cluster_without_a_pool():
    runs = [run({}, r, k, {"cluster": "local"}) for r, k in enumerate((9, 7, 11))]
    runs += [run(MS_OFF, r, 0, {"cluster": "local"}) for r in range(3)]
    result = analyse(SPEC, runs)
    block = to_json(result)["clusters"]
    assert block["clusters"] == ["local"] and block["unknown_runs"] == 0 and block["pools"] == []
    assert block["sentence"] == "This study's arms ran on 1 cluster (local)."
    base = block["by_arm"][0]
    assert base["label"] == "baseline"
    assert {k: base["cells"]["local"][k] for k in ("runs", "sessions", "corrupted")} == {
        "runs": 3,
        "sessions": 180,
        "corrupted": 27,
    }
    assert block["leases"] == [] and block["lost"] == [] and block["balance"] is None
    assert block["check"]["arms"] == [] and not block["check"]["alarm"]
    text = section(result)
    assert "| baseline | 3 runs, 27/180 |" in text
    assert "**Cluster check**: not checked: no arm has used runs on two clusters." in text
    assert "Leases" not in text and "share of runs" not in text
    json.loads(dumps(result))


def two_cluster_runs() -> list[RunRecord]:
    """dsv4-like: the baseline and hicache=off corrupting, multi_stream=off clean; runs alternate between
    the pool's two members, one lost with its lease, one that took the member over after it."""
    return [
        run({}, 0, 9, lease("pd0", "00:00", "05:00")),
        run({}, 1, 11, lease("pd1", "00:01", "05:30")),
        run({}, 2, 7, lease("pd0", "05:01", "10:00")),
        run({}, 3, 10, lease("pd1", "05:31", "11:00")),
        run(HC_OFF, 0, 4, lease("pd0", "10:01", "15:00")),
        run(HC_OFF, 1, 5, lease("pd1", "11:01", "16:00")),
        run(HC_OFF, 2, 3, lease("pd1", "16:01", "21:00")),
        run(MS_OFF, 0, 0, lease("pd0", "15:01", "20:00")),
        run(
            MS_OFF,
            1,
            0,
            lease("pd0", "20:01", "22:00", **{"lease.lost": "its holder stopped renewing its lease on pd0"}),
            sessions=25,
            status="FAILED",
            reason="its holder stopped renewing its lease on pd0",
        ),
        run(MS_OFF, 2, 0, lease("pd0", "22:30", "27:30", **{"lease.recovered_from": "holder of run x lost"})),
        run(MS_OFF, 3, 0, lease("pd1", "21:01", None)),  # its lease end was never tagged
    ]


def test_two_clusters_leases_lost_runs_and_the_check():
    result = analyse(SPEC, two_cluster_runs())
    block = to_json(result)["clusters"]
    assert block["clusters"] == ["local", "local2-pd1"] and block["pools"] == ["local2"]
    assert block["sentence"].startswith("This study's arms ran on 2 clusters (local, local2-pd1): ")
    by = {a["label"]: a for a in block["by_arm"]}
    assert [a["label"] for a in block["by_arm"]] == ["baseline", "hicache=off", "multi_stream=off"]
    assert {c: (v["runs"], v["sessions"], v["corrupted"]) for c, v in by["baseline"]["cells"].items()} == {
        "local": (2, 120, 16),
        "local2-pd1": (2, 120, 21),
    }
    # the lost run is not used: 2 used runs of multi_stream=off on local, 1 on local2-pd1
    assert by["multi_stream=off"]["cells"]["local"]["runs"] == 2
    assert by["multi_stream=off"]["share"] == pytest.approx({"local": 2 / 3, "local2-pd1": 1 / 3})

    local, pd1 = block["leases"]
    assert (local["cluster"], local["members"], local["by"], local["runs"]) == (
        "local",
        ["pd0"],
        ["host leases"],
        6,
    )
    assert local["arms"] == ["baseline", "hicache=off", "multi_stream=off"]
    assert local["first_start"] == "2026-12-01T10:00:00.000000+00:00"
    assert local["last_end"] == "2026-12-01T10:27:30.000000+00:00"
    # 00:00-05:00, 05:01-10:00, 10:01-15:00, 15:01-20:00, 20:01-22:00, 22:30-27:30
    assert local["busy_s"] == pytest.approx(4 * 300 - 3 + 119 + 300)
    assert local["overlap_s"] == 0 and local["open"] == 0
    assert pd1["open"] == 1 and pd1["runs"] == 5 and pd1["last_end"] == "2026-12-01T10:21:00.000000+00:00"

    (lost,) = block["lost"]
    assert (lost["arm"], lost["repetition"], lost["status"], lost["cluster"], lost["member"]) == (
        "multi_stream=off",
        1,
        "FAILED",
        "local",
        "pd0",
    )
    assert lost["reason"] == "its holder stopped renewing its lease on pd0"
    (recovered,) = block["recovered"]
    assert (recovered["repetition"], recovered["reason"]) == (2, "holder of run x lost")

    check = block["check"]
    rows = {r["label"]: r for r in check["arms"]}
    assert rows["baseline"]["tested"] and rows["hicache=off"]["tested"]
    assert not rows["multi_stream=off"]["tested"] and rows["multi_stream=off"]["p"] is None
    assert check["tested"] == 2 and not check["alarm"]
    assert check["icc"]["source"] == "within clusters" and check["icc"]["df"] == 3
    assert check["verdict"].startswith("no cluster effect seen (p >= ")
    assert check["verdict"].endswith("Holm over 2 arms, alpha 0.05)")
    # 2 + 2, 1 + 2 and 2 + 1 used runs: as even as three runs allow
    assert block["balance"]["balanced"] is True
    assert block["balance"]["note"] == (
        "balanced: each arm's runs are split over local, local2-pd1 as evenly as their number allows"
    )

    text = section(result)
    assert text.lstrip().startswith("This study's arms ran on 2 clusters (local, local2-pd1):")
    assert "| baseline | 2 runs, 16/120 | 2 runs, 21/120 | 50% local, 50% local2-pd1 |" in text
    assert "| local | pd0 | host leases | baseline, hicache=off, multi_stream=off | 6 |" in text
    assert "| 5 (1 without an end) | 2026-12-01 10:00:01 UTC | 2026-12-01 10:21:00 UTC |" in text
    assert (
        "- **multi_stream=off #1** (run `multi_stream=off-1`) on local (pd0), lease 2026-12-01 10:20:01 UTC "
        "to 2026-12-01 10:22:00 UTC: its holder stopped renewing its lease on pd0" in text
    )
    assert "took the member over from a lost holder: holder of run x lost" in text
    assert (
        "| multi_stream=off | 0/120 (0.0%) | 0/60 (0.0%) | – | – | nothing to compare: no session corrupted"
        in text
    )
    assert "**Cluster check**: no cluster effect seen (p >= " in text
    assert "Balance: balanced: each arm's runs are split over local, local2-pd1" in text
    # the section sits with the arms, and the whole report is JSON-clean
    md = render_markdown(result)
    assert md.index("## Arms") < md.index("## Clusters") < md.index("## Failed and partial runs")
    json.loads(dumps(result))


def test_runs_without_tags_are_cluster_unknown_and_left_out_of_the_check():
    runs = [run({}, 0, 9), run({}, 1, 12)]  # logged before runs recorded their cluster
    runs += [run({}, 2, 8, {"cluster": "local"}), run({}, 3, 10, {"cluster": "local"})]
    result = analyse(SPEC, runs)
    block = to_json(result)["clusters"]
    assert block["clusters"] == ["local"] and block["unknown_runs"] == 2
    assert set(block["by_arm"][0]["cells"]) == {"local", "unknown"}
    assert block["by_arm"][0]["share"] == {"local": 1.0}
    assert "2 runs carry no cluster tag" in block["sentence"]
    assert block["check"]["arms"] == []  # local and unknown are not two clusters
    text = clusters_section(result.clusters)
    assert "| arm | local (runs, corrupted/sessions) | unknown (runs, corrupted/sessions) |" in "\n".join(
        text
    )


def test_a_cluster_effect_is_named_with_the_confounding_it_causes():
    # the baseline corrupts on local2-pd1 only, and mostly ran there
    runs = [run({}, r, k, {"cluster": "local"}) for r, k in enumerate((1, 2))]
    runs += [run({}, r + 2, k, {"cluster": "local2-pd1"}) for r, k in enumerate((10, 8, 12, 9))]
    runs += [run(HC_OFF, r, k, {"cluster": c}) for r, (k, c) in enumerate(((5, "local"), (3, "local2-pd1")))]
    result = analyse(SPEC, runs)
    block = to_json(result)["clusters"]
    check = block["check"]
    base = next(r for r in check["arms"] if r["label"] == "baseline")
    assert base["differs"] and check["alarm"] and base["p_holm"] < 0.05
    assert check["verdict"].startswith(
        "cluster local2-pd1's rate differs from local's for arm baseline (local2-pd1 39/240 (16.2%) vs "
        "local 3/120 (2.5%), p = "
    )
    assert check["verdict"].endswith(
        ": the verdicts pool clusters, so an arm that ran mostly on one cluster is confounded with it; "
        "give each arm runs on every cluster"
    )
    assert (
        block["balance"]["note"] == "not balanced over local, local2-pd1: baseline 33% local, 67% local2-pd1"
    )
    text = section(result)
    assert "| baseline | 3/120 (2.5%) | 39/240 (16.2%) |" in text and "| **yes** |" in text


def test_duration():
    assert [duration(s) for s in (0.25, 42, 185, 3725, None)] == [
        "0.2 s",
        "42 s",
        "3 min 05 s",
        "1 h 02 min",
        "–",
    ]


# --- the test on the runs model ----------------------------------------------------------------------


def test_runs_split_test_is_fisher_at_icc_zero_and_wider_with_restart_variation():
    a, b = [(9, 60), (9, 60)], [(1, 60), (1, 60)]
    fisher = sps.fisher_exact([[18, 102], [2, 118]]).pvalue
    assert stats.runs_split_test([a, b], 0.0) == pytest.approx(fisher, rel=1e-9)
    assert stats.runs_split_test([b, a], 0.0) == pytest.approx(fisher, rel=1e-9)
    # unequal run sizes: still the hypergeometric on the totals
    c, d = [(9, 50), (4, 70)], [(2, 30), (1, 90)]
    assert stats.runs_split_test([c, d], 0.0) == pytest.approx(
        sps.fisher_exact([[13, 107], [3, 117]]).pvalue, rel=1e-9
    )
    wider = stats.runs_split_test([a, b], 0.035)
    assert fisher < wider < stats.runs_split_test([a, b], 0.1) < 1
    assert stats.runs_split_test([a, [(0, 60)]], 0.05) < 1
    assert stats.runs_split_test([[(0, 60)], [(0, 60)]], 0.05) == 1.0
    assert stats.runs_split_test([a], 0.05) == 1.0
    # three clusters: each against the others, Bonferroni
    three = stats.runs_split_test([a, b, [(5, 60)]], 0.035)
    assert 0 < three <= 1


def test_runs_split_test_is_valid_on_its_own_model():
    """With the true ICC, the exact test's size is at most alpha (it is conservative, as Fisher's is)."""
    rng = np.random.default_rng(11)
    icc, q, alpha, studies = 0.04, 0.12, 0.05, 400
    s = (1 - icc) / icc
    k = rng.binomial(60, rng.beta(q * s, (1 - q) * s, size=(studies, 4)))
    alarms = sum(
        stats.runs_split_test([[(k[i, 0], 60), (k[i, 1], 60)], [(k[i, 2], 60), (k[i, 3], 60)]], icc) < alpha
        for i in range(studies)
    )
    assert alarms / studies <= alpha + 0.02


def test_t_reference():
    assert stats.t_reference(0.05, 0) == 0.05
    assert stats.t_reference(1.0, 3) == 1.0
    assert stats.t_reference(0.05, 10**6) == pytest.approx(0.05, rel=1e-3)
    assert stats.t_reference(0.05, 2) == pytest.approx(2 * sps.t.sf(sps.norm.isf(0.025), 2))
    assert stats.t_reference(0.01, 3) > stats.t_reference(0.01, 10) > 0.01


# --- Monte Carlo through the report's function -------------------------------------------------------

# a study's arms: (label delta, rate on cluster A, rate on cluster B)
NULL_ARMS = (
    ((), 0.15, 0.15),
    (HC_OFF, 0.075, 0.075),
    (MS_OFF, 0.03, 0.03),
    ({"multi_stream": "off", "hicache": "off"}, 0.0, 0.0),
)
EFFECT_ARMS = (((), 0.15, 0.02), (HC_OFF, 0.15, 0.02), (MS_OFF, 0.0, 0.0))


def simulated_study(
    rng: np.random.Generator, arms, icc_range=(0.02, 0.05), runs_range=(3, 6), sessions: int = 60
) -> list[RunRecord]:
    """One study: a restart ICC drawn from `icc_range`; per arm 3-6 runs, split over the two clusters as a
    two-member pool would (alternately, in a random order); each run's rate beta-binomial around its
    cluster's rate."""
    icc = rng.uniform(*icc_range)
    s = (1 - icc) / icc
    runs = []
    for delta, rate_a, rate_b in arms:
        n_runs = int(rng.integers(runs_range[0], runs_range[1] + 1))
        on = np.arange(n_runs) % 2
        rng.shuffle(on)
        for rep, c in enumerate(on):
            mean = rate_a if c == 0 else rate_b
            p = rng.beta(mean * s, (1 - mean) * s) if mean > 0 else 0.0
            k = int(rng.binomial(sessions, p))
            runs.append(run(dict(delta), rep, k, {"cluster": ("local", "local2-pd1")[c]}, sessions))
    return runs


def alarm_rate(rng: np.random.Generator, arms, studies: int, **kw) -> float:
    """The share of simulated studies in which the report's cluster check alarms."""
    return float(np.mean([plain_and_check(simulated_study(rng, arms, **kw))[2] for _ in range(studies)]))


def plain_and_check(runs: list[RunRecord]) -> tuple[bool, bool, bool]:
    """Whether each alarms: a plain binomial test (Fisher's on each arm's clusters, Holm), the check's
    test with its ICC plugged in as if known (no t reference), and the report's check."""
    block = study.clusters_block(SPEC, runs)
    arms = [[c.run_counts for c in a.cells.values()] for a in block.by_arm if len(a.cells) > 1]
    icc = block.check.icc.icc

    def alarms(ps: list[float]) -> bool:
        return bool(ps) and min(stats.holm(ps)) < SPEC.alpha

    plain = alarms([stats.runs_split_test(cells, 0.0) for cells in arms])
    plugged = alarms([stats.runs_split_test(cells, icc) for cells in arms])
    return plain, plugged, block.check.alarm


def test_monte_carlo_restart_variation_alone_rarely_alarms():
    """ICC 0.02-0.05, 60 sessions a run, 3-6 runs per arm over 2 clusters, no cluster effect: the check
    alarms in at most alpha of studies (+ Monte Carlo slack: 3 standard errors), where a plain binomial
    test alarms in many. Measured (this seed): 1.7% of 1500 studies with dsv4-like arms (15%, 7.5%, 3%, 0%),
    0.6% of 500 with one arm at 15%; a plain binomial test 28.9%, the check's ICC plugged in as known (no t
    reference) 7.2%."""
    rng = np.random.default_rng(20261201)
    studies = 1500
    slack = 3 * np.sqrt(SPEC.alpha * (1 - SPEC.alpha) / studies)
    rates = np.mean([plain_and_check(simulated_study(rng, NULL_ARMS)) for _ in range(studies)], axis=0)
    plain, plugged, check = rates
    one_arm = alarm_rate(rng, NULL_ARMS[:1], studies // 3)
    print(
        f"false alarms, {studies} studies: check {check:.1%} (plain binomial {plain:.1%}, ICC plugged in "
        f"as known {plugged:.1%}); one arm only, {studies // 3} studies: {one_arm:.1%}"
    )
    assert check <= SPEC.alpha + slack, check
    assert one_arm <= SPEC.alpha + 3 * np.sqrt(SPEC.alpha * (1 - SPEC.alpha) / (studies // 3)), one_arm
    assert plain > 3 * SPEC.alpha, plain  # why the runs model: restart variation alone alarms a plain test
    assert plugged > check  # and why the t reference


def test_monte_carlo_a_real_cluster_effect_is_found():
    """Rate 0.15 on one cluster and 0.02 on the other for the two corrupting arms (a bad cluster), a clean
    arm beside, ICC 0.02-0.05, 60 sessions a run. Measured (this seed): the check alarms in 76.8% of 600
    studies with 6 runs per arm (3 per cluster) and in 41.3% with 3-6 runs per arm: with 1-2 runs per
    cluster, and the restart ICC estimated within clusters on a few degrees of freedom, a 7-fold rate
    difference is often within restart variation."""
    rng = np.random.default_rng(7)
    six_runs = alarm_rate(rng, EFFECT_ARMS, 600, runs_range=(6, 6))
    three_to_six = alarm_rate(rng, EFFECT_ARMS, 600)
    print(f"power, 600 studies each: 6 runs per arm {six_runs:.1%}, 3-6 runs per arm {three_to_six:.1%}")
    assert six_runs >= 0.65, six_runs
    assert three_to_six >= 0.3, three_to_six


def test_without_two_runs_on_one_cluster_the_check_uses_the_study_icc():
    runs = [run({}, 0, 9, {"cluster": "local"}), run({}, 1, 14, {"cluster": "local2-pd1"})]
    runs += [run(HC_OFF, 0, 2, {"cluster": "local"}), run(HC_OFF, 1, 6, {"cluster": "local2-pd1"})]
    result = analyse(SPEC, runs)
    check = result.clusters.check
    assert check.icc.source == "study" and check.icc.df == 0
    assert check.icc.icc == result.between_runs.icc
    assert "cannot be estimated within clusters: the study's ICC" in section(result)


def test_the_block_is_order_free_and_the_one_analyse_reports():
    runs = two_cluster_runs()
    result = analyse(SPEC, runs)
    assert dumps(analyse(SPEC, runs[::-1])) == dumps(result)
    assert result.clusters == study.clusters_block(SPEC, runs)
