"""What a study run on a lent GPU machine brings back beside its report, as a section appended to it:
the snapshot it ran, each server start (seconds to healthy per role, from the study's own log), the
decode's captured and eager batches per start (its real log, read by orchestrator.run.observe), the cost
of each step of the run, and what was left running afterwards. The machine itself (GPU, driver, torch,
CUDA, the engine's version) is not written here: every run records it in its tags, and the report's own
Machine section shows it (orchestrator/analysis/machines.py), so a report rebuilt from MLflow keeps it;
device.txt's lines are kept in device_run.json.

    python -m orchestrator.gpu.device_run RESULTS --out reports/real_sglang [--note TEXT ...]

RESULTS is what scripts/real-sglang.sh packs there: `study/` (report.md, report.json, plots),
`logs/<run label>.<role>.log`, `device.txt`, `study.log`, `steps.txt`, `leftovers.txt`. Writes into --out:
the study's files, report.md with the section appended, device_run.json, and the MLflow store
(`mlruns.db`, `mlruns-artifacts.tgz`) with its artifact paths made relative to the checkout's root
(`relocate_artifacts`), so the report rebuilds here. Everything but `main` and `relocate_artifacts` is
pure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.run.observe import parse_decode_log

# orchestrator.arm logs "arm <label>, repetition <r>, signature <sig>", then deploy.py its events
ARM_LINE = re.compile(
    r"arm (?P<label>\S+), repetition (?P<repetition>\d+), signature (?P<signature>[0-9a-f]+)"
)
HEALTHY_LINE = re.compile(r"\b(?P<role>prefill|decode|router) healthy after (?P<seconds>[0-9.]+)s")
FAILED_LINE = re.compile(r"arm (?P<label>\S+) failed: (?P<reason>.*)")
# a start's log: <study>-<signature>-r<repetition>-<run id>.<role>.log
LOG_NAME = re.compile(
    r"^.+?-(?P<signature>[0-9a-f]{12})-r(?P<repetition>\d+)(-[0-9a-f]+)?\.(?P<role>\w+)\.log$"
)


def starts_from_study_log(text: str) -> list[dict[str, Any]]:
    """Each arm start the study log names, in order: label, repetition, signature, seconds to healthy
    per role, and why it failed (if it did)."""
    starts: list[dict[str, Any]] = []
    for line in text.splitlines():
        if arm := ARM_LINE.search(line):
            starts.append(
                {
                    "label": arm["label"],
                    "repetition": int(arm["repetition"]),
                    "signature": arm["signature"],
                    "healthy_s": {},
                    "failed": "",
                }
            )
        elif starts and (healthy := HEALTHY_LINE.search(line)):
            starts[-1]["healthy_s"][healthy["role"]] = float(healthy["seconds"])
        elif starts and (failed := FAILED_LINE.search(line)):
            starts[-1]["failed"] = failed["reason"][:300]
    return starts


def batches_by_start(decode_logs: Mapping[str, str]) -> dict[tuple[str, int], dict[str, Any]]:
    """(signature, repetition) -> what the decode's own log says of that start (LogFacts as a dict)."""
    found = {}
    for name, text in decode_logs.items():
        match = LOG_NAME.match(name)
        if match and match["role"] == "decode":
            found[(match["signature"], int(match["repetition"]))] = dataclasses.asdict(parse_decode_log(text))
    return found


def snapshot_of(device: str) -> str:
    """The commit the device ran (device.txt's `snapshot: <sha>` line), or ""."""
    return next(
        (line.partition(":")[2].strip() for line in device.splitlines() if line.startswith("snapshot:")), ""
    )


