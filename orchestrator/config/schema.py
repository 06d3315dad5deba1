"""The typed values of a study: one dataclass per config node, and nothing else.

Hydra composes the YAML under conf/ against these (config/load.py registers them in its ConfigStore, so a
misspelled key or a wrong type is refused at compose time), and `config.load_job` turns the composed
config into these values, once. Everything downstream (the planner, the deployment, preflight, tracking,
the analysis, the report) takes these values or the `ArmPlan` built from them, never a `DictConfig`.
This module imports neither Hydra nor OmegaConf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# OmegaConf's marker for a mandatory value (the same string, so this module needs no omegaconf import)
MISSING: Any = "???"

ROLES = ("prefill", "decode", "router")
# the roles that run an inference server (the router only routes)
SERVER_ROLES = ("prefill", "decode")


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
    # a local command connected to the host, as OpenSSH's (%h %p %r ...); default: from ~/.ssh/config
    proxy_command: str | None = None
    config_file: str = "~/.ssh/config"
    known_hosts: str = "~/.ssh/known_hosts"
    # reject: unknown or changed host keys are refused. accept-new: trust a host seen for the first time.
    host_key_policy: str = "reject"
    connect_timeout_s: float = 10.0
    keepalive_s: float = 15.0
    # one long-lived shell per session for the commands (a few ms each); false: a session per command,
    # which starts the login shell every time (~150 ms where .bashrc runs pyenv)
    persistent_shell: bool = True


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

    @property
    def url_host(self) -> str:
        """The address other hosts reach this host's servers at."""
        return self.advertise or self.address

    def ports(self) -> dict[str, int]:
        """Every port a server of this host listens on, by its config key."""
        named = {"port": self.port, "bootstrap_port": self.bootstrap_port, "metrics_port": self.metrics_port}
        return {key: int(port) for key, port in named.items() if port is not None}


@dataclass
class ClusterHosts:
    prefill: HostConf = MISSING
    decode: HostConf = MISSING
    router: HostConf = MISSING


@dataclass
class LeaseConf:
    """How an arm holds its cluster (see lease.py): one study at a time on each server work dir."""

    # how long an arm waits for a cluster another study holds, before it refuses naming the holder
    wait_s: float = 1800.0
    poll_s: float = 2.0
    # the holder renews its heartbeat this often; a holder on another machine silent for stale_after_s
    # is taken to be dead (one on this machine is judged by its process)
    heartbeat_s: float = 10.0
    stale_after_s: float = 60.0


@dataclass
class ClusterConf:
    name: str = MISSING
    hosts: ClusterHosts = field(default_factory=ClusterHosts)
    lease: LeaseConf = field(default_factory=LeaseConf)


@dataclass
class ClusterPoolConf:
    """Several PD clusters (each what `cluster` is): every arm runs on one of them, which it holds for the
    whole arm (see pool.py). The key of `clusters` is the member's name in provenance and reports."""

    name: str = MISSING
    clusters: dict[str, ClusterConf] = field(default_factory=dict)
    # under Ray: a holder that has not renewed its lease for this long is lost (its worker or node died)
    # and the cluster comes back, to be torn down before its next arm
    lease_ttl_s: float = 30.0


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
    # "module:attr", an iterable of the engine env names (SGLANG_*) the server reads; null: the host's
    # sglang, its env registry (sglang.srt.environ) and then its source. A name it does not read is refused
    env_registry: str | None = None


@dataclass
class DeploymentRoles:
    prefill: RoleLaunch = field(default_factory=RoleLaunch)
    decode: RoleLaunch = field(default_factory=RoleLaunch)
    router: RoleLaunch = field(default_factory=RoleLaunch)


