"""Preflight checks and provenance, per host, through its Transport (local or SSH).

Before anything is restarted, each server host says what *its* engine makes of the arm, through one
start of its own python (orchestrator/run/engine_probe.py), for every arm of a sweep at once:
- every flag through the installed parser (sglang's `ServerArgs`, or a deployment's `flag_parser`): an
  unknown, ambiguous (0.5.23 refuses `--cuda-graph-max-bs`), abbreviated or invalid flag, or an unknown
  tool-call or reasoning parser name, is refused naming the flag and the config key that set it;
- every engine env var (`SGLANG_*`, `SGL_*`) the deployment, a factor level or a ddmin difference sets:
  read by the installed build? Its env registry (`sglang.srt.environ`), then its source. SGLang never
  warns about a variable it does not read, so a misspelled or removed name would make an arm identical to
  the baseline and exonerate its hypothesis silently; it is refused, naming the variable, the level and
  file that set it, the host, the version and the nearest names the build reads;
- the PD transfer backend's module imports (sglang imports it only minutes into a start);
- the engine version is one the deployment says it is written for (`deployment.sglang_version`).
Hosts without sglang (the simulated ones, whose deployments name their own parser and env registry) or
without nvidia-smi are skipped with a note. The probe also says what each flag a factor set means in the
engine's namespace (dest and value); after start-up, `confirm_server_args` compares that with the running
server's own `/server_info`.

Then provenance: which sglang, which commit (and is it clean) is the server checkout, how much GPU memory
is in use (again after teardown, to show the GPUs were freed). Host-side work is a short command built
with shlex; judging its output is pure.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from packaging.specifiers import SpecifierSet

from orchestrator.config.plan import ArmPlan, RolePlan, config_key
from orchestrator.config.redact import redact_text
from orchestrator.config.schema import SERVER_ROLES
from orchestrator.remote.base import CommandResult, Transport, TransportError
from orchestrator.run import engine_probe
from orchestrator.run.gpus import run_smi

log = logging.getLogger(__name__)

# ServerArgs.add_cli_args(parser) fills a parser with every `sglang.launch_server` flag
SGLANG_PARSER = "sglang.srt.server_args:ServerArgs.add_cli_args"


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
    result = run_smi(t, "--query-gpu=memory.used --format=csv,noheader,nounits", nvidia_smi)
    if result is None:
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


# --- the engine's own view of an arm, from one probe per host ----------------------------------------------

# the env names an engine owns: a name of these that the host's engine does not read is refused
ENGINE_ENV_PREFIXES = ("SGLANG_", "SGL_")
_PROBE_SOURCE = inspect.getsource(engine_probe)


def engine_env_names(env: Mapping[str, str]) -> list[str]:
    """The names in `env` that the engine owns (its registry decides whether each is read)."""
    return sorted(name for name in env if name.startswith(ENGINE_ENV_PREFIXES))


def run_probe(
    t: Transport,
    python: str,
    request: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """The engine probe's answer (orchestrator/run/engine_probe.py) from the host's `python`, with `env`."""
    out = _run_python(t, python, _PROBE_SOURCE, [json.dumps(request)], env=env, timeout=timeout)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise PreflightError(f"on {t.host}: the engine probe printed no answer: {out[-500:]!r}") from e


def checks_flags(argv: Sequence[str], parser: str) -> bool:
    """False where the flags are not an sglang server's (the router, another engine) and no parser of
    its own is named: they are then not validated."""
    module, _ = split_launch(argv)
    return parser != SGLANG_PARSER or module is None or module.startswith("sglang.")


def _probe_env(env: Mapping[str, str]) -> dict[str, str]:
    """The role's env without the engine's variables: what the probe's interpreter needs (PYTHONPATH of
    a source checkout, library paths). The engine's names are judged, not applied."""
    return {name: value for name, value in env.items() if not name.startswith(ENGINE_ENV_PREFIXES)}


