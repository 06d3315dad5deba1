"""Arm planning (pure): a typed job -> the exact launch of every role, where each setting came from, and a
signature. The only code that reads factor levels.

An arm is one assignment of levels to factors. Each selected `factor/<name>/<level>.yaml` adds env vars
and flags to some roles on top of the deployment's; the cluster adds the flags that place each role on
its host and wire PD together. Every env var and flag of a role plan records its origin (`deployment`,
`cluster`, or `factor.<name>=<level>`), so errors and reports can say which file to change.

The arm signature hashes the effective env and flags per role (not hosts or ports), so the same arm run
twice, or on another port, pools together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.redact import is_secret_name, redact_argv
from orchestrator.config.schema import (
    ROLES,
    BenchConf,
    ClusterHosts,
    HostConf,
    JobConf,
    RoleLaunch,
    SelectedLevel,
    StressConf,
)
from orchestrator.workload.detect import counted_families

SIGNATURE_LENGTH = 12
BASELINE_LABEL = "baseline"
DEPLOYMENT = "deployment"
CLUSTER = "cluster"


@dataclass(frozen=True)
class RolePlan:
    """Everything one role of an arm needs to start, be checked, be gated and be reported."""

    role: str
    host: HostConf
    env: dict[str, str]
    # effective flags (deployment + factors), in a stable order; host/port flags are not in here
    flags: dict[str, Any]
    # the full command line, host/port flags included
    argv: list[str]
    health_url: str
    startup_timeout_s: float = 600.0
    flag_parser: str | None = None
    preflight_module: str | None = None
    env_registry: str | None = None
    # "env NAME" / "flag --name" -> deployment | cluster | factor.<name>=<level>
    origin: dict[str, str] = field(default_factory=dict)

    @property
    def secrets(self) -> dict[str, str]:
        """The env vars whose names look like credentials: redacted wherever they could show."""
        return {name: value for name, value in self.env.items() if is_secret_name(name)}

    def origin_of(self, kind: str, name: str) -> str | None:
        """Where `env NAME` or `flag --name` was set (None: not set on this role)."""
        return self.origin.get(f"{kind} {name}")


@dataclass(frozen=True)
class ArmPlan:
    """One arm, ready to run: what is deployed (roles), how it is measured (workload, bench)."""

    factors: dict[str, str]
    roles: dict[str, RolePlan]
    signature: str
    router_url: str = ""
    model_path: str = ""
    served_model: str = ""
    stop_grace_s: float = 20.0
    warmup: bool = True
    # prefill healthy before decode starts (deployment.sequential_start)
    sequential_start: bool = False
    # the free-GPU gate before a start (deployment.gpu_free_timeout_s, gpu_idle_mib: run/gpus.py)
    gpu_free_timeout_s: float = 120.0
    gpu_idle_mib: int = 1024
    workload: StressConf = field(default_factory=StressConf)
    bench: BenchConf = field(default_factory=BenchConf)
    deployment: str = ""
    # the sglang versions the deployment is written for (deployment.sglang_version)
    sglang_version: str | None = None
    # origin ("factor.index_k=bf16") -> the file it came from, for messages
    sources: dict[str, str] = field(default_factory=dict)
    # engine env var -> which builds read it, as the factor level that sets it says (FactorLevel.read_by)
    env_read_by: dict[str, str] = field(default_factory=dict)

    @property
    def secrets(self) -> dict[str, str]:
        return {name: value for role in self.roles.values() for name, value in role.secrets.items()}

    @property
    def conditions(self) -> dict[str, str]:
        return measurement_conditions(self.workload)


def measurement_conditions(workload: StressConf) -> dict[str, str]:
    """What, beside the deployment (the signature), changes what a session measures: the workload's
    shape, and the load the sessions run at (`workload.concurrency`, or every session at once). Its seed
    does not (repetitions use other seeds on purpose), nor does the throughput sweep, nor the number of
    sessions: that is a run's sample size, and the runs of one arm may differ in it (a sequential study
    sizes each start by what its GPU time buys, analysis/cost.py)."""
    answers = workload.prompts is not None
    conditions = {
        "workload.rounds": str(workload.rounds),
        "workload.concurrency": str(run_load(workload.sessions, workload.concurrency)),
        "workload.timeout_s": str(float(workload.timeout_s)),
        "workload.count": ",".join(counted_families(workload.oracle, workload.count, answers)),
        "workload.tool_choice": workload.tool_choice,
    }
    # the oracle and its prompts judge what a session is: arms judged otherwise never pool (the tool-call
    # oracle on the built-in tasks, the default, adds no key: runs logged before oracles existed match)
    if workload.oracle != "tool_calls":
        conditions["workload.oracle"] = workload.oracle
    if workload.prompts is not None:
        conditions["workload.prompts"] = str(workload.prompts)
    if workload.oracle == "divergence":
        conditions["workload.early_tokens"] = str(workload.early_tokens)
        conditions["workload.compare"] = workload.compare
        conditions["workload.max_tokens"] = str(workload.max_tokens)
    if workload.oracle == "reproducer":
        conditions["workload.reproducer"] = reproducer_identity(workload.call, workload.command)
    return conditions


def reproducer_identity(call: Any, command: Sequence[str] | None) -> str:
    """What names a reproducer in an arm's identity: its callable's target, or its argv."""
    if command:
        return shlex.join(redact_argv(command))
    target = call.get("_target_") if isinstance(call, Mapping) else None
    return str(target or call)


def run_load(sessions: int, concurrency: int | None) -> int:
    """The sessions in flight at once: the decode's load, part of what a session measures."""
    return min(int(sessions), int(concurrency or sessions))