@dataclass
class DeploymentCost:
    """The deployment's own estimate of what a run costs (orchestrator/analysis/cost.py): the study's
    finished runs replace the times once measured, `study.cost` replaces any of them."""

    # a co-restart of prefill and decode until both are healthy, and their teardown
    restart_s: float = 60.0
    # wall seconds per session at the workload's load (a run's stress phase over its sessions)
    session_s: float = 1.0
    # one throughput sweep
    bench_s: float = 60.0
    # the GPUs both roles hold while an arm runs (GPU time = GPUs x wall)
    gpus: int = 1


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
    # start prefill, wait until it is healthy, then start decode. Set it where the two share a GPU:
    # started at the same moment, each sizes its KV cache from the memory it finds free, and one start
    # in three failed for it (sglang 0.5.17, prefill and decode on one H200). false: both at once
    sequential_start: bool = False
    # before each start, wait at most this long for every GPU the server roles use to be free (no compute
    # process on it, at most gpu_idle_mib in use: run/gpus.py); past it the start is refused naming the
    # processes that hold them. Hosts without nvidia-smi pass at once
    gpu_free_timeout_s: float = 120.0
    gpu_idle_mib: int = 1024
    # the sglang versions this deployment's flags and env vars are written for (a PEP 440 specifier,
    # e.g. "==0.5.23"); a host with another version, or none, is refused. null: not an sglang deployment
    sglang_version: str | None = None
    # what a start and a session cost here, before the study's own runs measure it (analysis/cost.py)
    cost: DeploymentCost = field(default_factory=DeploymentCost)


@dataclass
class RoleDelta:
    """What one factor level adds to one role: env vars and flags (null flag value: a switch)."""

    env: dict[str, str] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)


@dataclass
class FactorRoles:
    prefill: RoleDelta = field(default_factory=RoleDelta)
    decode: RoleDelta = field(default_factory=RoleDelta)
    router: RoleDelta = field(default_factory=RoleDelta)


@dataclass
class FactorLevel:
    """One option of a `factor/<name>` config group: `conf/factor/<name>/<level>.yaml`."""

    # must equal the file name (the option Hydra selected), so the arm's recorded level is what ran
    level: str = MISSING
    # one line for people (reports, --help of a study)
    description: str = ""
    roles: FactorRoles = field(default_factory=FactorRoles)
    # engine env var -> which builds read it, where stock sglang does not: the preflight still refuses
    # the variable on a host whose build does not read it, and quotes this (with how to proceed)
    read_by: dict[str, str] = field(default_factory=dict)


@dataclass
class Hypothesis:
    id: str = MISSING
    factor: str = MISSING
    statement: str = MISSING
    # the level in the baseline arm, and the level of the arm that differs only in this factor
    baseline: str = MISSING
    treatment: str = MISSING


@dataclass
class StoppingConf:
    """When a sequential study (`hydra.sweeper.design=sequential`) stops spending on undecided arms."""

    # the fewest starts an arm gets before its hypotheses may be decided. One start cannot show the
    # restart-to-restart variation (the ICC), so an arm with a single start is judged at an upper bound of
    # the study's ICC from the arms with two or more (icc_confidence), and not while none has; 2 asks
    # every arm for two starts of its own
    min_runs_per_arm: int = 1
    # the most server starts (rounds) an arm gets; then its undecided hypotheses are inconclusive
    max_runs_per_arm: int = 6
    # the most sessions the whole study spends (null: no cap beyond max_runs_per_arm)
    max_sessions: int | None = None
    # stop an arm early when no verdict can be reached within its budget (orchestrator/analysis/sequential.py)
    futility: bool = True
    # the largest run (sessions in one start) the design may choose for an arm's next start, by the
    # information each GPU-second buys (analysis/cost.py); null: every run has workload.sessions
    max_run_sessions: int | None = None
    # the confidence of the ICC's upper bound at which an arm with a single start is judged
    icc_confidence: float = 0.8


@dataclass
class CostConf:
    """What a run costs on the study's cluster, where the user knows better than the runs can measure
    (orchestrator/analysis/cost.py); null: measured from the study's finished runs, else the
    deployment's estimate (`deployment.cost`)."""

    restart_s: float | None = None
    session_s: float | None = None
    bench_s: float | None = None
    gpus: int | None = None


