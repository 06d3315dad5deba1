"""Arm planning (pure): a composed job config -> the exact env and argv of every role, and a signature.

An arm is one assignment of levels to factors. Each selected `factor/<name>/<level>.yaml` adds env vars
and flags to some roles on top of the deployment's. The arm signature hashes the effective env and
flags per role (not hosts or ports), so the same arm run twice, or on another port, pools together.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from orchestrator.config import ROLES, ConfigError

SIGNATURE_LENGTH = 12


@dataclass(frozen=True)
class RolePlan:
    role: str
    env: dict[str, str]
    # effective flags (deployment + factors), in a stable order; host/port flags are not in here
    flags: dict[str, Any]
    # the full command line, host/port flags included
    argv: list[str]
    health_url: str | None = None


@dataclass(frozen=True)
class ArmPlan:
    factors: dict[str, str]
    roles: dict[str, RolePlan]
    signature: str
    router_url: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _plain(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def merge_role_deltas(
    base_env: Mapping[str, Any],
    base_flags: Mapping[str, Any],
    factors: Mapping[str, Mapping[str, Any]],
    role: str,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Deployment env/flags of `role` with every factor's additions for that role.

    A factor may override the deployment's value; two factors setting the same name differently is a
    conflict, since the arm would then depend on the order factors happen to be applied in."""
    env = {k: str(v) for k, v in base_env.items()}
    flags = dict(base_flags)
    set_by: dict[tuple[str, str], tuple[str, Any]] = {}
    problems = []
    for factor_name in sorted(factors):
        delta = (factors[factor_name].get("roles") or {}).get(role) or {}
        for kind, target, convert in (("env", env, str), ("flags", flags, lambda v: v)):
            for name, value in (delta.get(kind) or {}).items():
                key = (kind, name)
                if key in set_by and set_by[key][1] != value:
                    other = set_by[key][0]
                    problems.append(
                        f"factor.{factor_name} and factor.{other} both set {role} {kind} {name} "
                        f"({value!r} vs {set_by[key][1]!r})"
                    )
                set_by[key] = (factor_name, value)
                target[name] = convert(value)
    if problems:
        raise ConfigError(problems)
    return env, flags


def flag_words(flags: Mapping[str, Any]) -> list[str]:
    """argv words for a flags mapping: null -> switch, scalar -> one value, list -> several."""
    words: list[str] = []
    for name, value in flags.items():
        words.append(name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            words.extend(str(v) for v in value)
        else:
            words.append(str(value))
    return words


def signature(roles: Mapping[str, tuple[Mapping[str, str], Mapping[str, Any]]], model_path: str) -> str:
    """A stable short hash of the effective env and flags per role, independent of key order."""
    canonical = {
        "model_path": model_path,
        "roles": {
            role: {"env": dict(sorted(env.items())), "flags": dict(sorted(flags.items()))}
            for role, (env, flags) in sorted(roles.items())
        },
    }
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:SIGNATURE_LENGTH]


def _launch_prefix(launch: DictConfig, python: str) -> list[str]:
    if launch.command:
        return [str(w) for w in launch.command]
    return [python, "-m", str(launch.module)]


def url_host(host: DictConfig) -> str:
    return str(host.advertise or host.address)


def topology_flags(role: str, cfg: DictConfig) -> dict[str, Any]:
    """The flags that place a role on its host and wire PD together (derived from the cluster)."""
    hosts = cfg.cluster.hosts
    prefill_url = f"http://{url_host(hosts.prefill)}:{hosts.prefill.port}"
    decode_url = f"http://{url_host(hosts.decode)}:{hosts.decode.port}"
    if role == "router":
        flags = {
            "--pd-disaggregation": None,
            "--prefill": [prefill_url, str(hosts.prefill.bootstrap_port)],
            "--decode": decode_url,
            "--host": hosts.router.bind,
            "--port": str(hosts.router.port),
        }
        if hosts.router.metrics_port is not None:
            flags["--prometheus-host"] = hosts.router.bind
            flags["--prometheus-port"] = str(hosts.router.metrics_port)
        return flags
    flags: dict[str, Any] = {
        "--model-path": str(cfg.deployment.model_path),
        "--disaggregation-mode": role,
        "--host": hosts[role].bind,
        "--port": str(hosts[role].port),
    }
    if role == "prefill":
        flags["--disaggregation-bootstrap-port"] = str(hosts.prefill.bootstrap_port)
    return flags


def plan_arm(cfg: DictConfig) -> ArmPlan:
    """The arm this job config describes. Pure: reads the config, touches nothing."""
    factors = {name: _plain(node) for name, node in (cfg.get("factor") or {}).items()}
    levels = {name: str(node["level"]) for name, node in sorted(factors.items())}
    effective: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}
    roles: dict[str, RolePlan] = {}
    for role in ROLES:
        launch = cfg.deployment.roles[role]
        env, flags = merge_role_deltas(_plain(launch.env) or {}, _plain(launch.flags) or {}, factors, role)
        effective[role] = (env, flags)
        topology = topology_flags(role, cfg)
        clash = sorted(set(topology) & set(flags))
        if clash:
            raise ConfigError(
                [f"deployment.roles.{role}.flags: {clash} are set from cluster.hosts; remove them"]
            )
        host = cfg.cluster.hosts[role]
        argv = _launch_prefix(launch, str(host.python)) + flag_words(topology) + flag_words(flags)
        health = f"http://{url_host(host)}:{host.port}{launch.health_path}"
        roles[role] = RolePlan(role=role, env=env, flags=flags, argv=argv, health_url=health)
    router = cfg.cluster.hosts.router
    return ArmPlan(
        factors=levels,
        roles=roles,
        signature=signature(effective, str(cfg.deployment.model_path)),
        router_url=f"http://{url_host(router)}:{router.port}",
    )


# --- the factors that exist -------------------------------------------------------------------------


def discover_factor_levels(searchpath: Sequence[str] = ()) -> dict[str, list[str]]:
    """{factor: [levels]} from Hydra's config search path (plus a job's `hydra.searchpath`) when Hydra is
    initialised, else from the shipped conf/factor."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if GlobalHydra.instance().is_initialized():
        loader = GlobalHydra.instance().config_loader()
        # the job's own search path entries (user factor folders) are not in the loader's base path
        overrides = (
            ["hydra.searchpath=[" + ",".join(repr(str(p)) for p in searchpath) + "]"] if searchpath else []
        )
        groups = loader.get_group_options("factor", results_filter=ObjectType.GROUP, overrides=overrides)
        return {
            g: sorted(loader.get_group_options(f"factor/{g}", overrides=overrides)) for g in sorted(groups)
        }
    root = Path(__file__).resolve().parent / "conf" / "factor"
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(root.iterdir()) if d.is_dir()}
