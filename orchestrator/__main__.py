"""`python -m orchestrator`: the Hydra app. One job runs one arm; a multirun runs a study.

The entry point only composes the config and calls `run_arm`, a plain function that tests call directly.
An arm: validate and plan (pure) -> co-restart the PD deployment -> stress workload -> throughput
sweep -> parse logs -> track everything in an MLflow child run -> teardown, always.

A failed arm is data: it becomes a FAILED run with its reason and the sweep goes on. An interrupt
(Ctrl-C, SIGTERM) tears everything down, keeps what was measured, marks the run KILLED and stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from orchestrator.checks import check_local_side
from orchestrator.config import CONF_DIR, validate
from orchestrator.deploy import DeployError, Deployment
from orchestrator.factors import ArmPlan, plan_arm
from orchestrator.observe import parse_decode_log
from orchestrator.preflight import PreflightError
from orchestrator.redact import redact_env, redact_text

log = logging.getLogger("orchestrator")


def arm_label(plan: ArmPlan, baseline: dict[str, str]) -> str:
    """`baseline`, or the factor levels that differ from the study's baseline (`multi_stream=off`)."""
    changed = [f"{k}={v}" for k, v in sorted(plan.factors.items()) if str(baseline.get(k, v)) != v]
    return ",".join(changed) or "baseline"


