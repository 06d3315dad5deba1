"""What a schema cannot say, checked on the typed job (pure): env names, flag spelling, a factor level's
roles and name, hypotheses that name real factors and levels, ddmin's differences, two servers on one
port, a pool's members. `check_job` returns every problem at once, each naming the key and what is
accepted; `config.load.load_job` raises them together before anything is started.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.plan import BAD, DDMIN_ATTEMPT_BLOCK, GOOD, arm_problems, jobs_on_pool
from orchestrator.config.schema import (
    ROLES,
    ClusterHosts,
    ClusterPoolConf,
    FactorLevel,
    FactorRoles,
    JobConf,
    SelectedLevel,
    StressConf,
    StudyConf,
)
from orchestrator.config.shell import ENV_NAME
from orchestrator.workload.detect import ORACLES, counted_families, family_problems
from orchestrator.workload.divergence import COMPARE
from orchestrator.workload.tasks import TOOL_CHOICES

FLAG_NAME = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Flag values reach a remote shell quoted, but a metacharacter in a value is almost always a mistake
# (a pasted shell fragment), so it is refused rather than passed along literally.
SHELL_META = re.compile(r"[;&|`$<>\\\n\r\"'*?(){}\[\]!#~]")
TRANSPORTS = ("local", "ssh")
HOST_KEY_POLICIES = ("reject", "accept-new")
TESTS = ("fisher", "boschloo")


# a difference of a ddmin study is a two-level factor: not applied (good) or applied (bad)
DIFFERENCE_LEVELS = (GOOD, BAD)
DIFFERENCE_ID = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def difference_levels(
    study: StudyConf, applied: Sequence[str] | None, factors: Mapping[str, SelectedLevel]
) -> tuple[dict[str, SelectedLevel], list[str]]:
    """The ddmin differences as factor levels of this job: `bad` (applied, over the good
    configuration's values) for the ids in `applied` (the job's `ddmin_subset`), `good` (nothing) for
    the others. Problems name the key and what is accepted."""
    differences = study.ddmin.differences
    ids = [d.id for d in differences]
    problems: list[str] = []
    if applied is not None and not differences:
        return {}, [f"ddmin_subset: {list(applied)} given, but study.ddmin.differences is empty"]
    seen: dict[str, str] = {}
    for i, d in enumerate(differences):
        where = f"study.ddmin.differences[{i}]"
        if not DIFFERENCE_ID.match(str(d.id)):
            problems.append(f"{where}.id: {d.id!r} must start with a letter and use letters, digits, _ . -")
        elif d.id in seen:
            problems.append(f"{where}.id: {d.id!r} is also study.ddmin.differences[{seen[d.id]}].id")
        elif d.id in factors:
            problems.append(f"{where}.id: {d.id!r} is a factor's name too; rename the difference")
        seen.setdefault(d.id, str(i))
        sets = False
        for role in ROLES:
            delta = getattr(d.roles, role)
            sets = sets or bool(delta.env or delta.flags)
            key = f"{where} ({d.id}).roles.{role}"
            problems += validate_env(key, delta.env) + validate_flags(key, delta.flags)
        if not sets:
            problems.append(f"{where} ({d.id}): sets nothing; give roles.<role>.env or roles.<role>.flags")
    problems += _difference_clashes(differences)
    unknown = sorted(set(applied or ()) - set(ids))
    if unknown:
        problems.append(f"ddmin_subset: unknown difference(s) {unknown}; accepted: {ids}")
    # the good configuration's block 0 holds its runs and one throughput companion per attempt besides
    most = study.stopping.max_runs_per_arm
    if differences and most >= DDMIN_ATTEMPT_BLOCK // 2:
        problems.append(
            f"study.stopping.max_runs_per_arm: {most}; a ddmin study numbers each attempt's starts in blocks "
            f"of {DDMIN_ATTEMPT_BLOCK} repetitions, so it must be under {DDMIN_ATTEMPT_BLOCK // 2}"
        )
    if problems:
        return {}, problems
    chosen = set(applied or ())
    empty = FactorLevel(level=GOOD)
    levels = {}
    for i, d in enumerate(differences):
        option = BAD if d.id in chosen else GOOD
        value = (
            FactorLevel(level=option, description=d.description, roles=d.roles, read_by=d.read_by)
            if option == BAD
            else empty
        )
        levels[d.id] = SelectedLevel(
            d.id, option, f"study.ddmin.differences[{i}] ({d.id})", value, overrides=True
        )
    return levels, []


def _difference_clashes(differences: Sequence[Any]) -> list[str]:
    """Two differences setting one role's env var or flag to different values: the bad configuration
    would depend on the order they are applied in."""
    set_by: dict[tuple[str, str, str], tuple[str, Any]] = {}
    problems = []
    for d in differences:
        for role in ROLES:
            delta = getattr(d.roles, role)
            for kind, items in (("env", delta.env), ("flags", delta.flags)):
                for key, value in items.items():
                    other = set_by.setdefault((role, kind, key), (d.id, value))
                    if other[0] != d.id and other[1] != value:
                        problems.append(
                            f"study.ddmin.differences: {other[0]} and {d.id} both set {role} {kind} {key} "
                            f"({other[1]!r} vs {value!r}); accepted: one value per setting"
                        )
    return problems


def typed_level(name: str, option: str, source: str, node: Any) -> tuple[SelectedLevel | None, list[str]]:
    """One factor level checked against its schema (`schema.FactorLevel`): known roles, and a `level:`
    that matches the file name. Problems name the file and the key."""
    where = f"factor.{name} ({source})"
    roles = [f.name for f in fields(FactorRoles)]
    for role in (node.get("roles") or {}) if isinstance(node, DictConfig) else ():
        if role not in roles:
            return None, [f"{where}: roles.{role}: unknown role {role!r}; accepted: {roles}"]
    try:
        value = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FactorLevel), node))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "?"
        accepted = "level, description, roles.<role>.env/flags, read_by"
        return None, [f"{where}: {key}: {getattr(e, 'msg', e)}; accepted keys: {accepted}"]
    assert isinstance(value, FactorLevel)
    problems = []
    if _yaml_bool(value.level):
        problems.append(
            f'{where}: level: YAML read {value.level!r} as a boolean; quote the level (e.g. "{option}")'
        )
    elif value.level != option:
        problems.append(
            f"{where}: level: {value.level!r} differs from the file name {option!r}; accepted: {option!r}"
        )
    for role in roles:
        delta = getattr(value.roles, role)
        key = f"factor.{name} (level {option}).roles.{role}"
        problems += validate_env(key, delta.env) + validate_flags(key, delta.flags)
    set_here = {env for role in roles for env in getattr(value.roles, role).env}
    for env in sorted(set(value.read_by) - set_here):
        problems.append(
            f"{where}: read_by.{env}: this level sets no {env}; accepted: the env vars it sets "
            f"({sorted(set_here)})"
        )
    return SelectedLevel(factor=name, option=option, source=source, value=value), problems


# --- checks on typed values (pure) --------------------------------------------------------------------


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
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is None:
                continue
            if isinstance(v, bool):
                problems.append(
                    f"{where}.flags.{name}: booleans are ambiguous; use null for a switch or remove the flag"
                )
            elif isinstance(v, (dict, list, tuple)):
                problems.append(f"{where}.flags.{name}: value must be null, a scalar or a list of scalars")
            elif SHELL_META.search(str(v)):
                problems.append(
                    f"{where}.flags.{name}: value {str(v)!r} contains a shell metacharacter; "
                    f"accepted: plain words, numbers, paths, URLs"
                )
    return problems


def check_job(job: JobConf, known: Mapping[str, list[str]]) -> list[str]:
    """Every problem of a typed job that its schema cannot express. Pure: touches no host."""
    problems: list[str] = []
    if job.cluster_pool is None:
        problems += cluster_problems(job.cluster.hosts, "cluster")
    else:
        problems += pool_problems(job.cluster_pool)
    for role in ROLES:
        launch = getattr(job.deployment.roles, role)
        where = f"deployment.roles.{role}"
        if not launch.module and not launch.command:
            problems.append(f"{where}: set `module` (python -m MODULE) or `command` (an argv list)")
        problems += validate_env(where, launch.env)
        problems += validate_flags(where, launch.flags)
    problems += cost_problems(job.deployment.cost, "deployment.cost")
    if not problems:
        for on_one in jobs_on_pool(job):
            problems += arm_problems(on_one)
    levels = {name: sel.option for name, sel in job.factors.items()}
    problems += validate_study(job.study, levels, known)
    if job.study.test not in TESTS:
        problems.append(f"study.test: {job.study.test!r} is not one of {list(TESTS)}")
    for key in ("alpha", "min_effect", "ceiling", "throughput_floor"):
        value = getattr(job.study, key)
        if not 0 < float(value) < 1:
            problems.append(f"study.{key}: {value} must be between 0 and 1")
    if job.workload.sessions < 1 or job.workload.rounds < 1:
        problems.append("workload.sessions and workload.rounds must be >= 1")
    problems += workload_problems(job.workload)
    stopping = job.study.stopping
    if not 1 <= stopping.min_runs_per_arm <= stopping.max_runs_per_arm:
        problems.append(
            f"study.stopping: min_runs_per_arm={stopping.min_runs_per_arm} and max_runs_per_arm="
            f"{stopping.max_runs_per_arm} must satisfy 1 <= min_runs_per_arm <= max_runs_per_arm"
        )
    if stopping.max_sessions is not None and stopping.max_sessions < job.workload.sessions:
        problems.append(
            f"study.stopping.max_sessions: {stopping.max_sessions} must be null or at least one run's "
            f"sessions (workload.sessions={job.workload.sessions})"
        )
    if not 0 < float(stopping.icc_confidence) < 1:
        problems.append(
            f"study.stopping.icc_confidence: {stopping.icc_confidence} must be between 0 and 1 (the "
            "confidence of the ICC's upper bound a one-start arm is judged at; default 0.8)"
        )
    largest = stopping.max_run_sessions
    if largest is not None and largest < job.workload.sessions:
        problems.append(
            f"study.stopping.max_run_sessions: {largest} must be null (every run has workload.sessions) or "
            f"at least workload.sessions={job.workload.sessions}, the smallest run a sequential study sizes"
        )
    problems += cost_problems(job.study.cost, "study.cost")
    if any(int(c) < 1 for c in job.bench.concurrency):
        problems.append(f"bench.concurrency: {list(job.bench.concurrency)} must all be >= 1")
    return problems


def cost_problems(cost: Any, where: str) -> list[str]:
    """A cost model's figures (study.cost, deployment.cost): seconds and GPUs, none negative."""
    problems = []
    for key in ("restart_s", "session_s", "bench_s", "gpus"):
        value = getattr(cost, key, None)
        if value is not None and float(value) < 0:
            problems.append(f"{where}.{key}: {value} must be >= 0 (null: measured from the runs)")
    return problems


