"""Preflight checks and provenance, per host, through its Transport (local or SSH).

Before a restart the deployment asks each host: which sglang is installed, which commit (and is it
clean) is the server checkout, how much GPU memory is in use (again after teardown, to show the GPUs
were freed), and do the role's flags parse with *that host's* sglang (flags move between versions:
0.5.23 refuses `--cuda-graph-max-bs` as an ambiguous prefix of `--cuda-graph-max-bs-decode` and
`--cuda-graph-max-bs-prefill`). Hosts without sglang (the simulated ones) or without nvidia-smi are
skipped with a note, never failed.

Each check is one function taking a Transport; the host-side work is a short command built with shlex,
and parsing its output is pure.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.plan import ArmPlan, config_key
from orchestrator.redact import redact_text
from orchestrator.remote.base import Transport, TransportError
from orchestrator.schema import SERVER_ROLES

log = logging.getLogger(__name__)

# ServerArgs.add_cli_args(parser) fills a parser with every `sglang.launch_server` flag
SGLANG_PARSER = "sglang.srt.server_args:ServerArgs.add_cli_args"
_NO_SMI = "__heisenhunt_no_nvidia_smi__"


class PreflightError(RuntimeError):
    """A host failed a preflight check; the message names the host and what to fix."""


class FlagError(PreflightError):
    """A role's flags do not parse with the host's own sglang."""

    def __init__(self, host: str, flag: str | None, reason: str):
        self.host, self.flag, self.reason = host, flag, reason
        super().__init__(f"on {host}: {reason}")


def _run_python(
    t: Transport,
    python: str,
    code: str,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> str:
    result = t.run([python, "-c", code, *args], env=env, timeout=timeout, check=False)
    if result.returncode == 127:
        raise PreflightError(
            f"on {t.host}: python {python!r} not found (set the host's `python` to the "
            f"interpreter path on that host)"
        )
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-1500:]
        raise PreflightError(f"on {t.host}: `{python} -c ...` exited {result.returncode}: {tail}")
    return result.stdout


# --- sglang version ----------------------------------------------------------------------------------

_VERSION = """
import importlib.metadata as m
try:
    print(m.version("sglang"))
except m.PackageNotFoundError:
    print("")
"""


def sglang_version(t: Transport, python: str) -> str | None:
    """The sglang version installed for `python` on the host (package metadata: no torch import),
    or None where sglang is not installed."""
    return _run_python(t, python, _VERSION, timeout=60.0).strip() or None


# --- git provenance ----------------------------------------------------------------------------------


def git_provenance(t: Transport, path: str) -> dict[str, Any]:
    """{"sha": HEAD, "dirty": whether `git status --porcelain` lists anything} of a checkout."""
    try:
        sha = t.run(["git", "-C", path, "rev-parse", "HEAD"], timeout=30.0).stdout.strip()
        status = t.run(["git", "-C", path, "status", "--porcelain"], timeout=60.0).stdout
    except TransportError as e:
        raise PreflightError(
            f"on {t.host}: cannot read the git state of server checkout {path!r}: {e}"
        ) from e
    return {"sha": sha, "dirty": bool(status.strip())}


# --- GPU memory --------------------------------------------------------------------------------------


def parse_gpu_memory(text: str) -> list[int]:
    """MiB used per GPU from `nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits`."""
    values = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            values.append(int(float(line.split(",")[0].replace("MiB", "").strip())))
        except ValueError as e:
            raise PreflightError(f"unexpected nvidia-smi output line {line!r}") from e
    return values


def gpu_memory_used(t: Transport, nvidia_smi: str = "nvidia-smi") -> list[int] | None:
    """MiB of memory used on each GPU of the host, or None where there is no nvidia-smi."""
    smi = shlex.quote(nvidia_smi)
    line = (
        f"command -v {smi} >/dev/null 2>&1 || {{ echo {_NO_SMI}; exit 0; }}; "
        f"{smi} --query-gpu=memory.used --format=csv,noheader,nounits"
    )
    result = t.run_shell(line, timeout=60.0)
    if result.stdout.strip() == _NO_SMI:
        log.info("%s: no nvidia-smi, GPU memory not checked", t.host)
        return None
    if result.returncode != 0:
        raise PreflightError(
            f"on {t.host}: nvidia-smi failed ({result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-500:]}"
        )
    return parse_gpu_memory(result.stdout)


# --- flag validation against the host's sglang ----------------------------------------------------------


def split_launch(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(module, server flags) of a launch argv: `python -m MODULE flags...`, `launcher flags...`, or
    bare flags. The flags start at the first `-`-prefixed word after the program."""
    words = list(argv)
    if len(words) >= 3 and words[1] == "-m":
        return words[2], words[3:]
    for i, word in enumerate(words):
        if word.startswith("-"):
            return None, words[i:]
    return None, []


