"""Today's parser and oracle (from git) and this tree's agree on every turn the sim can produce.

The turns: every turn of a stress run against the sim with its built-in fault model at the baseline
(captured graphs, overlap, bf16 index keys, HiCache: it corrupts turns in all its shapes), every turn of
a run against the healthy sim, and mutations of healthy turns that reach the detectors the sim's fault
model does not (invalid UTF-8, control characters, no finish_reason, schema violations, leaked call
syntax, a repeated argument delta, a missing call). Each raw SSE body (as recorded in the transcripts)
is fed to both revisions' SSEParser in several chunkings; the parsed turns must be the same, and both
revisions' check_turn must return the same Finding (detector and reason), with and without the plan
check. The old modules are read from git (`git show 3d03c97:...`), never copied into the tree; without
that revision (a shallow clone), the test is skipped.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from orchestrator.workload import detect, sse
from orchestrator.workload.stress import StressSettings, run_stress_sync
from orchestrator.workload.tasks import make_task

OLD_REV = "3d03c97"  # the client and oracle before issue 17 part 5
REPO = Path(__file__).resolve().parents[2]


def old_module(name: str) -> ModuleType:
    """orchestrator/workload/<name>.py as it was at OLD_REV, loaded as a module of its own."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{OLD_REV}:orchestrator/workload/{name}.py"],
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git revision {OLD_REV} is not available (a shallow clone?)")
    # the shared dataclasses have moved since (orchestrator/results.py -> orchestrator/workload/results.py)
    source = source.replace("orchestrator.results", "orchestrator.workload.results")
    module_name = f"_old_{name}_{OLD_REV}"
    spec = importlib.util.spec_from_loader(module_name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, f"{OLD_REV}:orchestrator/workload/{name}.py", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def old() -> tuple[ModuleType, ModuleType]:
    return old_module("client"), old_module("detect")


def recorded_turns(url: str, out: Path, seed: int, sessions: int) -> list[tuple[bytes, object, list]]:
    """(raw SSE body, the call the plan expects, the finding the live run recorded) for every turn."""
    settings = StressSettings(
        url=url, out_dir=out, sessions=sessions, rounds=4, concurrency=sessions, seed=seed, model="m",
        timeout_s=60.0, progress=False, keep_transcripts=True,
    )  # fmt: skip
    summary = run_stress_sync(settings)
    assert summary.errored == 0 and summary.sessions == sessions
    turns = []
    for path in sorted((out / "transcripts").glob("*.json")):
        transcript = json.loads(path.read_text())
        index = int(transcript["session_id"].rsplit("-", 1)[1])
        task = make_task(seed, index, 4)
        for turn in transcript["turns"]:
            raw = base64.b64decode(turn["raw_sse_b64"])
            turns.append((raw, task.expected(turn["round_index"]), turn["findings"]))
    return turns


def events_of(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def mutations(raw: bytes, rng: random.Random) -> list[bytes]:
    """Healthy bodies changed so that each detector the fault model does not reach gets its turn."""
    events = events_of(raw)
    calls = [i for i, e in enumerate(events) if b'"arguments":"' in e and b'"id":null' in e]
    out = []
    if calls:
        at = rng.choice(calls)

        def edit(old: bytes, new: bytes, where: int = at) -> bytes:
            changed = list(events)
            changed[where] = changed[where].replace(old, new, 1)
            return b"".join(changed)

        out.append(edit(b'"arguments":"', b'"arguments":"\xff\xfe'))  # invalid UTF-8 bytes
        out.append(edit(b'"arguments":"', b'"arguments":"\\u0007'))  # a control character
        out.append(edit(b'"arguments":"', b'"arguments":"\\ud800'))  # a lone surrogate escape
        out.append(edit(b'"arguments":"{', b'"arguments":"{\\"extra\\": 1, ', calls[0]))  # schema
        out.append(edit(b'"arguments":"', b'"arguments":"\\"mode\\": \\"r\\", '))  # broken JSON
        repeated = list(events)
        repeated[at:at] = [events[at]] * 30  # a decoding loop in the arguments
        out.append(b"".join(repeated))
    out.append(raw.replace(b'"finish_reason":"tool_calls"', b'"finish_reason":null'))  # truncated
    out.append(raw.replace(b'"function":{"name":"', b'"function":{"name":"x_', 1))  # an unknown tool
    leak = b'data: {"choices":[{"index":0,"delta":{"content":"<tool_call>{\\"name\\": \\"x\\"}"}}]}\n\n'
    out.append(leak + raw)
    no_call = [e for e in events if b'"tool_calls":[' not in e]  # the calls dropped: missing_tool_call
    out.append(b"".join(no_call))
    return out


def chunkings(raw: bytes, rng: random.Random) -> list[list[bytes]]:
    cuts = sorted(rng.sample(range(1, len(raw)), min(40, len(raw) - 1)))
    return [
        [raw],
        events_of(raw),
        [raw[i : i + 7] for i in range(0, len(raw), 7)],
        [raw[i : i + 64] for i in range(0, len(raw), 64)],
        [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)],
    ]


def parse(module: ModuleType, pieces: list[bytes]):
    parser = module.SSEParser()
    try:
        for i, piece in enumerate(pieces):
            parser.feed(piece, float(i))
        return parser.finish(float(len(pieces)))
    except module.RequestError as e:
        return ("error", e.kind, e.message)


def summary_of(turn) -> tuple:
    if isinstance(turn, tuple):
        return turn
    calls = [(c.index, c.id, c.name, c.arguments) for c in turn.tool_calls]
    fields = (turn.content, turn.reasoning, calls, turn.finish_reason, turn.usage, turn.done, turn.raw)
    return (*fields, turn.chunk_times, turn.ended)


def verdict(oracle: ModuleType, turn, expected, plan: bool):
    finding = oracle.check_turn(turn, expected, check_plan=plan)
    return None if finding is None else (finding.detector, finding.reason)


def test_old_and_new_parser_and_oracle_agree_on_every_sim_turn(start_sim, tmp_path, old):
    old_client, old_detect = old
    faulty = start_sim(args=("--enable-hierarchical-cache",), env={"SGLANG_DSV4_BF16_INDEX_K": "1"})
    turns = recorded_turns(faulty.url, tmp_path / "faulty", seed=3, sessions=60)
    faulty.stop()
    healthy = start_sim()
    clean = recorded_turns(healthy.url, tmp_path / "healthy", seed=5, sessions=30)
    assert any(findings for _, _, findings in turns), "the fault model corrupted no turn"
    assert not any(findings for _, _, findings in clean)
    rng = random.Random(17)
    corpus = [(raw, expected, findings, "recorded") for raw, expected, findings in turns + clean]
    for raw, expected, _ in rng.sample(clean, 40):
        corpus += [(body, expected, None, "mutated") for body in mutations(raw, rng)]
    seen: dict[str, int] = {}
    for raw, expected, recorded, origin in corpus:
        whole_old = parse(old_client, [raw])
        for pieces in chunkings(raw, rng):
            new_turn, old_turn = parse(sse, pieces), parse(old_client, pieces)
            assert summary_of(new_turn) == summary_of(old_turn), (origin, pieces[:2])
        if isinstance(whole_old, tuple):
            seen[f"error:{whole_old[1]}"] = seen.get(f"error:{whole_old[1]}", 0) + 1
            continue
        whole_new = parse(sse, [raw])
        for plan in (False, True):
            want = verdict(old_detect, whole_old, expected, plan)
            assert verdict(detect, whole_new, expected, plan) == want, (origin, raw[:300])
        want = verdict(old_detect, whole_old, expected, True)
        seen[want[0] if want else "clean"] = seen.get(want[0] if want else "clean", 0) + 1
        if recorded is not None:  # what the live run decided, chunked as the network delivered it
            assert [(f["detector"], f["reason"]) for f in recorded] == ([want] if want else [])
    # every detector fired at least once over the corpus, and healthy turns were judged clean
    assert set(detect.DETECTORS) <= set(seen), seen
    assert seen["clean"] > 100, seen
