"""PNG plots of a study report (the typed result in, files out): corruption per arm, tok/s per level, and
where the outputs first diverged per arm (studies judged by the differential oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI

import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from orchestrator.analysis.result import StudyResult


def corruption_plot(result: StudyResult, path: Path) -> Path:
    """Corruption rate per arm with its exact interval, and the study's ceiling."""
    arms = [a for a in result.arms if a.n]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(arms) + 1.5))
    labels = [f"{a.label} ({a.corrupted}/{a.n})" for a in arms]
    rates = [a.rate * 100 for a in arms]
    err = [[(a.rate - a.ci[0]) * 100 for a in arms], [(a.ci[1] - a.rate) * 100 for a in arms]]
    ys = list(range(len(arms)))[::-1]
    ax.errorbar(rates, ys, xerr=err, fmt="o", capsize=4, color="tab:red")
    ax.axvline(result.study.ceiling * 100, ls="--", color="grey", label="ceiling")
    ax.set_yticks(ys, labels)
    ax.set_xlabel(f"corrupted sessions, % ({result.confidence:.0%} Clopper-Pearson)")
    ax.set_xlim(left=0)
    ax.legend(loc="lower right")
    ax.set_title(f"{result.study.name}: corruption per arm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_plot(result: StudyResult, path: Path) -> Path:
    """Mean output tok/s against concurrency, one line per arm."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in result.arms:
        points = [(lv.concurrency, lv.tok_s) for lv in arm.throughput if lv.tok_s is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=arm.label)
    ax.set_xscale("log", base=2)
    levels = sorted({lv.concurrency for arm in result.arms for lv in arm.throughput})
    if levels:
        ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{result.study.name}: throughput per arm")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def divergence_plot(result: StudyResult, path: Path) -> Path:
    """Where the first divergence falls, per arm judged by the differential oracle: one row per arm, a
    histogram of its diverged sessions' first differing positions, and the `early_tokens` boundary."""
    arms = [a for a in result.arms if a.divergence]
    top = max((p for a in arms for p in a.divergence.positions), default=0)
    # one bin per position while that stays readable, else about 40 bins
    step = max(1, -(-(top + 1) // 40))
    edges = [x - 0.5 for x in range(0, top + step + 1, step)]
    fig, axes = plt.subplots(len(arms), 1, figsize=(7, 1.3 * len(arms) + 1.2), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, arm) in enumerate(zip(axes[:, 0], arms, strict=True)):
        d = arm.divergence
        if d.positions:
            ax.hist(d.positions, bins=edges, color=colours[i % len(colours)])
        else:
            ax.text(0.5, 0.5, "no divergence", transform=ax.transAxes, ha="center", va="center", color="grey")
        if d.early_tokens is not None and d.early_tokens <= top + step:
            ax.axvline(d.early_tokens - 0.5, ls="--", color="grey")
        ax.set_ylabel(f"{arm.label}\n{len(d.positions)}/{arm.n}", rotation=0, ha="right", va="center")
        ax.yaxis.get_major_locator().set_params(integer=True)
    basis = sorted({b for a in arms for b in a.divergence.basis})
    unit = {"tokens": "token", "text": "word"}
    axes[-1, 0].set_xlabel(
        "first differing " + " or ".join(unit.get(b, b) for b in basis or ["tokens"]) + " (from 0); "
        "dashed: early_tokens"
    )
    axes[-1, 0].set_xlim(left=-0.5)
    axes[0, 0].set_title(f"{result.study.name}: first divergence from the batch-1 reference")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