def arm_conditions(recorded: Mapping[str, str]) -> dict[str, str]:
    """A run's recorded conditions as today's arm identity reads them. Runs logged before the number of
    sessions left the identity recorded `workload.sessions`, and "None" for every session at once: their
    load is then that number."""
    out = {str(k): str(v) for k, v in recorded.items()}
    sessions = out.pop("workload.sessions", None)
    if sessions is not None and "workload.concurrency" in out:
        concurrency = out["workload.concurrency"]
        out["workload.concurrency"] = str(
            run_load(int(sessions), None if concurrency == "None" else int(concurrency))
        )
    return out


@dataclass(frozen=True)
class RoleMerge:
    """A role's env and flags after the factor levels are applied, with origins and conflicts."""

    env: dict[str, str]
    flags: dict[str, Any]
    origin: dict[str, str]
    problems: list[str]


# a ddmin difference's two levels (config.difference_levels): not applied, applied
GOOD, BAD = "good", "bad"
# a ddmin study's repetitions in blocks: attempt v's checks run repetitions v * DDMIN_ATTEMPT_BLOCK onwards
# (block 0: the good and bad checks and the steering), so no subset may start this many runs in a block
DDMIN_ATTEMPT_BLOCK = 1000


def difference_label(applied: Sequence[str], ids: Sequence[str]) -> str:
    """The ddmin differences an arm applies, short: "+a +b", or "bad" (all of them) and "bad -c" (all
    but a few), whichever is shorter to read."""
    applied_set = set(applied)
    chosen = [d for d in ids if d in applied_set]
    left_out = [d for d in ids if d not in applied_set]
    if chosen and len(left_out) < len(chosen):
        return " ".join(["bad", *(f"-{d}" for d in left_out)])
    return " ".join(f"+{d}" for d in chosen) or GOOD


def arm_label(factors: Mapping[str, str], baseline: Mapping[str, str]) -> str:
    """ "baseline", or the factors that differ from it ("capture=eager,multi_stream=off"); ddmin
    differences (baseline level `good`) as `difference_label` writes them."""
    ids = [k for k, v in sorted(baseline.items()) if v == GOOD]
    applied = [d for d in ids if factors.get(d) == BAD]
    diff = [
        f"{k}={v}"
        for k, v in sorted(factors.items())
        if k in baseline and baseline[k] != v and not (k in ids and v == BAD)
    ]
    if applied:
        diff.append(difference_label(applied, ids))
    return ",".join(diff) if diff else BASELINE_LABEL


DIFFERENCE = "difference"


def factor_origin(selected: SelectedLevel) -> str:
    if selected.overrides:
        return f"{DIFFERENCE}.{selected.factor}"
    return f"factor.{selected.factor}={selected.option}"


def config_key(origin: str, role: str, kind: str) -> str:
    """The config key an origin stands for, as messages name it ("factor.capture (level eager).roles
    .decode.flags", "deployment.roles.decode.env", "cluster.hosts.decode")."""
    if origin.startswith("factor."):
        name, _, level = origin.removeprefix("factor.").partition("=")
        return f"factor.{name} (level {level}).roles.{role}.{kind}"
    if origin.startswith(f"{DIFFERENCE}."):
        return f"study.ddmin.differences ({origin.removeprefix(DIFFERENCE + '.')}).roles.{role}.{kind}"
    if origin == CLUSTER:
        return f"cluster.hosts.{role}"
    return f"deployment.roles.{role}.{kind}"


def merge_role(role: str, launch: RoleLaunch, factors: Mapping[str, SelectedLevel]) -> RoleMerge:
    """The deployment's env/flags of `role` with every factor level's additions for that role.

    A factor may override the deployment's value; two factors setting the same name differently is a
    conflict, since the arm would then depend on the order factors happen to be applied in. A ddmin
    difference (`overrides`) is applied after every factor level and may override theirs too."""
    env = {str(k): str(v) for k, v in launch.env.items()}
    flags = dict(launch.flags)
    origin = {f"env {name}": DEPLOYMENT for name in env} | {f"flag {name}": DEPLOYMENT for name in flags}
    set_by: dict[str, tuple[str, Any, bool]] = {}
    problems = []
    for name in sorted(factors, key=lambda n: (factors[n].overrides, n)):
        over = factors[name].overrides
        delta = getattr(factors[name].value.roles, role)
        for kind, additions, target in (("env", delta.env, env), ("flag", delta.flags, flags)):
            for key, value in additions.items():
                value = str(value) if kind == "env" else value
                where = f"{kind} {key}"
                if where in set_by and set_by[where][1] != value and set_by[where][2] == over:
                    other, first, _ = set_by[where]
                    problems.append(
                        f"factor.{name} and factor.{other} both set {role} "
                        f"{'env' if kind == 'env' else 'flags'} {key} ({value!r} vs {first!r})"
                    )
                set_by[where] = (name, value, over)
                target[key] = value
                origin[where] = factor_origin(factors[name])
    return RoleMerge(env, flags, origin, problems)


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