def cluster_problems(hosts: ClusterHosts, where: str) -> list[str]:
    """What is wrong with one cluster's hosts; `where` is its config key (`cluster`, or a pool member's)."""
    problems: list[str] = []
    for role in ROLES:
        host = getattr(hosts, role)
        if host.transport not in TRANSPORTS:
            problems.append(
                f"{where}.hosts.{role}.transport: {host.transport!r} is not one of {list(TRANSPORTS)}"
            )
        if host.transport == "ssh" and host.ssh.host_key_policy not in HOST_KEY_POLICIES:
            problems.append(
                f"{where}.hosts.{role}.ssh.host_key_policy: {host.ssh.host_key_policy!r} is not one "
                f"of {list(HOST_KEY_POLICIES)}"
            )
    if hosts.prefill.bootstrap_port is None:
        problems.append(f"{where}.hosts.prefill.bootstrap_port: required (the PD bootstrap port)")
    return problems + port_clashes(hosts, where)


def port_clashes(hosts: ClusterHosts, where: str = "cluster") -> list[str]:
    """Two servers on one address given one port: the second cannot bind, and health checks of its
    URL would be answered by the first."""
    problems: list[str] = []
    taken: dict[tuple[str, int], str] = {}
    for role in ROLES:
        host = getattr(hosts, role)
        for key, port in host.ports().items():
            here = f"{where}.hosts.{role}.{key}"
            other = taken.setdefault((host.address, port), here)
            if other != here:
                problems.append(
                    f"{here}: port {port} on {host.address} is also {other}; accepted: a port "
                    f"no other server of the deployment uses on that address"
                )
    return problems