@dataclass(frozen=True)
class RoleJudgement:
    """What the host's engine makes of one role of one arm: refusals, notes, and the value each flag a
    factor set takes in the engine's own namespace ({flag: (dest, value)}), to be confirmed after start."""

    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    expected: dict[str, tuple[str, Any]] = field(default_factory=dict)
    # the host as the probe's interpreter saw it (None: no probe ran for this role)
    identity: HostIdentity | None = None


@dataclass(frozen=True)
class HostIdentity:
    """Which host, python and sglang a role runs on: from the engine probe's answer where one ran (the
    same interpreter start), else from `host_provenance`'s own."""

    hostname: str
    python_version: str
    sglang_version: str | None
    # the machine under the engine, where the host has them (engine_probe.identity)
    torch_version: str | None = None
    cuda_version: str | None = None
    gpu: str | None = None
    driver_version: str | None = None

    @classmethod
    def from_probe(cls, answer: Mapping[str, Any]) -> HostIdentity | None:
        """None for an answer that does not say (a probe that could not tell)."""
        if "hostname" not in answer:
            return None
        return cls(
            str(answer["hostname"]),
            str(answer["python"]),
            answer.get("sglang") or None,
            *(answer.get(key) or None for key in ("torch", "cuda", "gpu", "driver")),
        )


def _set_by(plan: ArmPlan, role: str, kind: str, name: str) -> str:
    """ "set by factor.index_k (level bf16).roles.decode.env (conf/factor/index_k/bf16.yaml)" """
    origin = plan.roles[role].origin_of(kind, name)
    if not origin:
        return ""
    key = config_key(origin, role, "env" if kind == "env" else "flags")
    source = plan.sources.get(origin)
    return f"set by {key}" + (f" in {source}" if source else "")


def _is_factor(origin: str | None) -> bool:
    return bool(origin) and not origin.startswith(("deployment", "cluster"))


