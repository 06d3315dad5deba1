"""The GPU decode's own evidence beside a study's report: per-bucket counters per start, start-to-start
variation, the step alone (probe), the snapshot it ran and its timing. The machine (GPU, driver, torch,
CUDA, engine) is not repeated here: every run records it in its tags and the report's own Machine section
shows it (orchestrator/analysis/machines.py), so a report rebuilt from MLflow keeps it; gpu_buckets.json
keeps device.txt and timing.txt as they came.

    python -m orchestrator.gpu.report RESULTS --out reports/gpu_race [--gpu-minutes M] [--command C]
        [--note TEXT ...]

RESULTS is what scripts/gpu-race.sh packs on the GPU machine: `study/` (the study's report.md,
report.json and plots), `logs/<run label>.decode.log`, `counters/decode-*.json` (one per decode start,
orchestrator.gpu.engine), `probe.json`, `device.txt`, `timing.txt`. A start's counters belong to the run
whose decode log names its seed; the run label (`<study>-<signature>-r<repetition>`) names the arm.
Writes into --out: the study's files, report.md with a section appended, gpu_buckets.json, buckets.png.
Everything but `main` and the plot is pure.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.analysis.stats import design_effect, dispersion

SEED_LINE = re.compile(r"GPU decode engine on .*\bseed (\d+)")
# a start's log folder: <study>-<signature>-r<repetition>, then (since every start logs apart) its run id
LABEL = re.compile(r"^(?P<study>.+?)-(?P<signature>[0-9a-f]{12})-r(?P<repetition>\d+)(-[0-9a-f]+)?$")
EAGER = "eager"


def seed_in_log(text: str) -> int | None:
    match = SEED_LINE.search(text)
    return int(match.group(1)) if match else None


def attribute(counters: Sequence[Mapping[str, Any]], logs: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Run label -> the counters of the decode start whose seed that run's decode log names."""
    by_seed = {c["seed"]: c for c in counters}
    found = {}
    for label, text in logs.items():
        seed = seed_in_log(text)
        if seed is not None and seed in by_seed:
            found[label] = dict(by_seed[seed])
    return found


def parse_label(label: str) -> tuple[str, int] | None:
    match = LABEL.match(label)
    return (match["signature"], int(match["repetition"])) if match else None