def pool_problems(pool: ClusterPoolConf) -> list[str]:
    """Each member checked as a cluster, and no two members sharing a port or a work dir on one address
    (two arms at once would bind the same port, or stop each other's servers through the pid files)."""
    if not pool.clusters:
        return [f"cluster_pool.clusters: pool {pool.name!r} names no cluster; accepted: one or more"]
    problems: list[str] = []
    ports: dict[tuple[str, int], str] = {}
    dirs: dict[tuple[str, str], str] = {}
    for member, cluster in pool.clusters.items():
        where = f"cluster_pool.clusters.{member}"
        problems += cluster_problems(cluster.hosts, where)
        for role in ROLES:  # (roles of one member may share an address or a work dir)
            host = getattr(cluster.hosts, role)
            for key, port in host.ports().items():
                other = ports.setdefault((host.address, port), f"{where}.hosts.{role}.{key}")
                if not other.startswith(f"{where}."):
                    problems.append(
                        f"{where}.hosts.{role}.{key}: port {port} on {host.address} is also {other}; "
                        f"accepted: ports no other cluster of the pool uses on that address"
                    )
            work_dir = host.work_dir.rstrip("/")
            other = dirs.setdefault((host.address, work_dir), f"{where}.hosts.{role}.work_dir")
            if not other.startswith(f"{where}."):
                problems.append(
                    f"{where}.hosts.{role}.work_dir: {work_dir} on {host.address} is also {other}; "
                    f"accepted: a work dir of this cluster only (its pid files and lease live there)"
                )
    return problems