def judge_role(
    plan: ArmPlan, role: str, host: str, python: str, answer: Mapping[str, Any], verdict: Mapping[str, Any]
) -> RoleJudgement:
    """The probe's answer about one role (its flags' `verdict`, the host's env and backend verdicts)
    turned into refusals that name the setting, where it was set and what is accepted. Pure."""
    version = answer.get("sglang")
    engine = f"sglang {version}" if version else "the engine"
    where = f"{role} on {host} ({engine} for {python})"
    problems: list[str] = []
    notes: list[str] = []
    spec = plan.sglang_version
    if spec and answer.get("parser") == "absent":
        problems.append(
            f"{where}: deployment {plan.deployment} is written for sglang{spec} (deployment.sglang_version), "
            f"but {python} has no sglang ({answer.get('parser_detail')}); set cluster.hosts.{role}.python "
            f"to the interpreter of that host's sglang"
        )
    if spec and version and not SpecifierSet(spec).contains(version, prereleases=True):
        problems.append(
            f"{where}: deployment {plan.deployment} is written for sglang{spec} (deployment.sglang_version), "
            f"not {version}: its flags and env vars were checked against that version only. Install it "
            f"there, or use a deployment written for {version}"
        )
    if answer.get("parser") == "absent":
        return RoleJudgement(tuple(problems), (f"{where}: no sglang; flags and env not checked",))
    if verdict.get("status") == "refused":
        error = flag_error_from_argparse(host, str(verdict.get("detail", "")))
        set_by = _set_by(plan, role, "flag", error.flag) if error.flag else ""
        problems.append(f"{role}: {error}" + (f" ({set_by})" if set_by else ""))
    for word, matches in (verdict.get("abbreviated") or {}).items():
        set_by = _set_by(plan, role, "flag", word)
        problems.append(
            f"{role}: on {host}: {word} is not a full flag; argparse would take it as "
            f"{' or '.join(matches) or 'nothing'}. Spell the flag in full"
            + (f" ({set_by})" if set_by else "")
        )
    for flag in verdict.get("deprecated") or ():
        notes.append(f"{where}: {flag} is deprecated ({_set_by(plan, role, 'flag', flag)})")
    env_verdicts = answer.get("env") or {}
    for name in engine_env_names(plan.roles[role].env):
        found = env_verdicts.get(name)
        if found is None or found.get("read_in"):
            continue
        nearest = ", ".join(found.get("nearest") or ()) or "none close"
        read_by = plan.env_read_by.get(name)
        problems.append(
            f"{where}: {name} is read nowhere in this build (searched {answer.get('env_scanned')}); "
            f"{_set_by(plan, role, 'env', name)}. Set, it changes nothing: this arm would run as if the "
            f"setting were absent, and its hypothesis would be wrongly exonerated. Nearest names this "
            f"build reads: {nearest}."
            + (
                f" Read by: {read_by}"
                if read_by
                else " Fix the name, or point the role's python at a build that reads it"
            )
        )
    parsed = verdict.get("parsed") or {}
    backend_flag = "--disaggregation-transfer-backend"
    for name, found in (answer.get("backends") or {}).items():
        if not found.get("error"):
            continue
        chosen = parsed.get(backend_flag, ("", None))[1]
        if chosen not in (name, None) or (chosen is None and name != "mooncake"):
            continue
        set_by = _set_by(plan, role, "flag", backend_flag) if chosen else "sglang's default"
        problems.append(
            f"{where}: transfer backend {name} ({backend_flag}, {set_by}) cannot start: "
            f"`import {found['module']}` fails ({found['error']}). sglang imports it only when the KV "
            f"manager starts, minutes into a start. Install it on that host, or choose a backend that "
            f"imports"
        )
    expected = {
        flag: (str(dest), value)
        for flag, (dest, value) in parsed.items()
        if _is_factor(plan.roles[role].origin_of("flag", flag))
    }
    return RoleJudgement(tuple(problems), tuple(notes), expected)


def probe_request(plans_roles: Sequence[tuple[ArmPlan, str]]) -> dict[str, Any]:
    """One probe's request for several (arm, role) pairs that share a host, python and parser."""
    first = plans_roles[0][0].roles[plans_roles[0][1]]
    parser = first.flag_parser or SGLANG_PARSER
    names = sorted({n for plan, role in plans_roles for n in engine_env_names(plan.roles[role].env)})
    return {
        "parser": parser,
        "registry": first.env_registry,
        "argvs": [split_launch(plan.roles[role].argv)[1] for plan, role in plans_roles],
        "env": names,
        "backends": parser == SGLANG_PARSER,
    }


def _probe_key(t: Transport, rp: RolePlan) -> tuple:
    return (id(t), rp.host.python, rp.flag_parser, rp.env_registry, tuple(sorted(_probe_env(rp.env).items())))