def start_rows(
    report: Mapping[str, Any], attributed: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One row per run of the study: its arm, sessions corrupted, and its decode start's counters."""
    starts = {parse_label(label): c for label, c in attributed.items() if parse_label(label)}
    rows = []
    for arm in report["arms"]:
        for run in arm["runs"]:
            # the deployment's signature (an arm's identity adds its workload's conditions)
            signature = arm.get("deployment_signature", arm["signature"])
            counters = starts.get((signature, int(run["repetition"])))
            rows.append(
                {
                    "arm": arm["label"],
                    "signature": arm["signature"],
                    "repetition": int(run["repetition"]),
                    "corrupted": int(run["corrupted"]),
                    "n": int(run["corrupted"]) + int(run["clean"]),
                    "status": run.get("status", ""),
                    "counters": counters,
                }
            )
    return rows


def bucket_labels(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    seen = {b for r in rows if r["counters"] for b in r["counters"]["buckets"]}
    return sorted(seen, key=lambda b: (b == EAGER, int(b) if b != EAGER else 0))


def variation(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Between-start variation of the session corruption rate, by the study's own estimator
    (orchestrator.analysis.stats.dispersion, pooled over arms with two or more runs and some corruption)."""
    arms: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        arms.setdefault(r["arm"], []).append((r["corrupted"], r["n"]))
    d = dispersion(list(arms.values()))
    return {
        "per_arm": {arm: [list(run) for run in runs] for arm, runs in arms.items()},
        "phi": d.phi,
        "df": d.df,
        "icc": d.icc,
        "mean_run_size": d.mean_run_size,
        "design_effect": design_effect(d.icc, d.mean_run_size) if d.estimated else None,
        "estimated": d.estimated,
    }


def probe_summary(probe: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per probe cell: mismatched steps and rows per bucket, summed over its starts."""
    cells: dict[tuple, dict[str, Any]] = {}
    for cell in probe.get("cells", []):
        key = (cell["mode"], cell["bf16_keys"], cell["multi_stream"], cell["record_stream"])
        row = cells.setdefault(
            key,
            {
                "mode": cell["mode"],
                "keys": "bf16" if cell["bf16_keys"] else "fp8",
                "multi_stream": cell["multi_stream"],
                "record_stream": cell["record_stream"],
                "workspace_kib": cell["workspace_bytes"] // 1024,
                "starts": 0,
                "buckets": {},
            },
        )
        row["starts"] += 1
        for bucket, c in cell["buckets"].items():
            acc = row["buckets"].setdefault(str(bucket), {"steps": 0, "bad_steps": 0, "bad_rows": 0})
            for k in acc:
                acc[k] += c[k]
    return list(cells.values())


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.1f}%" if n else "-"


def device_run_lines(device: str, timing: str) -> str:
    """What the section says of the device run itself: the snapshot it ran (device.txt's `snapshot:` line)
    and its timing (timing.txt); device.txt's machine lines are the runs' own (module doc)."""
    lines = [line for line in device.splitlines() if line.startswith("snapshot:")]
    return "\n".join([*lines, *timing.strip().splitlines()])


def render_section(
    rows: Sequence[Mapping[str, Any]],
    var: Mapping[str, Any],
    probe: Sequence[Mapping[str, Any]],
    run: str,
    notes: Mapping[str, Any],
) -> str:
    """The markdown section (pure); `run`: the device run's snapshot and timing (`device_run_lines`)."""
    buckets = bucket_labels(rows)
    out = ["", "## GPU decode: what the device did (orchestrator/gpu)", ""]
    out += [
        "Every decode step ran real torch work on the GPU: the batch's CUDA graph (one per bucket, captured "
        "at start-up) or eager above the largest bucket, the sparse indexer on a side stream when "
        "multi-stream overlap is on, and a serialized reference of the indexer for the same inputs. A "
        "request whose row disagreed had its tool call corrupted from that token on. No probability table: "
        "the counts below are the GPU's.",
        "",
        "The machine (GPU, driver, torch, CUDA, engine) is in the report's Machine section, from the runs.",
        "",
        *(["**The device run**", "", "```", run.strip(), "```", ""] if run.strip() else []),
        "### Mismatching decode steps per batch bucket, per arm and start",
        "",
        "Each cell: steps whose indexer disagreed with the reference / steps run in that bucket "
        "(B = the captured batch size a step was padded to; eager = no graph). Sessions: corrupted/n as "
        "the oracle judged them; GPU turns: planned tool calls the engine corrupted / planned tool calls "
        "it served (a session ends at its first bad turn, so its later rounds never reach the server).",
        "",
        "| arm | start | sessions | GPU turns | "
        + " | ".join(f"B{b}" if b != EAGER else b for b in buckets)
        + " |",
        "|---|---|---|---|" + "---|" * len(buckets),
    ]
    for r in rows:
        c = r["counters"]
        if c is None:
            cells = ["(no counters)"] + [""] * (len(buckets) - 1) if buckets else []
            turns = "?"
        else:
            cells = []
            for b in buckets:
                bc = c["buckets"].get(b)
                cells.append(f"{bc['mismatched_steps']}/{bc['steps']}" if bc else "")
            turns = f"{c['corrupted_turns']}/{c['planned_turns']}"
        out.append(
            f"| {r['arm']} | r{r['repetition']} | {r['corrupted']}/{r['n']} | {turns} | "
            + " | ".join(cells)
            + " |"
        )
    out += ["", "### Start-to-start variation", ""]
    per_arm = ", ".join(
        f"{arm}: " + " vs ".join(f"{k}/{n} ({_pct(k, n)})" for k, n in runs)
        for arm, runs in var["per_arm"].items()
    )
    out.append(f"Sessions corrupted per start: {per_arm}.")
    out.append("")
    if var["estimated"]:
        out.append(
            f"Pooled over the arms with corruption (orchestrator.analysis.stats.dispersion): dispersion phi "
            f"{var['phi']:.2f} on {var['df']} df, restart ICC {var['icc']:.3f}, design effect "
            f"{var['design_effect']:.2f} at {var['mean_run_size']:.0f} sessions per start."
        )
    else:
        out.append("No arm has two starts with corruption: between-start variation cannot be estimated.")
    if probe:
        out += [
            "",
            "### The decode step alone (orchestrator.gpu.probe): full batches, per bucket",
            "",
            "Mismatched steps / steps, and rows hit per step, summed over the probe's starts.",
            "",
            "| mode | keys | multi-stream | record_stream | "
            + " | ".join(f"B{b}" for b in probe[0]["buckets"])
            + " |",
            "|---|---|---|---|" + "---|" * len(probe[0]["buckets"]),
        ]
        for p in probe:
            cells = [
                f"{c['bad_steps']}/{c['steps']} ({c['bad_rows'] / c['steps']:.1f} rows)" if c["steps"] else ""
                for c in p["buckets"].values()
            ]
            out.append(
                f"| {p['mode']} | {p['keys']} | {'on' if p['multi_stream'] else 'off'} | "
                f"{'yes' if p['record_stream'] else 'no'} | " + " | ".join(cells) + " |"
            )
    if notes:
        out += ["", "### Closing note", ""]
        out += [f"- **{k}**: {v}" for k, v in notes.items()]
    return "\n".join(out) + "\n"


def bucket_plot(rows: Sequence[Mapping[str, Any]], path: Path, study: str) -> Path:
    """Fraction of steps that mismatched, per bucket, one line per arm (its starts pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = bucket_labels(rows)
    fig, ax = plt.subplots(figsize=(8, 4))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    for n_arm, arm in enumerate(arms):
        bad, steps = [0] * len(buckets), [0] * len(buckets)
        for r in rows:
            if r["arm"] != arm or not r["counters"]:
                continue
            for i, b in enumerate(buckets):
                c = r["counters"]["buckets"].get(b)
                if c:
                    bad[i] += c["mismatched_steps"]
                    steps[i] += c["steps"]
        ax.plot(
            buckets,
            [100 * k / n if n else float("nan") for k, n in zip(bad, steps, strict=True)],
            "-",
            marker="osD^vx"[n_arm % 6],
            markersize=12 - 7 * n_arm / max(1, len(arms) - 1),  # arms that coincide stay visible
            alpha=0.8,
            label=arm,
        )
    ax.set_xlabel("batch bucket (captured graph size; eager: no graph)")
    ax.set_ylabel("decode steps whose indexer mismatched, %")
    ax.set_ylim(-3, 103)
    ax.legend(fontsize=7)
    ax.set_title(f"{study}: mismatching steps per bucket")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--gpu-minutes", default=None, help="device time this session used (the device tool's lease)"
    )
    p.add_argument("--command", default=None, help="the exact command that reproduces the run")
    p.add_argument("--note", action="append", default=[], help="KEY=TEXT lines for the closing note")
    args = p.parse_args(argv)

    res = args.results
    report = json.loads((res / "study" / "report.json").read_text())
    counters = [json.loads(f.read_text()) for f in sorted((res / "counters").glob("decode-*.json"))]
    logs = {
        f.name.removesuffix(".decode.log"): f.read_text() for f in sorted((res / "logs").glob("*.decode.log"))
    }
    rows = start_rows(report, attribute(counters, logs))
    var = variation(rows)
    probe = (
        probe_summary(json.loads((res / "probe.json").read_text())) if (res / "probe.json").exists() else []
    )

    def read(name: str) -> str:
        return (res / name).read_text() if (res / name).exists() else ""

    device = "\n".join(text for name in ("device.txt", "timing.txt") if (text := read(name).strip()))
    notes: dict[str, Any] = {}
    if args.gpu_minutes:
        notes["GPU minutes used"] = args.gpu_minutes
    if args.command:
        notes["Reproduce"] = f"`{args.command}`"
    for line in args.note:
        key, _, text = line.partition("=")
        notes[key] = text

    args.out.mkdir(parents=True, exist_ok=True)
    for f in (res / "study").iterdir():
        if f.is_file():
            shutil.copy2(f, args.out / f.name)
    section = render_section(
        rows, var, probe, device_run_lines(read("device.txt"), read("timing.txt")), notes
    )
    with (args.out / "report.md").open("a") as fh:
        fh.write(section)
    (args.out / "gpu_buckets.json").write_text(
        json.dumps({"device": device, "starts": rows, "variation": var, "probe": probe}, indent=1)
    )
    bucket_plot(rows, args.out / "buckets.png", report["study"]["name"])
    print(f"wrote {args.out}/report.md (+ GPU section), gpu_buckets.json, buckets.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
