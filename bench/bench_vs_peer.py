"""Side-by-side client benchmark: heisenhunt's bench client vs a peer load generator (guidellm).

Both clients hit the same local endpoint (the simulated SGLang server, started here, or `--url`), at
the same concurrency, with the same request shape (prompt ~input_len tokens, output_len tokens,
streaming chat completions), one after the other in one run. Each runs as its own process pinned to
one CPU core (`taskset`), the server pinned to another, so what is measured is what one core of
client can do.

Per tool and run it records the wall time, the requests and output tokens the tool itself counted,
and the CPU time of the tool's whole process tree (`os.wait4` rusage of the child, which includes its
reaped worker processes: guidellm runs its workers as subprocesses). Start-up costs (imports, torch and
the tokenizer for guidellm, building prompts) are not what a load generator spends per request, so
every tool is run at two request counts and the figures are the *marginal* ones:

    CPU per request       = (cpu(N_large) - cpu(N_small)) / (N_large - N_small)
    max request/s per core = 1 / CPU per request        (what one core of client could sustain)
    max tok/s per core     = output tokens per request / CPU per request
    measured req/s, tok/s  = the tool's own count / its own measured duration, at N_large

and prints ours/peer ratios (> 1: ours is better, except CPU per request where < 1 is better).

guidellm is installed from PyPI into its own virtualenv (it pins torch, transformers, datasets),
never into the project's. It needs a tokenizer to size its synthetic prompts; no model hub can be
reached here, so a word-level tokenizer over faker's English word list (the words guidellm's
synthetic text is made of) is built locally with `tokenizers` and saved as a Hugging Face tokenizer
directory, loaded with HF_HUB_OFFLINE=1.

    python bench/bench_vs_peer.py                      # sim at 1/1000 time, C=32, 100 then 1000 requests
    python bench/bench_vs_peer.py --concurrency 8 --requests 100,300 --output-len 256
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout; the package is normally installed

from orchestrator.remote.local import LocalTransport  # noqa: E402
from orchestrator.sim.launch import server_launch, wait_healthy  # noqa: E402

DEFAULT_PEER_VENV = Path(tempfile.gettempdir()) / "heisenhunt-peer-guidellm"

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
    """The peer's python: guidellm installed with pip into `venv` (created when missing)."""
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([str(python), "-c", "import guidellm"], capture_output=True).returncode == 0
    ):
        return python
    print(f"installing guidellm into {venv} (pulls torch; several minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "guidellm"], check=True)
    return python


def server_tokens(url: str) -> int | None:
    """The sim's own count of generated tokens (GET /server_info); None for another server."""
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=5) as resp:
            info = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    tokens = (info.get("sim") or {}).get("counters", {}).get("tokens_generated")
    return tokens if isinstance(tokens, int) else None


def run_ours(args: argparse.Namespace, url: str, n: int, work: Path) -> Run:
    out = work / f"ours-{n}"
    argv = [
        sys.executable,
        "-m",
        "orchestrator.workload.bench",
        "--url",
        url,
        "--concurrency",
        str(args.concurrency),
        "--requests",
        str(n),
        "--input-len",
        str(args.input_len),
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
    wall, cpu = run_measured(argv, dict(os.environ), work / f"ours-{n}.log", args.client_core)
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
    )


def run_peer(args: argparse.Namespace, python: Path, tokenizer: Path, url: str, n: int, work: Path) -> Run:
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
            "profile": {"kind": "concurrent", "streams": args.concurrency},
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
    )


@dataclass
class Figures:
    cpu_per_request_ms: float
    max_req_s_per_core: float
    max_tok_s_per_core: float
    req_s: float
    tok_s: float
    tokens_per_request: float


def figures(small: Run, large: Run) -> Figures:
    cpu_per_request = (large.cpu_s - small.cpu_s) / max(1, large.requests - small.requests)
    tokens_per_request = large.output_tokens / max(1, large.requests)
    return Figures(
        cpu_per_request_ms=cpu_per_request * 1e3,
        max_req_s_per_core=1.0 / cpu_per_request if cpu_per_request > 0 else float("inf"),
        max_tok_s_per_core=tokens_per_request / cpu_per_request if cpu_per_request > 0 else float("inf"),
        req_s=large.requests / large.duration_s,
        tok_s=large.output_tokens / large.duration_s,
        tokens_per_request=tokens_per_request,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="an existing endpoint; default: start the sim here")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", default="100,1000", help="N_small,N_large per tool")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
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
        runs: dict[tuple[str, int], Run] = {}
        sim_counts: dict[tuple[str, int], int | None] = {}
        # interleaved, so drift of the shared machine hits both tools alike
        for n in (n_small, n_large):
            for tool in ("heisenhunt", "guidellm"):
                before = server_tokens(url)
                run = (
                    run_ours(args, url, n, work)
                    if tool == "heisenhunt"
                    else run_peer(args, python, tokenizer, url, n, work)
                )
                after = server_tokens(url)
                runs[tool, n] = run
                sim_counts[tool, n] = after - before if before is not None and after is not None else None
                print(
                    f"{tool:>10} N={n}: {run.requests} ok, {run.errors} err, {run.output_tokens} tokens "
                    f"(server counted {sim_counts[tool, n]}), {run.duration_s:.2f}s measured, "
                    f"{run.wall_s:.2f}s wall, {run.cpu_s:.2f}s CPU",
                    flush=True,
                )
    finally:
        if pgid is not None:
            transport.stop_group(pgid)

    ours = figures(runs["heisenhunt", n_small], runs["heisenhunt", n_large])
    peer = figures(runs["guidellm", n_small], runs["guidellm", n_large])
    rows = [
        ("CPU per request (ms)", ours.cpu_per_request_ms, peer.cpu_per_request_ms),
        ("max request/s on one core", ours.max_req_s_per_core, peer.max_req_s_per_core),
        ("max output tok/s on one core", ours.max_tok_s_per_core, peer.max_tok_s_per_core),
        ("measured request/s", ours.req_s, peer.req_s),
        ("measured output tok/s", ours.tok_s, peer.tok_s),
        ("output tokens per request", ours.tokens_per_request, peer.tokens_per_request),
    ]
    print()
    print(
        f"C={args.concurrency}, input ~{args.input_len}, output {args.output_len}, N={n_small}->{n_large}, "
        f"client core {args.client_core}, server core {server_core}, url {url}"
    )
    print(f"{'':32} {'heisenhunt':>12} {'guidellm':>12} {'ours/peer':>10}")
    for name, a, b in rows:
        print(f"{name:32} {a:>12.2f} {b:>12.2f} {a / b:>10.2f}")
    print(f"(logs and outputs in {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