def judge_on_hosts(
    items: Sequence[tuple[ArmPlan, str]], transports: Mapping[str, Transport]
) -> list[RoleJudgement]:
    """Each (arm, role) judged by its host's engine: one probe per host, python, parser and env, whatever
    the number of arms. The preflight module (a deployment's own site check) runs per arm and role."""
    judgements: list[RoleJudgement | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for i, (plan, role) in enumerate(items):
        rp = plan.roles[role]
        parser = rp.flag_parser or SGLANG_PARSER
        if not checks_flags(rp.argv, parser):
            module = split_launch(rp.argv)[0]
            judgements[i] = RoleJudgement(notes=(f"{role}: `{module}` is not an sglang server: not checked",))
            continue
        groups.setdefault(_probe_key(transports[role], rp), []).append(i)
    for indices in groups.values():
        pairs = [items[i] for i in indices]
        plan, role = pairs[0]
        t, rp = transports[role], plan.roles[role]
        answer = run_probe(t, rp.host.python, probe_request(pairs), env=_probe_env(rp.env))
        verdicts = answer.get("argvs") or [{} for _ in indices]
        identity = HostIdentity.from_probe(answer)
        for i, verdict in zip(indices, verdicts, strict=True):
            judged = judge_role(items[i][0], items[i][1], t.host, rp.host.python, answer, verdict)
            judgements[i] = dataclasses.replace(judged, identity=identity)
    return [j or RoleJudgement() for j in judgements]


def validate_sglang_flags(
    t: Transport,
    python: str,
    argv: Sequence[str],
    parser: str = SGLANG_PARSER,
    env: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, Any]]:
    """Parse a server role's flags with the host's own parser (sglang's by default), through its python.

    Raises FlagError on an unknown, ambiguous, abbreviated or invalid flag; returns {flag: (dest, value)}.
    Skipped with a logged note where the host has no sglang, or where the command is not an sglang
    server and no parser of its own is named."""
    if not checks_flags(argv, parser):
        log.info("%s: flags of `%s` not validated: not an sglang server", t.host, split_launch(argv)[0])
        return {}
    answer = run_probe(t, python, {"parser": parser, "argvs": [split_launch(argv)[1]]}, env=env)
    if answer["parser"] == "absent":
        log.info(
            "%s: sglang is not installed for %s; flags not validated (%s)",
            t.host,
            python,
            answer["parser_detail"],
        )
        return {}
    verdict = answer["argvs"][0]
    if verdict["status"] == "refused":
        raise flag_error_from_argparse(t.host, verdict["detail"])
    for flag, matches in verdict["abbreviated"].items():
        raise FlagError(
            t.host,
            flag,
            f"{flag} is not a full sglang flag; argparse would take it as "
            f"{' or '.join(matches)}. Spell the flag in full",
        )
    return {flag: (dest, value) for flag, (dest, value) in verdict["parsed"].items()}


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
    torch_version: str | None = None
    cuda_version: str | None = None
    gpu: str | None = None
    driver_version: str | None = None

    def as_params(self, prefix: str) -> dict[str, str]:
        return {
            f"{prefix}.{k}": ("" if v is None else str(list(v) if isinstance(v, tuple) else v))
            for k, v in asdict(self).items()
        }


def host_identity(t: Transport, python: str) -> HostIdentity:
    """Hostname, python and sglang versions: the engine probe asked only that, in an interpreter start of
    its own (where no probe of the arm ran)."""
    answer = run_probe(t, python, {}, timeout=60.0)  # as long as the identity's own script had
    identity = HostIdentity.from_probe(answer)
    if identity is None:
        raise PreflightError(f"on {t.host}: the engine probe did not say what ran where: {answer!r}"[:600])
    return identity


def host_provenance(
    t: Transport,
    python: str,
    server_checkout: str | None = None,
    nvidia_smi: str = "nvidia-smi",
    identity: HostIdentity | None = None,
) -> HostProvenance:
    """Hostname, python and sglang versions, checkout SHA and dirty state, GPU memory in use. `identity`:
    the host as the arm's engine probe saw it already (else asked here)."""
    identity = identity or host_identity(t, python)
    git = git_provenance(t, server_checkout) if server_checkout else {"sha": None, "dirty": None}
    gpus = gpu_memory_used(t, nvidia_smi)
    return HostProvenance(
        host=t.host,
        hostname=identity.hostname,
        python_version=identity.python_version,
        sglang_version=identity.sglang_version,
        checkout_sha=git["sha"],
        checkout_dirty=git["dirty"],
        gpu_memory_used_mib=tuple(gpus) if gpus is not None else None,
        torch_version=identity.torch_version,
        cuda_version=identity.cuda_version,
        gpu=identity.gpu,
        driver_version=identity.driver_version,
    )


# --- the arm, checked on its hosts before any restart -----------------------------------------------------