class InterruptGuard:
    """SIGINT and SIGTERM while an arm runs.

    The first one raises KeyboardInterrupt, so the arm's `finally` tears everything down. Any later one
    (an impatient second Ctrl-C) is logged and ignored until the arm is done: it must not cut the teardown
    short and leave servers running. A signal that arrives during the teardown of an arm that ended on its
    own is held and raised once the arm is recorded (`raise_pending`), so it still stops the sweep.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.fired = False
        self.shielded = False
        self.pending: int | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.fired or self.shielded:
            self.pending = self.pending or signum
            log.warning("signal %d ignored: stopping the servers first", signum)
            return
        self.fired = True
        raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[InterruptGuard]:
        try:
            previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        except ValueError:  # not the main thread (some launchers): signals keep their defaults
            yield self
            return
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        """Hold signals while the block runs (the teardown)."""
        self.shielded = True
        try:
            yield
        finally:
            self.shielded = False

    def raise_pending(self) -> None:
        if self.pending is not None and not self.fired:
            self.fired = True
            raise KeyboardInterrupt(f"signal {self.pending} (held during teardown)")


def redacted_config_yaml(cfg: DictConfig) -> str:
    """The resolved job config as YAML, with secret-looking env values replaced."""
    job_keys = [k for k in cfg if k != "hydra"]  # a composed config may carry Hydra's own node
    data = OmegaConf.to_container(OmegaConf.masked_copy(cfg, job_keys), resolve=True)
    for role in data.get("deployment", {}).get("roles", {}).values():
        role["env"] = redact_env(role.get("env") or {})
    for factor in (data.get("factor") or {}).values():
        for delta in (factor.get("roles") or {}).values():
            if delta.get("env"):
                delta["env"] = redact_env(delta["env"])
    return OmegaConf.to_yaml(OmegaConf.create(data))


def run_arm(cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    """Run one arm end to end. Returns a small summary (also what Hydra keeps as the job's return)."""
    from orchestrator.remote import close_all, make_transports
    from orchestrator.tracking import ArmTracker, finished_runs, parent_run_id

    validate(cfg)
    plan = plan_arm(cfg)
    check_local_side(str(cfg.tracking.uri), str(cfg.report.dir))
    repetition = int(cfg.repetition)
    label = arm_label(plan, dict(cfg.study.baseline))
    output_dir.mkdir(parents=True, exist_ok=True)
    if cfg.resume and (plan.signature, repetition) in finished_runs(
        str(cfg.tracking.uri), str(cfg.study.name)
    ):
        log.info(
            "resume: %s repetition %d (signature %s) already FINISHED; skipped",
            label,
            repetition,
            plan.signature,
        )
        return {"status": "SKIPPED", "signature": plan.signature, "repetition": repetition, "arm": label}

    log.info("arm %s, repetition %d, signature %s", label, repetition, plan.signature)
    config_file = output_dir / "resolved_config.yaml"
    config_file.write_text(redacted_config_yaml(cfg))
    transports = make_transports({role: cfg.cluster.hosts[role] for role in plan.roles})
    deployment = Deployment(
        cfg,
        plan,
        transports,
        run_label=f"{cfg.study.name}-{plan.signature}-r{repetition}",
        on_event=lambda message: log.info(message),
    )
    status = "FINISHED"
    guard = InterruptGuard()
    with guard.installed(), ArmTracker.start(cfg, plan, repetition, parent_run_id(cfg)) as tracker:
        tracker.log_artifact(config_file)
        try:
            _preflight(cfg, plan, transports, tracker)
        except PreflightError as e:
            # bad input the hosts caught: nothing was stopped or restarted; the run says why, the sweep stops
            tracker.fail(str(e))
            close_all(transports)
            raise
        try:
            deployment.co_restart()
            tracker.log_startup(deployment.startup_s)
            _workload(cfg, plan, output_dir, tracker, deployment)
        except DeployError as e:
            log.error("arm %s failed: %s", label, e)
            tracker.fail(str(e).splitlines()[0], e.log_tail)
            status = "FAILED"
        except Exception as e:  # failures are data: record this arm and let the sweep go on
            log.exception("arm %s failed", label)
            tracker.fail(f"{type(e).__name__}: {e}")
            status = "FAILED"
        finally:
            with guard.shield():
                problems = deployment.stop_all()
                _collect_logs(deployment, output_dir, tracker)
                _gpus_after_teardown(cfg, transports, tracker)
                close_all(transports)
            if problems:
                log.error("teardown problems: %s", problems)
    guard.raise_pending()
    return {
        "status": status,
        "signature": plan.signature,
        "repetition": repetition,
        "arm": label,
        "run_id": tracker.run_id,
    }


def _preflight(cfg: DictConfig, plan: ArmPlan, transports: dict, tracker: Any) -> None:
    """The hosts check the arm (again: a host may have changed since the sweep began) and say what
    they run, before anything is restarted."""
    from orchestrator.preflight import check_arm_on_hosts, host_provenance

    check_arm_on_hosts(cfg, plan, transports)
    for role in ("prefill", "decode"):
        host = cfg.cluster.hosts[role]
        info = host_provenance(transports[role], str(host.python), host.server_checkout)
        tracker.log_provenance(role, dataclasses.asdict(info))


def _gpus_after_teardown(cfg: DictConfig, transports: dict, tracker: Any) -> None:
    """GPU memory in use after teardown, per server host: shows the GPUs were freed (None: no GPUs)."""
    from orchestrator.preflight import gpu_memory_used

    for role in ("prefill", "decode"):
        try:
            used = gpu_memory_used(transports[role])
        except Exception as e:
            log.warning("could not read GPU memory on %s after teardown: %s", role, e)
            continue
        if used is not None:
            tracker.log_provenance(role, {"gpu_memory_used_after_teardown_mib": used})


def _workload(cfg: DictConfig, plan: ArmPlan, output_dir: Path, tracker: Any, deployment: Deployment) -> None:
    from orchestrator.workload.bench import run_bench_sync
    from orchestrator.workload.stress import run_stress_sync, summarize_jsonl

    stress_dir = output_dir / "stress"
    w = cfg.workload
    try:
        summary = run_stress_sync(
            url=plan.router_url,
            sessions=int(w.sessions),
            rounds=int(w.rounds),
            concurrency=int(w.concurrency) if w.concurrency else None,
            seed=int(w.seed) + int(cfg.repetition) * 7919,
            model=str(cfg.deployment.served_model),
            timeout_s=float(w.timeout_s),
            out_dir=stress_dir,
            check_plan=bool(w.check_plan),
            server_gone=lambda: f"{role} is no longer running" if (role := deployment.dead_role()) else None,
        )
    except BaseException:
        # whatever completed before the interrupt or crash is kept, marked partial by its counts
        tracker.log_stress(
            summarize_jsonl(stress_dir / "sessions.jsonl", planned=int(w.sessions)), stress_dir
        )
        raise
    tracker.log_stress(summary, stress_dir)
    deployment.check_alive("the stress workload")
    if cfg.bench.enabled:
        b = cfg.bench
        bench_dir = output_dir / "bench"
        result = run_bench_sync(
            url=plan.router_url,
            concurrency_levels=[int(c) for c in b.concurrency],
            requests_per_worker=int(b.requests_per_worker),
            input_len=int(b.input_len),
            output_len=int(b.output_len),
            model=str(cfg.deployment.served_model),
            warmup_requests=int(b.warmup_requests),
            timeout_s=float(b.timeout_s),
            out_dir=bench_dir,
        )
        tracker.log_bench(result, bench_dir)
        deployment.check_alive("the throughput sweep")


def _collect_logs(deployment: Deployment, output_dir: Path, tracker: Any) -> None:
    """Fetch every role's log of this arm into the job dir, attach them, parse the decode log."""
    logs_dir = output_dir / "server_logs"
    logs_dir.mkdir(exist_ok=True)
    for role, transport in deployment.transports.items():
        try:
            text = transport.read_file(deployment.paths(role).log).decode(errors="replace")
        except (FileNotFoundError, OSError) as e:
            log.warning("no %s log to fetch: %s", role, e)
            continue
        text = redact_text(text, deployment.plan.roles[role].env)
        target = logs_dir / f"{role}.log"
        target.write_text(text)
        tracker.log_artifact(target, "server_logs")
        if role == "decode":
            tracker.log_facts(parse_decode_log(text))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_arm(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
