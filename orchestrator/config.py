"""Config schemas (registered in Hydra's ConfigStore) and the validation that runs before any restart.

The YAML under conf/ fills these; Hydra checks types and misspelled keys against them when it composes.
What a schema cannot say (env names, flag spelling, hypotheses that name real factors and levels) is
checked by `validate`, which returns every problem at once, each naming the key and what is accepted.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

# conf/ ships inside the package (a symlink in the repo, real files in a wheel)
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
ROLES = ("prefill", "decode", "router")
SERVER_ROLES = ("prefill", "decode")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
FLAG_NAME = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Flag values reach a remote shell quoted, but a metacharacter in a value is almost always a mistake
# (a pasted shell fragment), so it is refused rather than passed along literally.
SHELL_META = re.compile(r"[;&|`$<>\\\n\r\"'*?(){}\[\]!#~]")
TRANSPORTS = ("local", "ssh")
HOST_KEY_POLICIES = ("reject", "accept-new")
TESTS = ("fisher", "boschloo")
DESIGNS = ("ofat", "factorial")


class ConfigError(CompactHydraException, ValueError):
    """Bad configuration, found before anything was started. Holds every problem found.
    (A CompactHydraException: Hydra prints the message alone, without a stack trace.)"""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass
class SSHConf:
    # login user; default: from ~/.ssh/config, else the local user
    user: str | None = None
    # default: from ~/.ssh/config, else 22
    port: int | None = None
    # private key; default: from ~/.ssh/config, else the agent and ~/.ssh/id_*
    key_file: str | None = None
    # bastion as in ssh -J (user@host:port); default: ProxyJump from ~/.ssh/config
    proxy_jump: str | None = None
    config_file: str = "~/.ssh/config"
    known_hosts: str = "~/.ssh/known_hosts"
    # reject: unknown or changed host keys are refused. accept-new: trust a host seen for the first time.
    host_key_policy: str = "reject"
    connect_timeout_s: float = 10.0
    keepalive_s: float = 15.0


@dataclass
class HostConf:
    # local: this machine through `sh -c`; ssh: over paramiko
    transport: str = "local"
    # hostname, IP, or an alias from ~/.ssh/config
    address: str = "127.0.0.1"
    # the HTTP port of the role's server (router: the port clients use)
    port: int = MISSING
    # prefill only: the PD bootstrap port decode pulls the hand-off from
    bootstrap_port: int | None = None
    # router only: its Prometheus port (sglang-router's default 29000 clashes when routers share a host)
    metrics_port: int | None = None
    # pid files and logs of the servers this tool starts live here, per study
    work_dir: str = MISSING
    # the address servers bind to on that host (0.0.0.0 to serve other hosts)
    bind: str = "127.0.0.1"
    # the address other hosts (the router, the client) use for this host's servers; default: address
    advertise: str | None = None
    # the interpreter that runs `python -m <module>` on that host
    python: str = "python"
    # the server's source checkout, for provenance (git SHA, dirty state); optional
    server_checkout: str | None = None
    ssh: SSHConf = field(default_factory=SSHConf)


@dataclass
class ClusterHosts:
    prefill: HostConf = MISSING
    decode: HostConf = MISSING
    router: HostConf = MISSING


@dataclass
class ClusterConf:
    name: str = MISSING
    hosts: ClusterHosts = field(default_factory=ClusterHosts)


@dataclass
class RoleLaunch:
    # `python -m <module>`; leave null and set `command` for a launcher script
    module: str | None = None
    # argv prefix used instead of `python -m module`, e.g. ["/opt/serve/launch.sh"]
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    # flag -> value: null for a switch, a scalar for one argument, a list for several
    flags: dict[str, Any] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    # "module:function" returning the argparse parser the host checks flags with before a restart;
    # null: the host's own sglang ServerArgs parser (skipped where the host has no sglang)
    flag_parser: str | None = None
    # `python -m MODULE` run on the host with the role's env before any restart (a site check, a config
    # file check); a non-zero exit refuses the arm with the command's output
    preflight_module: str | None = None


@dataclass
class DeploymentRoles:
    prefill: RoleLaunch = field(default_factory=RoleLaunch)
    decode: RoleLaunch = field(default_factory=RoleLaunch)
    router: RoleLaunch = field(default_factory=RoleLaunch)


@dataclass
class DeploymentConf:
    name: str = MISSING
    model_path: str = MISSING
    # served model name clients send in requests
    served_model: str = MISSING
    roles: DeploymentRoles = field(default_factory=DeploymentRoles)
    # seconds between TERM and KILL when stopping a server's process group
    stop_grace_s: float = 20.0
    # one chat request through the router after the health gate
    warmup: bool = True


@dataclass
class Hypothesis:
    id: str = MISSING
    factor: str = MISSING
    statement: str = MISSING
    # the level in the baseline arm, and the level of the arm that differs only in this factor
    baseline: str = MISSING
    treatment: str = MISSING


@dataclass
class StudyConf:
    name: str = MISSING
    description: str = ""
    # factor -> level of the baseline arm
    baseline: dict[str, str] = field(default_factory=dict)
    hypotheses: list[Hypothesis] = field(default_factory=list)
    alpha: float = 0.05
    test: str = "fisher"
    # the smallest corruption-rate difference worth acting on; "exonerated" needs the CI to exclude it
    min_effect: float = 0.05
    # "implicated" needs the treatment arm's upper confidence bound below this rate
    ceiling: float = 0.03
    # "no regression" needs the lower bound of every tok/s ratio above this fraction of baseline
    throughput_floor: float = 0.95


@dataclass
class StressConf:
    sessions: int = 60
    rounds: int = 4
    # concurrent sessions; null = all sessions at once
    concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 120.0
    # the "lost the plot" detector: a valid call that is not the task's expected call
    check_plan: bool = True


@dataclass
class BenchConf:
    enabled: bool = True
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    # closed loop: this many requests per level (multiplied by the level's concurrency)
    requests_per_worker: int = 4
    input_len: int = 512
    output_len: int = 128
    warmup_requests: int = 2
    timeout_s: float = 120.0


@dataclass
class TrackingConf:
    # any MLflow tracking URI; default: a sqlite file in the working directory
    uri: str = "sqlite:///mlruns.db"
    # where artifacts go for a new experiment (null: MLflow's default next to the store)
    artifact_location: str | None = None


@dataclass
class ReportConf:
    dir: str = "reports"
    plots: bool = True


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(group="cluster", name="schema_cluster", node=ClusterConf)
    cs.store(group="deployment", name="schema_deployment", node=DeploymentConf)
    cs.store(group="workload", name="schema_stress", node=StressConf)
    cs.store(group="bench", name="schema_bench", node=BenchConf)
    cs.store(group="tracking", name="schema_tracking", node=TrackingConf)
    cs.store(name="schema_study", node=StudyConf, package="study")
    cs.store(name="schema_report", node=ReportConf, package="report")


# `${python:}` in a host's `python`: the interpreter running the orchestrator (for local hosts)
OmegaConf.register_new_resolver("python", lambda: sys.executable, replace=True)
register_configs()


# --- validation ------------------------------------------------------------------------------------


def _as_dict(node: Any) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node or {})


def factor_levels(cfg: DictConfig) -> dict[str, str]:
    """The arm's factor levels, {factor: level}, from the selected factor/<name> options."""
    return {name: str(node.level) for name, node in sorted((cfg.get("factor") or {}).items())}