# role -> {flag: (dest, value)}: what the factor-set flags must read on the running server
Expected = dict[str, dict[str, tuple[str, Any]]]


def _module_key(plan: ArmPlan, role: str, t: Transport) -> tuple | None:
    """What the deployment's preflight module's answer depends on: the host, its python, the module and
    the role's whole env (a site check may read any of it). None: the role has no module."""
    rp = plan.roles[role]
    if not rp.preflight_module:
        return None
    return (id(t), rp.host.python, rp.preflight_module, tuple(sorted(rp.env.items())))


def _run_module(plan: ArmPlan, role: str, t: Transport) -> CommandResult:
    """`python -m <preflight module>` on the host, with the role's env."""
    rp = plan.roles[role]
    assert rp.preflight_module
    return t.run([rp.host.python, "-m", rp.preflight_module], env=rp.env, timeout=120.0, check=False)


def module_refusals(plan: ArmPlan, role: str, host: str, check: CommandResult) -> list[str]:
    """The module's answer about one role of one arm: its refusal, redacted, or nothing. Pure."""
    if check.returncode == 0:
        return []
    rp = plan.roles[role]
    output = redact_text((check.stderr or check.stdout).strip(), rp.secrets)
    refused = f"{role}: `python -m {rp.preflight_module}` on {host} refused the arm (exit {check.returncode})"
    return [f"{refused}: {output[-3000:]}"]


class ArmsChecked(NamedTuple):
    """`check_arms`' answer: the problems as (arm index, message), and per arm the expected server args
    and each role's host identity (where a probe ran)."""

    problems: list[tuple[int, str]]
    expected: list[Expected]
    identities: list[dict[str, HostIdentity]]


def check_arms(plans: Sequence[ArmPlan], transports: Mapping[str, Transport]) -> ArmsChecked:
    """Every server role of every arm (all on one set of hosts) judged by its host: flags, engine env
    names, transfer backend, engine version, and the deployment's preflight module. Touches no running
    server."""
    items = [(plan, role) for plan in plans for role in SERVER_ROLES]
    judged = judge_on_hosts(items, transports)
    problems: list[tuple[int, str]] = []
    expected: list[Expected] = [{} for _ in plans]
    identities: list[dict[str, HostIdentity]] = [{} for _ in plans]
    # the module runs once per host, python and env: arms whose role env is the same share its answer
    modules: dict[tuple, CommandResult] = {}
    for n, ((plan, role), judgement) in enumerate(zip(items, judged, strict=True)):
        index = n // len(SERVER_ROLES)
        for note in judgement.notes:
            log.info("%s", redact_text(note, plan.secrets))
        found = [redact_text(p, plan.secrets) for p in judgement.problems]
        t = transports[role]
        key = _module_key(plan, role, t)
        if not found and key is not None:
            if key not in modules:
                modules[key] = _run_module(plan, role, t)
            found = module_refusals(plan, role, t.host, modules[key])
        problems += [(index, p) for p in found]
        expected[index][role] = judgement.expected
        if judgement.identity:
            identities[index][role] = judgement.identity
    return ArmsChecked(problems, expected, identities)


def check_arm_on_hosts(
    plan: ArmPlan, transports: Mapping[str, Transport]
) -> tuple[Expected, dict[str, HostIdentity]]:
    """The arm checked by its server hosts (`check_arms`); raises PreflightError with every refusal.
    Returns what each factor-set flag must read on the running server (`confirm_server_args`), and the
    identity of each role's host where its probe told it."""
    checked = check_arms([plan], transports)
    if checked.problems:
        raise PreflightError("; ".join(message for _, message in checked.problems))
    return checked.expected[0], checked.identities[0]