@dataclass
class Difference:
    """One setting by which a study's bad configuration differs from its good one (design=ddmin): what it
    sets per role, as a factor level does; applied on top of the good configuration's values."""

    id: str = MISSING
    description: str = ""
    roles: FactorRoles = field(default_factory=FactorRoles)
    # engine env var -> which builds read it, as FactorLevel.read_by
    read_by: dict[str, str] = field(default_factory=dict)


@dataclass
class DdminConf:
    """`hydra.sweeper.design=ddmin`: the differences between the good configuration (the job's
    deployment and factor levels) and the bad one (all of them applied); orchestrator/analysis/ddmin.py."""

    differences: list[Difference] = field(default_factory=list)


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
    min_effect: float = 0.5
    # "implicated" needs the treatment arm's upper confidence bound below this rate
    ceiling: float = 0.03
    # "no regression" needs the lower bound of every tok/s ratio above this fraction of baseline
    throughput_floor: float = 0.95
    # min_effect is a fraction of the baseline's rate (True) or an absolute rate difference (False)
    min_effect_relative: bool = True
    # ICC of sessions within one run assumed when the runs cannot estimate it (one run per arm)
    assumed_icc: float = 0.0
    stopping: StoppingConf = field(default_factory=StoppingConf)
    cost: CostConf = field(default_factory=CostConf)
    ddmin: DdminConf = field(default_factory=DdminConf)

    def __post_init__(self) -> None:
        # each difference is a two-level factor of the study's arms; the baseline (good) has none applied
        for difference in self.ddmin.differences:
            self.baseline.setdefault(difference.id, "good")  # plan.GOOD (schema imports nothing of ours)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudyConf:
        """From study.json (or any plain mapping): unknown keys are ignored, missing ones take defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["name"] = str(data["name"])
        values["description"] = str(data.get("description") or "")
        values["baseline"] = {str(k): str(v) for k, v in (data.get("baseline") or {}).items()}
        values["hypotheses"] = [
            Hypothesis(**{k: str(h[k]) for k in ("id", "factor", "statement", "baseline", "treatment")})
            for h in data.get("hypotheses") or []
        ]
        for key in ("alpha", "min_effect", "ceiling", "throughput_floor", "assumed_icc"):
            if key in values:
                values[key] = float(values[key])
        if "min_effect_relative" in values:
            values["min_effect_relative"] = bool(values["min_effect_relative"])
        stopping = data.get("stopping") or {}
        cap, largest = stopping.get("max_sessions"), stopping.get("max_run_sessions")
        values["stopping"] = StoppingConf(
            min_runs_per_arm=int(stopping.get("min_runs_per_arm", StoppingConf.min_runs_per_arm)),
            max_runs_per_arm=int(stopping.get("max_runs_per_arm", StoppingConf.max_runs_per_arm)),
            max_sessions=None if cap is None else int(cap),
            futility=bool(stopping.get("futility", True)),
            max_run_sessions=None if largest is None else int(largest),
            icc_confidence=float(stopping.get("icc_confidence", StoppingConf.icc_confidence)),
        )
        cost = data.get("cost") or {}
        values["cost"] = CostConf(
            **{
                k: None if cost.get(k) is None else float(cost[k])
                for k in ("restart_s", "session_s", "bench_s")
            },
            gpus=None if cost.get("gpus") is None else int(cost["gpus"]),
        )
        values["ddmin"] = DdminConf(
            [
                Difference(
                    id=str(d["id"]),
                    description=str(d.get("description") or ""),
                    roles=FactorRoles(
                        **{
                            role: RoleDelta(
                                env={str(k): str(v) for k, v in (delta.get("env") or {}).items()},
                                flags=dict(delta.get("flags") or {}),
                            )
                            for role, delta in (d.get("roles") or {}).items()
                            if role in ROLES
                        }
                    ),
                    read_by={str(k): str(v) for k, v in (d.get("read_by") or {}).items()},
                )
                for d in (data.get("ddmin") or {}).get("differences") or []
            ]
        )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StressConf:
    sessions: int = 60
    rounds: int = 4
    # concurrent sessions; null = all sessions at once
    concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 120.0
    # the detector families whose findings count as corruption (workload/detect.py: structural,
    # plan_drift, diverged_early, diverged, wrong_answer, reproducer); the others are counted per arm and
    # shown beside. null: the oracle's own (tool_calls: structural and plan_drift, what the original hunt
    # counted; divergence: diverged_early and diverged; both: wrong_answer where a prompt has an answer)
    count: list[str] | None = None
    # auto | required | plan (force, each round, the call the plan expects next)
    tool_choice: str = "auto"
    # what judges a session (docs/symptoms.md): tool_calls (the calls' structure and plan) | divergence
    # (each turn under load against the same start's batch-1 reference) | reproducer (yours: `call` or
    # `command`, with conf/workload/reproducer.yaml)
    oracle: str = "tool_calls"
    # a JSONL file of conversations in the OpenAI chat format replayed instead of the built-in
    # tool-calling tasks (workload/prompts.py); null: the built-in tasks
    prompts: str | None = None
    # the most tokens a turn may generate (both passes of the divergence oracle use the same)
    max_tokens: int = 1024
    # divergence: a first difference within this many tokens of a turn's start is `diverged_early`
    early_tokens: int = 16
    # divergence: what is compared; auto: the tokens where the server returns logprobs, else the text
    compare: str = "auto"
    # reproducer: a Python callable, as a Hydra `_target_` node (extra keys are its keyword arguments)
    call: Any = None
    # reproducer: an executable's argv (HEISENHUNT_URL, _SESSIONS, _CONCURRENCY, _SEED in its env)
    command: list[str] | None = None


@dataclass
class BenchConf:
    enabled: bool = True
    # the repetitions (server starts) of each arm that run the sweep; null: every one. Throughput is
    # minutes of GPU time per start and moves far less between starts than a heisenbug's rate does, so
    # by default only each arm's first start is measured (the report says which runs carried a sweep)
    repetitions: list[int] | None = field(default_factory=lambda: [0])
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
    # where artifacts go for a new experiment (null: mlruns/ beside a sqlite store's file, else the
    # server's default)
    artifact_location: str | None = None
    # a tracking server's writes it did not answer (down past the client's retries), kept per study and
    # sent when it answers again: tracking/outbox.py
    outbox_dir: str = "${oc.env:HOME}/.cache/heisenhunt/outbox"

    @property
    def sqlite_file(self) -> str:
        """The database file of a sqlite `uri` ('' for any other store): `sqlite:///relative.db` or
        `sqlite:////absolute.db`."""
        return self.uri.removeprefix("sqlite:///") if self.uri.startswith("sqlite:///") else ""


@dataclass
class ReportConf:
    dir: str = "reports"
    plots: bool = True


@dataclass(frozen=True)
class SelectedLevel:
    """A factor level as one job selected it: the typed level, and the file it came from."""

    factor: str
    option: str  # the config group option Hydra selected (the file name without .yaml)
    source: str  # where it came from, for messages: the file path, or `factor/<name>=<option>`
    value: FactorLevel
    # a ddmin difference (config.difference_levels): applied after the factor levels, over their values
    overrides: bool = False


@dataclass(frozen=True)
class JobConf:
    """One job of a sweep, as typed values: one arm x one repetition, and where it is recorded."""

    cluster: ClusterConf
    deployment: DeploymentConf
    factors: dict[str, SelectedLevel]
    study: StudyConf
    workload: StressConf
    bench: BenchConf
    tracking: TrackingConf
    report: ReportConf
    repetition: int = 0
    resume: bool = False
    parent_run_id: str | None = None
    # the sweep's directory (where the parent run id is left for the jobs), when run by Hydra
    sweep_dir: str | None = None
    # `cluster_pool=NAME`: the arm runs on one of these clusters instead of `cluster` (pool.py picks it)
    cluster_pool: ClusterPoolConf | None = None