# Runs on the host with its own python. argv: parser target ("module:attr.path"), then the flags.
# The target either fills a parser it is given (sglang's add_cli_args) or builds and returns one.
_VALIDATE = r"""
import argparse, importlib, inspect, json, sys
target, flags = sys.argv[1], sys.argv[2:]
module_name, _, attr = target.partition(":")
try:
    obj = importlib.import_module(module_name)
except ModuleNotFoundError as e:
    top = module_name.split(".")[0]
    if e.name in (top, module_name) or module_name.startswith(f"{e.name}."):
        print(json.dumps({"status": "absent", "detail": str(e)}))
        sys.exit(0)
    raise
for part in attr.split("."):
    obj = getattr(obj, part)
try:
    takes_parser = len(inspect.signature(obj).parameters) > 0
except (TypeError, ValueError):
    takes_parser = True
if takes_parser:
    parser = argparse.ArgumentParser(prog="sglang")
    obj(parser)
else:
    parser = obj()

class Refused(Exception):
    pass

def refuse(message):
    raise Refused(message)

parser.error = refuse  # argparse reports through error(); exit would lose the message
try:
    parser.parse_args(flags)
except Refused as e:
    print(json.dumps({"status": "refused", "detail": str(e)}))
    sys.exit(0)
known = parser._option_string_actions
# argparse silently takes a unique prefix for the full flag: a renamed flag would slip through
abbreviated = {}
for word in flags:
    name = word.split("=", 1)[0]
    if name.startswith("--") and name != "--" and name not in known:
        abbreviated[name] = sorted(o for o in known if o.startswith(name))
print(json.dumps({"status": "ok", "abbreviated": abbreviated}))
"""


def flag_error_from_argparse(host: str, message: str) -> FlagError:
    """A FlagError naming the offending flag, from an argparse error message (pure)."""
    if message.startswith("ambiguous option:"):
        # "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-..."
        body = message.split(":", 1)[1].strip()
        flag, _, matches = body.partition(" could match ")
        flag = flag.split("=", 1)[0]
        return FlagError(
            host,
            flag,
            f"sglang refuses {flag}: ambiguous, it could be {matches}. "
            f"The flag was probably renamed in this sglang version; spell one of "
            f"them in full",
        )
    if message.startswith("unrecognized arguments:"):
        words = message.split(":", 1)[1].split()
        flag = next((w for w in words if w.startswith("-")), words[0] if words else None)
        return FlagError(host, flag, f"sglang does not know {' '.join(words)} (unknown flag or stray value)")
    flag = None
    if message.startswith("argument "):
        # "argument --kv-cache-dtype: invalid choice: ..."
        flag = message[len("argument ") :].split(":", 1)[0].split("/")[0].strip()
    return FlagError(host, flag, f"sglang refuses the flags: {message}")


def validate_sglang_flags(
    t: Transport,
    python: str,
    argv: Sequence[str],
    parser: str = SGLANG_PARSER,
    env: Mapping[str, str] | None = None,
) -> None:
    """Parse a server role's flags with the host's own sglang argument parser, through its python.

    `argv` is the launch command (`python -m sglang.launch_server ...`) or its flags. Raises FlagError
    on an unknown, ambiguous, abbreviated or invalid flag. Skipped with a logged note where the host
    has no sglang, or where the command is not an sglang server (the router, the simulated server).
    `parser` ("module:attr") is the parser to use: sglang's by default; `env` (e.g. PYTHONPATH of a
    source checkout) is added for the host's python."""
    module, flags = split_launch(argv)
    if parser == SGLANG_PARSER and module is not None and not module.startswith("sglang."):
        log.info("%s: flags of `%s` not validated: not an sglang server", t.host, module)
        return
    out = _run_python(t, python, _VALIDATE, [parser, *flags], env=env)
    try:
        verdict = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise PreflightError(f"on {t.host}: flag validation printed no verdict: {out[-500:]!r}") from e
    if verdict["status"] == "absent":
        log.info(
            "%s: sglang is not installed for %s; flags not validated (%s)", t.host, python, verdict["detail"]
        )
        return
    if verdict["status"] == "refused":
        raise flag_error_from_argparse(t.host, verdict["detail"])
    for flag, matches in verdict["abbreviated"].items():
        raise FlagError(
            t.host,
            flag,
            f"{flag} is not a full sglang flag; argparse would take it as "
            f"{' or '.join(matches)}. Spell the flag in full",
        )