def member_groups(planned: Sequence[tuple[str, ArmPlan]]) -> list[list[tuple[str, ArmPlan]]]:
    """The sweep's (job, plan) pairs grouped by the server hosts they run on (a pool's member each), in
    the order first seen. Pure."""
    groups: dict[str, list[tuple[str, ArmPlan]]] = {}
    for job, plan in planned:
        key = repr([plan.roles[role].host for role in SERVER_ROLES])
        groups.setdefault(key, []).append((job, plan))
    return list(groups.values())


def distinct_arms(jobs: Sequence[tuple[str, ArmPlan]]) -> list[tuple[str, ArmPlan]]:
    """One (job, plan) per arm signature, the first job naming it. Pure."""
    distinct: dict[str, tuple[str, ArmPlan]] = {}
    for job, plan in jobs:
        distinct.setdefault(plan.signature, (job, plan))
    return list(distinct.values())


Connect = Callable[[Mapping[str, Any]], Mapping[str, Transport]]


def check_member(
    jobs: Sequence[tuple[str, ArmPlan]], connect: Connect, close: Callable[[Mapping[str, Transport]], None]
) -> list[tuple[str, str]]:
    """The distinct arms of `jobs` (all on one set of hosts) checked by those hosts: (problem, job)."""
    first = jobs[0][1]
    try:
        transports = connect({role: first.roles[role].host for role in SERVER_ROLES})
    except TransportError as e:
        return [(f"cluster of {first.roles['decode'].host.address}: {e}", "")]
    try:
        arms = distinct_arms(jobs)
        found = check_arms([plan for _, plan in arms], transports).problems
        return [(message, arms[index][0]) for index, message in found]
    except (PreflightError, TransportError) as e:
        return [(str(e), jobs[0][0])]
    finally:
        close(transports)


def check_sweep_on_hosts(
    planned: Sequence[tuple[str, ArmPlan]], connect: Connect | None = None
) -> list[tuple[str, str]]:
    """Every distinct arm of a sweep checked by its server hosts before the first job starts: one probe
    per host and interpreter for all of them, and each set of hosts (a pool's members) checked at once
    with the others, in threads (the checks wait on their hosts' processes, over SSH or locally).
    `planned`: (job description, plan) pairs; returns (problem, job description), in the members' order.
    `connect`: role -> host config to role -> transport (`make_transports`)."""
    from orchestrator.remote import close_all, make_transports

    groups = member_groups(planned)
    if not groups:
        return []
    connect = connect or make_transports
    executor = ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="host-checks")
    try:
        found = list(executor.map(lambda jobs: check_member(jobs, connect, close_all), groups))
    except BaseException:
        # an interrupt does not wait for the other hosts' answers
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown()
    return [problem for problems in found for problem in problems]


# --- after start-up: the running server's own view of its arguments ------------------------------------


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: 2 and 2.0 are, True and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def confirm_server_args(
    plan: ArmPlan, expected: Expected, server_info: Mapping[str, Mapping[str, Any] | None]
) -> tuple[list[str], list[str]]:
    """(refusals, notes): each flag a factor set, against the running server's `/server_info` (role ->
    its JSON, None where it could not be read). A value that differs fails the arm: the server did not
    take the setting, so the arm would not test what it says. A field the server does not report, or
    no /server_info at all, is a note. Pure."""
    problems: list[str] = []
    notes: list[str] = []
    for role, flags in expected.items():
        info = server_info.get(role)
        if not flags:
            continue
        if info is None:
            notes.append(f"{role}: no /server_info; {', '.join(flags)} not confirmed")
            continue
        for flag, (dest, value) in flags.items():
            if dest not in info:
                notes.append(f"{role}: /server_info has no {dest}; {flag} not confirmed")
            elif not _same(value, info[dest]):
                problems.append(
                    f"{role}: the running server has {dest}={info[dest]!r}, but {flag} "
                    f"({_set_by(plan, role, 'flag', flag)}) gives {dest}={value!r}: the server did not take "
                    f"the setting (its argument resolution overrode it), so this arm would not test it"
                )
    return problems, notes