def server_url(host: HostConf) -> str:
    """The base URL other hosts (the router, the client) reach a role's server at."""
    return f"http://{host.url_host}:{host.port}"


def topology_flags(role: str, hosts: ClusterHosts, model_path: str) -> dict[str, Any]:
    """The flags that place a role on its host and wire PD together (derived from the cluster)."""
    prefill_url, decode_url = server_url(hosts.prefill), server_url(hosts.decode)
    if role == "router":
        flags: dict[str, Any] = {
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
    host: HostConf = getattr(hosts, role)
    flags = {
        "--model-path": model_path,
        "--disaggregation-mode": role,
        "--host": host.bind,
        "--port": str(host.port),
    }
    if role == "prefill":
        flags["--disaggregation-bootstrap-port"] = str(hosts.prefill.bootstrap_port)
    return flags


def _launch_prefix(launch: RoleLaunch, python: str) -> list[str]:
    if launch.command:
        return [str(w) for w in launch.command]
    return [python, "-m", str(launch.module)]


def _role_parts(job: JobConf, role: str) -> tuple[RoleMerge, dict[str, Any], list[str]]:
    """A role's merged env/flags, its topology flags, and what keeps them from being planned."""
    merged = merge_role(role, getattr(job.deployment.roles, role), job.factors)
    topology = topology_flags(role, job.cluster.hosts, job.deployment.model_path)
    problems = list(merged.problems)
    clash = sorted(set(topology) & set(merged.flags))
    if clash:
        where = sorted({config_key(merged.origin[f"flag {f}"], role, "flags") for f in clash})
        problems.append(f"{', '.join(where)}: {clash} are set from cluster.hosts; remove them")
    return merged, topology, problems


def arm_problems(job: JobConf) -> list[str]:
    """What keeps `job` from being planned: conflicting factor levels, flags that the cluster sets."""
    return [problem for role in ROLES for problem in _role_parts(job, role)[2]]


def plan_arm(job: JobConf) -> ArmPlan:
    """The arm this job describes. Pure. The job must be valid (`config.load_job` checks it)."""
    parts = {role: _role_parts(job, role) for role in ROLES}
    problems = [problem for _, _, found in parts.values() for problem in found]
    if problems:
        raise ValueError("the job cannot be planned: " + "; ".join(problems))
    hosts, deployment = job.cluster.hosts, job.deployment
    effective: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}
    roles: dict[str, RolePlan] = {}
    for role in ROLES:
        launch: RoleLaunch = getattr(deployment.roles, role)
        host: HostConf = getattr(hosts, role)
        merged, topology, _ = parts[role]
        effective[role] = (merged.env, merged.flags)
        origin = {f"flag {name}": CLUSTER for name in topology} | merged.origin
        roles[role] = RolePlan(
            role=role,
            host=host,
            env=merged.env,
            flags=merged.flags,
            argv=_launch_prefix(launch, host.python) + flag_words(topology) + flag_words(merged.flags),
            health_url=f"http://{host.url_host}:{host.port}{launch.health_path}",
            startup_timeout_s=float(launch.startup_timeout_s),
            flag_parser=launch.flag_parser,
            preflight_module=launch.preflight_module,
            env_registry=launch.env_registry,
            origin=origin,
        )
    return ArmPlan(
        factors={name: sel.option for name, sel in sorted(job.factors.items())},
        roles=roles,
        signature=signature(effective, deployment.model_path),
        router_url=f"http://{hosts.router.url_host}:{hosts.router.port}",
        model_path=deployment.model_path,
        served_model=deployment.served_model,
        stop_grace_s=float(deployment.stop_grace_s),
        warmup=bool(deployment.warmup),
        sequential_start=bool(deployment.sequential_start),
        gpu_free_timeout_s=float(deployment.gpu_free_timeout_s),
        gpu_idle_mib=int(deployment.gpu_idle_mib),
        workload=job.workload,
        bench=job.bench,
        deployment=deployment.name,
        sglang_version=deployment.sglang_version,
        sources={factor_origin(sel): sel.source for sel in job.factors.values()},
        env_read_by={name: note for sel in job.factors.values() for name, note in sel.value.read_by.items()},
    )


def on_cluster(job: JobConf, member: str) -> JobConf:
    """The job as it runs on one member of its pool."""
    assert job.cluster_pool is not None
    return dataclasses.replace(job, cluster=job.cluster_pool.clusters[member])


def jobs_on_pool(job: JobConf) -> list[JobConf]:
    """The job on each cluster it may run on: its pool's members, or its one cluster."""
    if job.cluster_pool is None:
        return [job]
    return [on_cluster(job, member) for member in job.cluster_pool.clusters]