def _yaml_bool(value: Any) -> bool:
    """YAML 1.1 reads unquoted on/off/yes/no as booleans; typed str fields then hold 'True'/'False'."""
    return isinstance(value, bool) or value in ("True", "False")


def validate_study(
    study: StudyConf, selected: Mapping[str, str], known: Mapping[str, Sequence[str]]
) -> list[str]:
    """Problems with the study's baseline and hypotheses against the factors that exist."""
    problems = []
    factors_accepted = sorted(known)
    for factor, level in study.baseline.items():
        if _yaml_bool(level):
            problems.append(
                f"study.baseline.{factor}: YAML read {level!r} as a boolean; quote the level "
                f'(e.g. "on"); accepted: {list(known.get(factor, []))}'
            )
        elif factor not in known:
            problems.append(f"study.baseline.{factor}: unknown factor; accepted: {factors_accepted}")
        elif str(level) not in known[factor]:
            problems.append(
                f"study.baseline.{factor}: unknown level {level!r}; accepted: {list(known[factor])}"
            )
    seen = set()
    for i, hyp in enumerate(study.hypotheses):
        where = f"study.hypotheses[{i}] ({hyp.id})"
        if hyp.id in seen:
            problems.append(f"{where}: duplicate hypothesis id")
        seen.add(hyp.id)
        if hyp.factor not in known:
            problems.append(f"{where}.factor: unknown factor {hyp.factor!r}; accepted: {factors_accepted}")
            continue
        accepted = list(known[hyp.factor])
        for key in ("baseline", "treatment"):
            level = getattr(hyp, key)
            if _yaml_bool(level):
                problems.append(
                    f"{where}.{key}: YAML read {level!r} as a boolean; quote the level "
                    f'(e.g. "off"); accepted: {accepted}'
                )
            elif level not in accepted:
                problems.append(
                    f"{where}.{key}: unknown level {level!r} of factor {hyp.factor}; accepted: {accepted}"
                )
        if hyp.baseline == hyp.treatment:
            problems.append(f"{where}: baseline and treatment are the same level {hyp.baseline!r}")
        base = study.baseline.get(hyp.factor)
        if base is not None and base != hyp.baseline:
            problems.append(
                f"{where}.baseline: {hyp.baseline!r} differs from study.baseline.{hyp.factor} = {base!r}"
            )
    if not selected:
        problems.append(
            "factor: no factor selected; the primary config's defaults list selects factor/<name>"
        )
    return problems


def workload_problems(w: StressConf) -> list[str]:
    """What is wrong with the workload section, each problem naming its key and what is accepted; a
    prompts file is read here, and a reproducer's callable imported, before anything is restarted."""
    if w.oracle not in ORACLES:
        return [f"workload.oracle: {w.oracle!r} is not one of {list(ORACLES)}"]
    problems = []
    if w.count is not None:
        problems += family_problems("workload.count", list(w.count))
    elif not counted_families(w.oracle, w.count):
        problems.append("workload.count: the oracle counts no family")
    if w.tool_choice not in TOOL_CHOICES:
        problems.append(f"workload.tool_choice: {w.tool_choice!r} is not one of {list(TOOL_CHOICES)}")
    if w.compare not in COMPARE:
        problems.append(f"workload.compare: {w.compare!r} is not one of {list(COMPARE)}")
    if w.early_tokens < 0 or w.max_tokens < 1:
        problems.append(
            f"workload.early_tokens ({w.early_tokens}) must be >= 0 and workload.max_tokens "
            f"({w.max_tokens}) >= 1"
        )
    if w.oracle == "reproducer":
        from orchestrator.workload.reproducer import reproducer_problems

        if w.count is not None and list(w.count) != ["reproducer"]:
            problems.append(
                f"workload.count: {list(w.count)} judges nothing under a reproducer, whose sessions are "
                "its own verdicts; accepted: [reproducer] or null"
            )

        problems += reproducer_problems(w)
    elif w.call is not None or w.command is not None:
        problems.append(
            f"workload.call / workload.command: a reproducer's, but workload.oracle is {w.oracle!r}; "
            "choose workload=reproducer for your own reproducer"
        )
    if w.prompts is not None:
        if w.oracle == "reproducer":
            problems.append("workload.prompts: a reproducer brings its own traffic; set prompts: null")
        else:
            from orchestrator.workload.prompts import prompts_problems

            problems += [f"workload.prompts: {problem}" for problem in prompts_problems(w.prompts)]
    return problems