def available_levels(cfg: DictConfig) -> dict[str, list[str]]:
    """Every factor and its levels as shipped in conf/factor (and any searchpath), for messages."""
    from orchestrator.factors import discover_factor_levels

    return discover_factor_levels(list(OmegaConf.select(cfg, "hydra.searchpath", default=None) or []))


def validate_env(where: str, env: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, value in env.items():
        if not ENV_NAME.match(str(name)):
            problems.append(
                f"{where}.env: invalid variable name {name!r}; names must match {ENV_NAME.pattern}"
            )
        if value is None or isinstance(value, (dict, list)):
            problems.append(f"{where}.env.{name}: value must be a string or number, got {value!r}")
    return problems


def validate_flags(where: str, flags: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, value in flags.items():
        if not FLAG_NAME.match(str(name)):
            problems.append(
                f"{where}.flags: invalid flag {name!r}; flags must start with '--' "
                f"and match {FLAG_NAME.pattern}"
            )
        values = value if isinstance(value, (list, tuple, ListConfig)) else [value]
        for v in values:
            if v is None or isinstance(v, bool):
                if isinstance(v, bool):
                    problems.append(
                        f"{where}.flags.{name}: booleans are ambiguous; use null for a switch "
                        f"or remove the flag"
                    )
                continue
            if isinstance(v, (dict, DictConfig)):
                problems.append(f"{where}.flags.{name}: value must be null, a scalar or a list of scalars")
            elif SHELL_META.search(str(v)):
                problems.append(
                    f"{where}.flags.{name}: value {str(v)!r} contains a shell metacharacter; "
                    f"accepted: plain words, numbers, paths, URLs"
                )
    return problems


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem in a composed job config. Pure: touches no host."""
    problems: list[str] = []
    hosts = cfg.cluster.hosts
    for role in ROLES:
        host = hosts[role]
        if host.transport not in TRANSPORTS:
            problems.append(
                f"cluster.hosts.{role}.transport: {host.transport!r} is not one of {list(TRANSPORTS)}"
            )
        if host.transport == "ssh" and host.ssh.host_key_policy not in HOST_KEY_POLICIES:
            problems.append(
                f"cluster.hosts.{role}.ssh.host_key_policy: {host.ssh.host_key_policy!r} is not one "
                f"of {list(HOST_KEY_POLICIES)}"
            )
    if hosts.prefill.bootstrap_port is None:
        problems.append("cluster.hosts.prefill.bootstrap_port: required (the PD bootstrap port)")
    problems += port_clashes(hosts)
    for role in ROLES:
        launch = cfg.deployment.roles[role]
        where = f"deployment.roles.{role}"
        if not launch.module and not launch.command:
            problems.append(f"{where}: set `module` (python -m MODULE) or `command` (an argv list)")
        problems += validate_env(where, _as_dict(launch.env))
        problems += validate_flags(where, _as_dict(launch.flags))

    levels = factor_levels(cfg)
    known = available_levels(cfg)
    for key in cfg:
        # `+factor/<name>=<level>` with no such group is taken by Hydra as a plain key, not a factor
        if "/" in str(key):
            group = str(key).partition("/")[0]
            accepted = sorted(known) if group == "factor" else "an existing config group"
            problems.append(
                f"{key}: unknown config group {key!r} (option {cfg[key]!r}); accepted "
                f"{group} names: {accepted}"
            )
    for name, node in (cfg.get("factor") or {}).items():
        for role, delta in (node.get("roles") or {}).items():
            where = f"factor.{name} (level {node.level}).roles.{role}"
            if role not in ROLES:
                problems.append(f"{where}: unknown role {role!r}; accepted: {list(ROLES)}")
                continue
            problems += validate_env(where, _as_dict(delta.get("env")))
            problems += validate_flags(where, _as_dict(delta.get("flags")))

    problems += validate_study(cfg.study, levels, known)
    if cfg.study.test not in TESTS:
        problems.append(f"study.test: {cfg.study.test!r} is not one of {list(TESTS)}")
    for key in ("alpha", "min_effect", "ceiling", "throughput_floor"):
        value = cfg.study[key]
        if not 0 < float(value) < 1:
            problems.append(f"study.{key}: {value} must be between 0 and 1")
    if cfg.workload.sessions < 1 or cfg.workload.rounds < 1:
        problems.append("workload.sessions and workload.rounds must be >= 1")
    if any(int(c) < 1 for c in cfg.bench.concurrency):
        problems.append(f"bench.concurrency: {list(cfg.bench.concurrency)} must all be >= 1")
    if problems:
        raise ConfigError(problems)


def port_clashes(hosts: DictConfig) -> list[str]:
    """Two servers on one address given one port: the second cannot bind, and health checks of its
    URL would be answered by the first."""
    problems: list[str] = []
    taken: dict[tuple[str, int], str] = {}
    for role in ROLES:
        host = hosts[role]
        for key in ("port", "bootstrap_port", "metrics_port"):
            port = host.get(key)
            if port is None:
                continue
            where = f"cluster.hosts.{role}.{key}"
            other = taken.setdefault((str(host.address), int(port)), where)
            if other != where:
                problems.append(
                    f"{where}: port {port} on {host.address} is also {other}; accepted: a port "
                    f"no other server of the deployment uses on that address"
                )
    return problems


def _yaml_bool(value: Any) -> bool:
    """YAML 1.1 reads unquoted on/off/yes/no as booleans; typed str fields then hold 'True'/'False'."""
    return isinstance(value, bool) or value in ("True", "False")


def validate_study(
    study: DictConfig, selected: Mapping[str, str], known: Mapping[str, list[str]]
) -> list[str]:
    """Problems with the study's baseline and hypotheses against the factors that exist."""
    problems = []
    factors_accepted = sorted(known)
    for factor, level in _as_dict(study.baseline).items():
        if _yaml_bool(level):
            problems.append(
                f"study.baseline.{factor}: YAML read {level!r} as a boolean; quote the level "
                f'(e.g. "on"); accepted: {known.get(factor, [])}'
            )
        elif factor not in known:
            problems.append(f"study.baseline.{factor}: unknown factor; accepted: {factors_accepted}")
        elif str(level) not in known[factor]:
            problems.append(f"study.baseline.{factor}: unknown level {level!r}; accepted: {known[factor]}")
    seen = set()
    for i, hyp in enumerate(study.hypotheses):
        where = f"study.hypotheses[{i}] ({hyp.id})"
        if hyp.id in seen:
            problems.append(f"{where}: duplicate hypothesis id")
        seen.add(hyp.id)
        if hyp.factor not in known:
            problems.append(f"{where}.factor: unknown factor {hyp.factor!r}; accepted: {factors_accepted}")
            continue
        for key in ("baseline", "treatment"):
            level = str(hyp[key])
            if _yaml_bool(hyp[key]):
                problems.append(
                    f"{where}.{key}: YAML read {hyp[key]!r} as a boolean; quote the level "
                    f'(e.g. "off"); accepted: {known[hyp.factor]}'
                )
            elif level not in known[hyp.factor]:
                problems.append(
                    f"{where}.{key}: unknown level {level!r} of factor {hyp.factor}; "
                    f"accepted: {known[hyp.factor]}"
                )
        if str(hyp.baseline) == str(hyp.treatment):
            problems.append(f"{where}: baseline and treatment are the same level {hyp.baseline!r}")
        base = _as_dict(study.baseline).get(hyp.factor)
        if base is not None and str(base) != str(hyp.baseline):
            problems.append(
                f"{where}.baseline: {hyp.baseline!r} differs from study.baseline.{hyp.factor} = {base!r}"
            )
    if not selected:
        problems.append(
            "factor: no factor selected; the primary config's defaults list selects factor/<name>"
        )
    return problems