# --- all of it, per host -----------------------------------------------------------------------------


@dataclass(frozen=True)
class HostProvenance:
    """What ran where: recorded with the arm (as MLflow params via `as_params`)."""

    host: str
    hostname: str
    python_version: str
    sglang_version: str | None
    checkout_sha: str | None = None
    checkout_dirty: bool | None = None
    gpu_memory_used_mib: tuple[int, ...] | None = None

    def as_params(self, prefix: str) -> dict[str, str]:
        return {
            f"{prefix}.{k}": ("" if v is None else str(list(v) if isinstance(v, tuple) else v))
            for k, v in asdict(self).items()
        }


# hostname, python version, then the sglang version: one interpreter start for the three
_IDENTITY = (
    "import platform, socket; print(socket.gethostname()); print(platform.python_version())\n" + _VERSION
)


def host_provenance(
    t: Transport, python: str, server_checkout: str | None = None, nvidia_smi: str = "nvidia-smi"
) -> HostProvenance:
    """Hostname, python and sglang versions, checkout SHA and dirty state, GPU memory in use."""
    hostname, python_version, *version = _run_python(t, python, _IDENTITY, timeout=60.0).splitlines()
    git = git_provenance(t, server_checkout) if server_checkout else {"sha": None, "dirty": None}
    gpus = gpu_memory_used(t, nvidia_smi)
    return HostProvenance(
        host=t.host,
        hostname=hostname,
        python_version=python_version,
        sglang_version="".join(version).strip() or None,
        checkout_sha=git["sha"],
        checkout_dirty=git["dirty"],
        gpu_memory_used_mib=tuple(gpus) if gpus is not None else None,
    )


# --- the arm, checked on its hosts before any restart -----------------------------------------------------


def check_arm_on_hosts(plan: ArmPlan, transports: Mapping[str, Transport]) -> None:
    """Each server host checks the arm's flags with its own parser (the host's sglang, or the
    deployment's `flag_parser`) and runs the deployment's `preflight_module` with the role's env.
    Raises PreflightError naming the role, what was refused and the config key that set it; touches no
    running server."""
    for role in SERVER_ROLES:
        role_plan = plan.roles[role]
        t, python = transports[role], role_plan.host.python
        kwargs = {"parser": role_plan.flag_parser} if role_plan.flag_parser else {}
        try:
            validate_sglang_flags(t, python, role_plan.argv, env=role_plan.env, **kwargs)
        except FlagError as e:
            origin = role_plan.origin_of("flag", e.flag) if e.flag else None
            where = config_key(origin, role, "flags") if origin else None
            raise PreflightError(f"{role}: {e}" + (f" (set by {where})" if where else "")) from e
        module = role_plan.preflight_module
        if module:
            check = t.run([python, "-m", module], env=role_plan.env, timeout=120.0, check=False)
            if check.returncode != 0:
                output = redact_text((check.stderr or check.stdout).strip(), role_plan.secrets)
                raise PreflightError(
                    f"{role}: `python -m {module}` on {t.host} refused the arm "
                    f"(exit {check.returncode}): {output[-3000:]}"
                )


def check_sweep_on_hosts(planned: Sequence[tuple[str, ArmPlan]]) -> list[tuple[str, str]]:
    """Every distinct arm of a sweep checked by its server hosts (flags, preflight module) before the
    first job starts. `planned`: (job description, plan) pairs; returns (problem, job description)."""
    from orchestrator.remote import close_all, make_transports

    problems: list[tuple[str, str]] = []
    by_hosts: dict[str, list[tuple[str, ArmPlan]]] = {}
    for job, plan in planned:
        key = repr([plan.roles[role].host for role in SERVER_ROLES])
        by_hosts.setdefault(key, []).append((job, plan))
    for jobs in by_hosts.values():
        first = jobs[0][1]
        try:
            transports = make_transports({role: first.roles[role].host for role in SERVER_ROLES})
        except TransportError as e:
            problems.append((f"cluster of {first.roles['decode'].host.address}: {e}", ""))
            continue
        try:
            seen = set()
            for job, plan in jobs:
                if plan.signature in seen:
                    continue
                seen.add(plan.signature)
                try:
                    check_arm_on_hosts(plan, transports)
                except (PreflightError, TransportError) as e:
                    problems.append((str(e), job))
        finally:
            close_all(transports)
    return problems