def render_section(
    starts: Sequence[Mapping[str, Any]],
    batches: Mapping[tuple[str, int], Mapping[str, Any]],
    steps: str,
    leftovers: str,
    notes: Sequence[str] = (),
    snapshot: str = "",
) -> str:
    """The markdown section (pure). The machine is the report's own Machine section (module doc)."""
    out = ["", "## On the lent GPU machine", ""]
    out += [
        (f"Ran from snapshot {snapshot}. " if snapshot else "")
        + "The machine (GPU, driver, torch, CUDA, engine) is in the report's Machine section, from the runs."
    ]
    out += ["", *notes] if notes else []
    out += [
        "",
        "### Server starts",
        "",
        "Seconds from launch to healthy per role (the router's includes registering both servers), and the "
        "decode's batches as its own log counts them (`Decode batch ... cuda graph: True|False`, one line "
        "per `--decode-log-interval` steps).",
        "",
        "| arm | rep | prefill s | decode s | router s | graph captured | captured batches "
        "| eager batches | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in starts:
        h = s["healthy_s"]
        # a start whose decode never served has no batches (a later start of the same arm and repetition,
        # after a resume, has its own log)
        b = batches.get((s["signature"][:12], s["repetition"]), {}) if "decode" in h else {}

        def cell(role: str, h: Mapping[str, float] = h) -> str:
            return f"{h[role]:.1f}" if role in h else "-"

        out.append(
            f"| {s['label']} | {s['repetition']} | {cell('prefill')} | {cell('decode')} | {cell('router')} | "
            f"{'yes' if b.get('graph_capture_seen') else 'no' if b else '-'} | "
            f"{b.get('capture_batches', '-')} | {b.get('eager_batches', '-')} | {s['failed'] or ''} |"
        )
    out += ["", "### Cost of each step", "", "```", steps.strip(), "```"]
    out += ["", "### Left running after the study", "", "```", leftovers.strip(), "```", ""]
    return "\n".join(out)


def relocate_artifacts(db: Path, root: str) -> int:
    """Point an MLflow sqlite store's artifact paths (absolute paths on the machine that ran it, each
    `.../mlruns/<...>`) at `root` + `/<...>`, a folder relative to the checkout's root where
    mlruns-artifacts.tgz unpacks. Returns the rows changed."""
    with sqlite3.connect(db) as con:
        changed = 0
        for table, column in (("runs", "artifact_uri"), ("experiments", "artifact_location")):
            for key, value in con.execute(f"SELECT rowid, {column} FROM {table}").fetchall():
                _, sep, tail = (value or "").rpartition("/mlruns")
                if sep and not value.startswith(root):
                    con.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (root + tail, key))
                    changed += 1
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.gpu.device_run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the section")
    args = parser.parse_args(argv)
    res: Path = args.results

    def read(name: str) -> str:
        path = res / name
        return path.read_text(errors="replace") if path.exists() else ""

    args.out.mkdir(parents=True, exist_ok=True)
    study = res / "study"
    if study.is_dir():
        for path in study.iterdir():
            if path.is_file():
                shutil.copy2(path, args.out / path.name)
    if (res / "mlruns.db").exists():
        shutil.copy2(res / "mlruns.db", args.out / "mlruns.db")
        out = args.out.resolve()
        checkout = Path(__file__).resolve().parents[2]
        where = out.relative_to(checkout) if out.is_relative_to(checkout) else out
        relocate_artifacts(args.out / "mlruns.db", f"{where}/mlruns")
    if (res / "mlruns-artifacts.tgz").exists():
        shutil.copy2(res / "mlruns-artifacts.tgz", args.out / "mlruns-artifacts.tgz")
    starts = starts_from_study_log(read("study.log"))
    logs = {p.name: p.read_text(errors="replace") for p in sorted((res / "logs").glob("*.decode.log"))}
    batches = batches_by_start(logs)
    section = render_section(
        starts, batches, read("steps.txt"), read("leftovers.txt"), args.note, snapshot_of(read("device.txt"))
    )
    report = args.out / "report.md"
    report.write_text((report.read_text() if report.exists() else "") + section)
    record = {
        "device": read("device.txt").strip().splitlines(),
        "starts": starts,
        "decode_batches": {f"{sig}-r{rep}": facts for (sig, rep), facts in batches.items()},
        "steps": read("steps.txt").strip().splitlines(),
        "leftovers": read("leftovers.txt").strip().splitlines(),
    }
    (args.out / "device_run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {report} and {args.out / 'device_run.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
