"""Side-by-side client benchmark: heisenhunt's bench client vs a peer load generator (guidellm 0.8.1).

Both clients hit the same local endpoint (the simulated SGLang server, started here, or `--url`) with
streaming chat completions, one after the other in one run. Each runs as its own process pinned to
one CPU core (`taskset`), the server pinned to another, so what is measured is what one core of
client can do.

Comparable load. A nominal concurrency is not an achieved one: pinned to one core, guidellm keeps far
fewer streams in flight than it is asked for (14.5 of 32 in an earlier run, where ours held 31.9),
and its synthetic prompts are not our prompts (the server counted ~20% more tokens in guidellm's).
So the run first measures guidellm at `--concurrency` and then sets ours to what guidellm reached
(`--match-concurrency`, default on): our client's concurrency is the peer's achieved concurrency,
rounded, and our prompt length (`--input-len`, in words) is calibrated with short probe runs until
the server counts as many prompt tokens per request as it counted for guidellm (`--match-prompt`,
default on). Output lengths are the same by construction (max_tokens with ignore_eos for both). The
table prints, for both: achieved concurrency, prompt and output tokens per request as the server
counted them, and the throughput each tool measured.

Achieved concurrency is computed the same way for both tools, from their own per-request latencies:
sum of request latencies / the tool's measured duration (Little's law; it includes the ramp-down,
so it reads a little below what the closed loop held).

Per tool and run it records the wall time, the requests and output tokens the tool itself counted,
the server's own counts (GET /server_info of the sim: requests, prompt and generated tokens), and
the CPU time of the tool's whole process tree (`os.wait4` rusage of the child, which includes its
reaped worker processes: guidellm runs its workers as subprocesses). Start-up costs (imports, torch and
the tokenizer for guidellm, building prompts) are not what a load generator spends per request, so
every tool is run at two request counts and the figures are the *marginal* ones:

    CPU per request       = (cpu(N_large) - cpu(N_small)) / (N_large - N_small)
    max request/s per core = 1 / CPU per request        (what one core of client could sustain)
    max tok/s per core     = output tokens per request / CPU per request
    measured req/s, tok/s  = the tool's own count / its own measured duration, at N_large

and prints ours/peer ratios (> 1: ours is better, except CPU per request where < 1 is better). The
runs go peer N_small, ours N_small, ours N_large, peer N_large (drift of a shared host hits both).

guidellm is installed from PyPI (guidellm==0.8.1) into its own virtualenv (it pins torch,
transformers, datasets), never into the project's. It needs a tokenizer to size its synthetic
prompts; no model hub can be reached here, so a word-level tokenizer over faker's English word list
(the words guidellm's synthetic text is made of) is built locally with `tokenizers` and saved as a
Hugging Face tokenizer directory, loaded with HF_HUB_OFFLINE=1.

    python bench/bench_vs_peer.py                      # sim at 1/1000 time, C=32, 100 then 1000 requests
    python bench/bench_vs_peer.py --concurrency 8 --requests 100,300 --output-len 256
    python bench/bench_vs_peer.py --no-match-concurrency --no-match-prompt   # nominal settings only
    python bench/bench_vs_peer.py --url http://127.0.0.1:8000 --model my-model   # an existing endpoint
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout; the package is normally installed

from orchestrator.remote.local import LocalTransport  # noqa: E402
from orchestrator.sim.launch import server_launch, wait_healthy  # noqa: E402

DEFAULT_PEER_VENV = Path(tempfile.gettempdir()) / "heisenhunt-peer-guidellm"
PEER_VERSION = "0.8.1"

TOKENIZER_SCRIPT = r"""
import sys
from faker.providers.lorem.en_US import Provider
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = sorted({w.lower() for w in Provider.word_list} | {w.capitalize() for w in Provider.word_list})
vocab = {"[UNK]": 0, "[PAD]": 1}
for token in [*".,;:!?'\"-()", *words]:
    vocab.setdefault(token, len(vocab))
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
fast.save_pretrained(sys.argv[1])
"""


@dataclass
class Run:
    tool: str
    requests_asked: int
    requests: int  # completed, as the tool counted them
    errors: int
    output_tokens: int  # as the tool counted them (both read the server's usage)
    duration_s: float  # the tool's own measured benchmark duration
    wall_s: float  # the process, start-up included
    cpu_s: float  # user + system of the process tree
    latency_sum_s: float = 0.0  # sum of the completed requests' latencies, as the tool measured them
    concurrency: int = 0  # the concurrency the tool was asked for
    input_len: int = 0  # the prompt length the tool was asked for (ours: words; guidellm: its tokens)
    server: dict[str, int] | None = None  # the server's own counts over the run (None: not the sim)

    @property
    def achieved_concurrency(self) -> float:
        """Requests in flight on average: sum of latencies / duration (Little's law), for both tools."""
        return self.latency_sum_s / self.duration_s if self.duration_s > 0 else float("nan")

    @property
    def prompt_tokens_per_request(self) -> float:
        """Prompt tokens per request as the server counted them (NaN where it cannot say)."""
        if not self.server or not self.server.get("requests"):
            return float("nan")
        return self.server["prompt_tokens"] / self.server["requests"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(argv: list[str], core: int | None) -> list[str]:
    if core is None or not shutil.which("taskset"):
        return argv
    return ["taskset", "-c", str(core), *argv]


# Runs argv as a child subreaper (PR_SET_CHILD_SUBREAPER), so worker processes that outlive their
# parent are reparented here and reaped too; then RUSAGE_CHILDREN holds the CPU of the whole tree.
REAPER_SCRIPT = r"""
import ctypes, json, os, resource, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
report, argv = sys.argv[1], sys.argv[2:]
main = os.posix_spawnp(argv[0], argv, os.environ)
rc, lingering, deadline = None, 0, None
while True:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
    except ChildProcessError:
        break
    if pid == main:
        rc, deadline = os.waitstatus_to_exitcode(status), time.monotonic() + 30
    elif pid == 0:
        if time.monotonic() > deadline:
            lingering = 1
            break
        time.sleep(0.05)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(report, "w") as f:
    json.dump({"cpu_s": usage.ru_utime + usage.ru_stime, "rc": rc, "lingering": lingering}, f)
sys.exit(rc if rc is not None else 1)
"""


def run_measured(
    argv: list[str], env: dict[str, str], log_path: Path, core: int | None
) -> tuple[float, float]:
    """Run argv to completion on `core`; (wall seconds, CPU seconds of its whole process tree)."""
    report = log_path.with_suffix(".rusage.json")
    wrapped = pinned([sys.executable, "-c", REAPER_SCRIPT, str(report), *argv], core)
    with log_path.open("wb") as log:
        started = time.monotonic()
        done = subprocess.run(
            wrapped, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` exited {done.returncode}; see {log_path}")
    usage = json.loads(report.read_text())
    if usage["lingering"]:
        raise RuntimeError(f"`{shlex.join(argv)}` left processes running 30 s after it exited")
    return wall, usage["cpu_s"]


def ensure_peer(venv: Path) -> Path:
    """The peer's python: guidellm PEER_VERSION installed with pip into `venv` (created when missing)."""
    python = venv / "bin" / "python"
    check = f"import importlib.metadata as m; assert m.version('guidellm') == {PEER_VERSION!r}"
    if python.exists() and subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        return python
    print(f"installing guidellm=={PEER_VERSION} into {venv} (pulls torch; several minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"guidellm=={PEER_VERSION}"], check=True)
    return python


def server_counts(url: str) -> dict[str, int] | None:
    """The sim's own counters (GET /server_info): requests, prompt and generated tokens; None for
    another server."""
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=5) as resp:
            info = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    counters = (info.get("sim") or {}).get("counters", {})
    keys = ("requests", "prompt_tokens", "tokens_generated")
    if not all(isinstance(counters.get(k), int) for k in keys):
        return None
    return {k: counters[k] for k in keys}


def counted(url: str, run: Callable[[], Run]) -> Run:
    """`run()`, with the server's counts over it (the sim's counters after minus before)."""
    before = server_counts(url)
    result = run()
    after = server_counts(url)
    if before is not None and after is not None:
        result.server = {k: after[k] - before[k] for k in before}
    return result


def run_ours(
    args: argparse.Namespace, url: str, n: int, work: Path, concurrency: int, input_len: int, tag: str = ""
) -> Run:
    out = work / f"ours-{n}{tag}"
    argv = [
        sys.executable,
        "-m",
        "orchestrator.workload.bench",
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--requests",
        str(n),
        "--input-len",
        str(input_len),
        "--output-len",
        str(args.output_len),
        "--model",
        args.model,
        "--warmup",
        "0",
        "--timeout",
        "300",
        "--out",
        str(out),
    ]
    wall, cpu = run_measured(argv, dict(os.environ), work / f"ours-{n}{tag}.log", args.client_core)
    level = json.loads((out / "bench.json").read_text())["levels"][0]
    return Run(
        "heisenhunt",
        n,
        level["requests"],
        level["errors"],
        level["output_tokens"],
        level["duration_s"],
        wall,
        cpu,
        latency_sum_s=float(sum(level["request_latency_s"])),
        concurrency=concurrency,
        input_len=input_len,
    )


def run_peer(
    args: argparse.Namespace, python: Path, tokenizer: Path, url: str, n: int, work: Path, streams: int
) -> Run:
    out = work / f"peer-{n}.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": args.model,
                "request_format": "/v1/chat/completions",
                "validate_backend": False,
                "timeout": 300,
            },
            "profile": {"kind": "concurrent", "streams": streams},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [
                {"kind": "synthetic_text", "prompt_tokens": args.input_len, "output_tokens": args.output_len}
            ],
            "constraints": [{"kind": "max_requests", "count": n}],
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }
    scenario_path = work / f"peer-{n}.scenario.json"
    scenario_path.write_text(json.dumps(scenario, indent=1))
    guidellm = python.parent / "guidellm"
    argv = [str(guidellm), "run", "--scenario", str(scenario_path), "--disable-console"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    wall, cpu = run_measured(argv, env, work / f"peer-{n}.log", args.client_core)
    bench = json.loads(out.read_text())["benchmarks"][0]
    metrics = bench["metrics"]
    return Run(
        "guidellm",
        n,
        int(metrics["request_totals"]["successful"]),
        int(metrics["request_totals"]["errored"]),
        int(metrics["output_token_count"]["successful"]["total_sum"]),
        float(bench["duration"]),
        wall,
        cpu,
        latency_sum_s=float(metrics["request_latency"]["successful"]["total_sum"]),
        concurrency=streams,
        input_len=args.input_len,
    )


def calibrate_input_len(
    args: argparse.Namespace, url: str, work: Path, concurrency: int, target: float
) -> tuple[int, list[tuple[int, float]]]:
    """Our prompt length in words whose server-counted prompt tokens per request come closest to
    `target`: probe runs (a few requests each) at two lengths, a linear fit (tokens grow linearly
    with words), then probes around the fit. Returns the length and every (length, tokens) probed."""
    n = max(concurrency, 16)
    probes: dict[int, float] = {}

    def probe(length: int) -> float:
        if length not in probes:
            run = counted(url, lambda: run_ours(args, url, n, work, concurrency, length, f"-probe{length}"))
            probes[length] = run.prompt_tokens_per_request
        return probes[length]

    low, high = max(1, args.input_len // 2), args.input_len * 2
    slope = (probe(high) - probe(low)) / (high - low)
    guess = max(1, round(low + (target - probe(low)) / slope)) if slope > 0 else args.input_len
    for length in (guess - 1, guess, guess + 1):
        if length >= 1:
            probe(length)
    best = min(probes, key=lambda length: abs(probes[length] - target))
    return best, sorted(probes.items())


@dataclass
class Figures:
    cpu_per_request_ms: float
    max_req_s_per_core: float
    max_tok_s_per_core: float
    req_s: float
    tok_s: float
    tokens_per_request: float
    achieved_concurrency: float
    prompt_tokens_per_request: float
    server_output_tokens_per_request: float


def figures(small: Run, large: Run) -> Figures:
    cpu_per_request = (large.cpu_s - small.cpu_s) / max(1, large.requests - small.requests)
    tokens_per_request = large.output_tokens / max(1, large.requests)
    server = large.server or {}
    return Figures(
        cpu_per_request_ms=cpu_per_request * 1e3,
        max_req_s_per_core=1.0 / cpu_per_request if cpu_per_request > 0 else float("inf"),
        max_tok_s_per_core=tokens_per_request / cpu_per_request if cpu_per_request > 0 else float("inf"),
        req_s=large.requests / large.duration_s,
        tok_s=large.output_tokens / large.duration_s,
        tokens_per_request=tokens_per_request,
        achieved_concurrency=large.achieved_concurrency,
        prompt_tokens_per_request=large.prompt_tokens_per_request,
        server_output_tokens_per_request=(
            server["tokens_generated"] / server["requests"] if server.get("requests") else float("nan")
        ),
    )


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="an existing endpoint; default: start the sim here")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--concurrency", type=int, default=32, help="guidellm's streams (nominal)")
    parser.add_argument("--requests", default="100,1000", help="N_small,N_large per tool")
    parser.add_argument("--input-len", type=int, default=128, help="prompt length (guidellm: its tokens)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--match-concurrency",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run ours at the concurrency guidellm achieved (else at --concurrency)",
    )
    parser.add_argument(
        "--match-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibrate our prompt to as many server-counted tokens as guidellm's (else --input-len words)",
    )
    parser.add_argument(
        "--time-scale",
        default="0.001",
        help="HEISENHUNT_SIM_TIME_SCALE for the sim (small: the clients, not the sim's clock, set the pace)",
    )
    parser.add_argument(
        "--client-core", type=int, default=0, help="CPU core for the clients (-1: no pinning)"
    )
    parser.add_argument("--server-core", type=int, default=1, help="CPU core for the sim (-1: no pinning)")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    parser.add_argument("--work", type=Path, default=None, help="keep logs and outputs here")
    args = parser.parse_args()
    args.client_core = None if args.client_core < 0 else args.client_core
    server_core = None if args.server_core < 0 else args.server_core
    n_small, n_large = (int(x) for x in args.requests.split(","))

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-vs-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    python = ensure_peer(args.peer_venv)
    tokenizer = work / "tokenizer"
    subprocess.run([str(python), "-c", TOKENIZER_SCRIPT, str(tokenizer)], check=True)

    transport = LocalTransport()
    pgid = None
    runs: dict[tuple[str, int], Run] = {}

    def report(run: Run) -> None:
        server = run.server or {}
        print(
            f"{run.tool:>10} N={run.requests_asked}: {run.requests} ok, {run.errors} err, "
            f"{run.output_tokens} tokens (server counted {server.get('tokens_generated')}), "
            f"C {run.concurrency} -> achieved {run.achieved_concurrency:.1f}, "
            f"prompt {run.prompt_tokens_per_request:.1f} tokens/request (server), "
            f"{run.duration_s:.2f}s measured, {run.wall_s:.2f}s wall, {run.cpu_s:.2f}s CPU",
            flush=True,
        )

    try:
        url = args.url
        if url is None:
            launch = server_launch(free_port(), model_path=args.model, time_scale=args.time_scale)
            argv = pinned(launch.argv, server_core)
            pgid = transport.start_detached(
                argv, launch.env, str(work / "sim.log"), str(work / "sim.pid"), cwd=str(REPO)
            )
            url = launch.url
            print(f"sim: {shlex.join(argv)} (pid {pgid})", flush=True)
        wait_healthy(url, timeout_s=60, name=url)
        # guidellm first: what it reaches sets our concurrency and prompt length
        peer_small = counted(
            url, lambda: run_peer(args, python, tokenizer, url, n_small, work, args.concurrency)
        )
        runs["guidellm", n_small] = peer_small
        report(peer_small)
        ours_c = args.concurrency
        if args.match_concurrency:
            ours_c = max(1, round(peer_small.achieved_concurrency))
        ours_len = args.input_len
        target = peer_small.prompt_tokens_per_request
        if args.match_prompt and target == target:
            ours_len, probes = calibrate_input_len(args, url, work, ours_c, target)
            shown = ", ".join(f"{length} words -> {tokens:.1f}" for length, tokens in probes)
            print(f"prompt calibration (server tokens per request, target {target:.1f}): {shown}")
        elif args.match_prompt:
            print("prompt calibration skipped: the server does not count prompt tokens (not the sim)")
        print(f"ours: concurrency {ours_c}, prompt {ours_len} words", flush=True)
        for n in (n_small, n_large):
            run = counted(url, lambda n=n: run_ours(args, url, n, work, ours_c, ours_len))
            runs["heisenhunt", n] = run
            report(run)
        peer_large = counted(
            url, lambda: run_peer(args, python, tokenizer, url, n_large, work, args.concurrency)
        )
        runs["guidellm", n_large] = peer_large
        report(peer_large)
    finally:
        if pgid is not None:
            transport.stop_group(pgid)

    ours = figures(runs["heisenhunt", n_small], runs["heisenhunt", n_large])
    peer = figures(runs["guidellm", n_small], runs["guidellm", n_large])
    rows = [
        ("concurrency asked", runs["heisenhunt", n_large].concurrency, runs["guidellm", n_large].concurrency),
        ("achieved concurrency", ours.achieved_concurrency, peer.achieved_concurrency),
        (
            "prompt tokens per request (server)",
            ours.prompt_tokens_per_request,
            peer.prompt_tokens_per_request,
        ),
        ("output tokens per request (tool)", ours.tokens_per_request, peer.tokens_per_request),
        (
            "output tokens per request (server)",
            ours.server_output_tokens_per_request,
            peer.server_output_tokens_per_request,
        ),
        ("CPU per request (ms)", ours.cpu_per_request_ms, peer.cpu_per_request_ms),
        ("max request/s on one core", ours.max_req_s_per_core, peer.max_req_s_per_core),
        ("max output tok/s on one core", ours.max_tok_s_per_core, peer.max_tok_s_per_core),
        ("measured request/s", ours.req_s, peer.req_s),
        ("measured output tok/s", ours.tok_s, peer.tok_s),
    ]
    print()
    print(
        f"guidellm C={args.concurrency} (streams), ours C={runs['heisenhunt', n_large].concurrency}, "
        f"output {args.output_len}, N={n_small}->{n_large}, client core {args.client_core}, "
        f"server core {server_core}, url {url}"
    )
    print(f"{'':36} {'heisenhunt':>12} {'guidellm':>12} {'ours/peer':>10}")
    for name, a, b in rows:
        print(f"{name:36} {a:>12.2f} {b:>12.2f} {ratio(a, b):>10.2f}")
    print(f"(logs and outputs in {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
