"""The PD deployment lifecycle: co-restart, health gates, warm-up, teardown.

Never restart decode alone against a running prefill: in PD the bootstrap state goes stale. So every
arm stops everything (router, decode, prefill — including servers an earlier crashed run left behind,
found through pid files in each host's work dir, never by process name), then starts prefill and
decode together (or prefill first, then decode, where `deployment.sequential_start` says they share a
GPU), gated on their health endpoints, then the router, gated on its health and on its `/workers`
listing both servers (sglang-router answers 503 "No available servers" until its background
registration has probed them: ~18 s on real sglang 0.5.17), then sends one request end to end.

Hosts are reached only through the Transport interface, so the same code drives the local embedded
default and an SSH cluster.
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from orchestrator.config.plan import ArmPlan, RolePlan, server_url
from orchestrator.config.redact import redact_text
from orchestrator.config.schema import ROLES, SERVER_ROLES
from orchestrator.remote.base import Transport, TransportError
from orchestrator.run import gpus

log = logging.getLogger(__name__)

START_ORDER = ("prefill", "decode", "router")
STOP_ORDER = ("router", "decode", "prefill")
LOG_TAIL_BYTES = 6000
# a stop cut short by a lost connection is tried again, this many times in all, this far apart
STOP_ATTEMPTS = 3
STOP_RETRY_S = 1.0
# the router's list of the workers it has registered (sglang-router 0.3: {"workers": [{"url", "worker_type",
# "is_healthy", ...}], ...})
ROUTER_WORKERS_PATH = "/workers"


def server_start_groups(sequential: bool) -> tuple[tuple[str, ...], ...]:
    """The server roles in start order, each group started at once and health-gated before the next:
    prefill and decode together, or (sequential, where they share a GPU) prefill and then decode."""
    return tuple((role,) for role in SERVER_ROLES) if sequential else (tuple(SERVER_ROLES),)


def router_waiting_for(workers_body: str, servers: Mapping[str, str]) -> list[str]:
    """The servers (role -> base URL) that a router's `/workers` answer does not yet list as registered
    and healthy, as "role URL" ([] once all are). An answer that is not the expected JSON counts as
    listing none. Pure."""
    try:
        listed = json.loads(workers_body).get("workers")
    except (json.JSONDecodeError, AttributeError):
        listed = None
    workers = [w for w in listed if isinstance(w, dict)] if isinstance(listed, list) else []
    missing = []
    for role, url in servers.items():
        registered = any(
            str(w.get("url", "")).rstrip("/") == url.rstrip("/")
            and w.get("worker_type", role) == role
            and w.get("is_healthy", True) is not False
            for w in workers
        )
        if not registered:
            missing.append(f"{role} {url}")
    return missing


class DeployError(RuntimeError):
    """A server did not come up (or would not go down). Carries the role and its log tail."""

    def __init__(self, role: str, message: str, log_tail: str = ""):
        self.role = role
        self.log_tail = log_tail
        text = f"{role}: {message}"
        if log_tail:
            text += f"\n--- last lines of the {role} log ---\n{log_tail.rstrip()}"
        super().__init__(text)


@dataclass
class Paths:
    """Where a role's pid file and log live on its host."""

    pid: str
    log: str


def role_paths(work_dir: str, role: str, run_label: str) -> Paths:
    # The pid file name is stable per role, so a later run finds what a crashed one left running.
    return Paths(
        pid=f"{work_dir.rstrip('/')}/{role}.pid", log=f"{work_dir.rstrip('/')}/logs/{run_label}/{role}.log"
    )


@dataclass
class Deployment:
    """The hosts of one arm and what was started on them."""

    plan: ArmPlan
    transports: Mapping[str, Transport]
    run_label: str
    started: dict[str, int] = field(default_factory=dict)
    # the start time of each started server, as its pid file records it
    started_at: dict[str, str] = field(default_factory=dict)
    startup_s: dict[str, float] = field(default_factory=dict)
    # time.monotonic() when the first server of this run was started: from then the run holds the GPUs
    held_since: float | None = None
    on_event: Callable[[str], None] = lambda message: None

    def paths(self, role: str) -> Paths:
        return role_paths(self.plan.roles[role].host.work_dir, role, self.run_label)

    # --- stopping ----------------------------------------------------------------------------------

    def stop_role(self, role: str) -> None:
        """Stop whatever this tool started for `role` on its host (this run's or an earlier one's)."""
        transport = self.transports[role]
        pid_file = self.paths(role).pid
        pid, started_at = self.pid_file(role)
        if pid is None and role in self.started:  # the pid file went missing: what this arm started
            pid, started_at = self.started[role], self.started_at.get(role, "")
        if pid and self._is_ours(role, pid, started_at) and transport.group_alive(pid, started_at):
            self.on_event(f"stopping {role} (pgid {pid})")
            killed = transport.stop_group(
                pid, grace_s=self.plan.stop_grace_s, started_at=started_at, seen_alive=True
            )
            if killed:
                log.warning("%s did not stop within %ss of SIGTERM; killed", role, self.plan.stop_grace_s)
        transport.run_shell(f"rm -f {shlex.quote(pid_file)}", timeout=15.0)
        self.started.pop(role, None)
        self.started_at.pop(role, None)

    def _is_ours(self, role: str, pid: int, started_at: str) -> bool:
        """Guard against a recycled pid: same pid and same start time as when this tool started it."""
        if not started_at:
            log.warning(
                "pid file of %s names pid %s without a start time: not provably ours, left alone", role, pid
            )
            return False
        now = self.transports[role].start_time(pid)
        if not now:
            return True  # the leader exited but its group lives on: still ours
        ours = now == started_at
        if not ours:
            log.warning(
                "pid file of %s names pid %s, started %r, but that pid now started %r: a recycled "
                "pid, left alone",
                role,
                pid,
                started_at,
                now,
            )
        return ours

    def stop_all(self, attempts: int = STOP_ATTEMPTS) -> list[str]:
        """Stop every role, router first. Returns the problems met (never raises: used in finally). A
        stop is idempotent, so one cut short by a lost connection is tried again (the SSH transport
        reconnects): a server left running on a GPU host costs more than a few seconds here."""
        problems = []
        for role in STOP_ORDER:
            for attempt in range(1, attempts + 1):
                try:
                    self.stop_role(role)
                    break
                except TransportError as e:
                    if attempt == attempts:
                        problems.append(f"{role}: {e}")
                        log.error("could not stop %s after %d attempts: %s", role, attempts, e)
                    else:
                        log.warning("stopping %s failed (%s); trying again", role, e)
                        time.sleep(STOP_RETRY_S)
                except Exception as e:
                    problems.append(f"{role}: {e}")
                    log.error("could not stop %s: %s", role, e)
                    break
        return problems

    # --- starting ----------------------------------------------------------------------------------

    def check_ports_free(self) -> None:
        for role in ROLES:
            host = self.plan.roles[role].host
            for port in host.ports().values():
                if self.transports[role].port_listening(port):
                    raise DeployError(
                        role,
                        f"port {port} on {host.address} is still in use by a process this "
                        f"tool did not start (its pid file does not name it); free it or "
                        f"change cluster.hosts.{role}",
                    )

    def start_role(self, role: str) -> None:
        self.start_together((role,))

    def start_together(self, roles: Sequence[str]) -> None:
        """Launch `roles` at once, then health-gate them together: each role's start-up time is its
        own, and the wait is the slowest role's, not the sum (on a GPU host each load takes minutes)."""
        launched: dict[str, float] = {}
        for role in roles:
            plan: RolePlan = self.plan.roles[role]
            self.on_event(f"starting {role}")
            launched[role] = time.monotonic()
            paths, transport = self.paths(role), self.transports[role]
            self.started[role] = transport.start_detached(plan.argv, plan.env, paths.log, paths.pid)
            self.started_at[role] = self.pid_file(role)[1]
        healthy = self.wait_healthy(launched)
        for role in roles:  # in start order, whichever answered first
            self.startup_s[role] = healthy[role]
            self.on_event(f"{role} healthy after {healthy[role]:.1f}s")

    def wait_healthy(
        self, launched: Mapping[str, float], poll_s: float = 0.25, look_s: float = 1.0
    ) -> dict[str, float]:
        """Poll each launched role's health URL until it answers 200; returns seconds from launch to
        healthy per role. DeployError for the first role that exits or passes its start-up timeout.
        Whether a role still runs is looked at every `look_s`, not at every poll: a look is a few
        processes on its host (an SSH round trip on a remote one), a health poll one HTTP request.
        The roles started before these are looked at as often: the router waits for its servers to
        register, and one that died meanwhile fails the gate at once, not at the router's start-up timeout
        (fault campaign seed 34: a prefill killed as the router started held its arm 20 s)."""
        pending = dict(launched)
        healthy: dict[str, float] = {}
        last = dict.fromkeys(pending, "no answer yet")
        looked = dict(launched)  # when each role was last looked at (its launch, the first time)
        earlier = [r for r in START_ORDER if r not in launched]
        earlier_looked = time.monotonic()
        while pending:
            for role, t0 in list(pending.items()):
                plan = self.plan.roles[role]
                ready, last[role] = self.ready(role)
                if ready:
                    healthy[role] = time.monotonic() - t0
                    del pending[role]
                    continue
                timed_out = time.monotonic() - t0 > plan.startup_timeout_s
                if time.monotonic() - looked[role] < look_s and not timed_out:
                    continue
                looked[role] = time.monotonic()
                if not self.alive(role):
                    reason = f"exited before becoming healthy ({plan.health_url}: {last[role]})"
                    raise DeployError(role, reason, self.log_tail(role))
                if timed_out:
                    raise DeployError(
                        role,
                        f"not healthy within {plan.startup_timeout_s:.0f}s ({plan.health_url}: {last[role]})",
                        self.log_tail(role),
                    )
            if pending and earlier and time.monotonic() - earlier_looked >= look_s:
                earlier_looked = time.monotonic()
                if dead := self.dead_role(earlier):
                    gated = " and ".join(pending)
                    raise DeployError(dead, f"died while the {gated} was health-gated", self.log_tail(dead))
            if pending:
                time.sleep(poll_s)
        return healthy

    def ready(self, role: str) -> tuple[bool, str]:
        """(ready, what was seen otherwise): the role's health URL answers 200; the router's, and its
        `/workers` lists this arm's prefill and decode as registered and healthy."""
        status, body = http_get(self.plan.roles[role].health_url, timeout=5.0)
        if status != 200:
            return False, f"HTTP {status}: {body[:200]}" if status else body
        if role != "router":
            return True, ""
        # beside its health URL on the same server (the plan's router_url may name another address)
        url = urllib.parse.urljoin(self.plan.roles[role].health_url, ROUTER_WORKERS_PATH)
        status, body = http_get(url, timeout=5.0, limit=1 << 20)
        if status == 404:  # a router without the list: its health is all there is to wait for
            return True, ""
        servers = {r: server_url(self.plan.roles[r].host) for r in SERVER_ROLES}
        missing = router_waiting_for(body, servers) if status == 200 else [f"{url}: HTTP {status}"]
        return not missing, f"healthy, but has not registered {', '.join(missing)} yet" if missing else ""

    def log_tail(self, role: str) -> str:
        text = self.transports[role].read_text_tail(self.paths(role).log, LOG_TAIL_BYTES)
        return redact_text(text, self.plan.roles[role].secrets)

    def warm_up(self, look_s: float = 1.0) -> None:
        """One chat request end to end through the router. While it is in flight the servers are looked
        at every `look_s`: one that dies fails the arm at once, not at the request's 60 s timeout (fault
        campaign seed 34: a prefill killed as it became healthy held the warm-up, its decode waiting on
        the dead bootstrap server, for the whole timeout)."""
        payload = {
            "model": self.plan.served_model,
            "messages": [{"role": "user", "content": "warm-up: reply with one word"}],
            "max_tokens": 8,
        }
        url = f"{self.plan.router_url}/v1/chat/completions"
        answer: Future[tuple[int, str]] = Future()

        def post() -> None:
            try:
                answer.set_result(http_post_json(url, payload, timeout=60.0))
            except Exception as e:  # raised in the arm's thread, by `answer.result`
                answer.set_exception(e)

        # a daemon thread: one left waiting on a dead server ends when the teardown closes its connection
        threading.Thread(target=post, name="warm-up", daemon=True).start()
        while True:
            try:
                status, body = answer.result(timeout=look_s)
                break
            except TimeoutError:
                role = self.dead_role()
                if role is not None:
                    raise DeployError(role, "died during the warm-up request", self.log_tail(role)) from None
        if status != 200:
            tails = "\n".join(f"[{r}] {self.log_tail(r)[-1500:]}" for r in ("decode", "router"))
            raise DeployError("router", f"warm-up request failed: HTTP {status}: {body[:300]}", tails)

    def dead_role(self, roles: Sequence[str] = START_ORDER) -> str | None:
        """The first of `roles` whose server, started for this arm, is no longer running (None: all alive)."""
        for role in roles:
            if role in self.started and not self.alive(role):
                return role
        return None

    def alive(self, role: str) -> bool:
        """The server this arm started for `role` still runs (the transports' one liveness check: pid and
        start time, never a live group taken for gone)."""
        return self.transports[role].group_alive(self.started[role], self.started_at.get(role, ""))

    def pid_file(self, role: str) -> tuple[int | None, str]:
        """(pid, start time) as the role's pid file names them now ((None, '') without one)."""
        try:
            lines = self.transports[role].read_file(self.paths(role).pid).decode().splitlines()
        except FileNotFoundError:
            return None, ""
        pid = int(lines[0]) if lines and lines[0].strip().isdigit() else None
        return pid, lines[1].strip() if len(lines) > 1 else ""

    def replaced_role(self) -> str | None:
        """The first role whose pid file no longer names the server this arm started (None: all ours)."""
        for role in START_ORDER:
            if role in self.started and self.pid_file(role) != (self.started[role], self.started_at[role]):
                return role
        return None

    def check_alive(self, during: str) -> None:
        """Raise DeployError if a server started for this arm has died or was replaced by someone else's
        (its results are not this arm's)."""
        role = self.replaced_role()
        if role is not None:
            pid, _ = self.pid_file(role)
            raise DeployError(
                role,
                f"after {during} its pid file names {'pid ' + str(pid) if pid else 'no server'}, not the "
                f"server this arm started (pid {self.started[role]}): something else restarted this "
                f"cluster, so what was measured is not this arm's",
            )
        role = self.dead_role()
        if role is not None:
            raise DeployError(
                role,
                f"died during {during}; sessions in flight were counted as errored, never as corrupted",
                self.log_tail(role),
            )

    def start_servers(self) -> None:
        """Prefill and decode, health-gated: together, or one after the other (`sequential_start`)."""
        for group in server_start_groups(self.plan.sequential_start):
            self.start_together(group)

    def wait_gpus_free(self) -> None:
        """Every GPU the server roles use is back to its idle memory before a start (run/gpus.py): a
        bounded wait, then a refusal (DeployError) that names what holds them and where."""
        hosts: dict[str, tuple[Transport, list[Mapping[str, str]]]] = {}
        for role in SERVER_ROLES:
            transport = self.transports[role]
            hosts.setdefault(transport.host, (transport, []))[1].append(self.plan.roles[role].env)
        try:
            gpus.wait_free(
                {host: (t, gpus.visible_gpus(envs)) for host, (t, envs) in hosts.items()},
                self.plan.gpu_free_timeout_s,
                self.plan.gpu_idle_mib,
                on_event=self.on_event,
            )
        except gpus.GpusBusy as e:
            raise DeployError("GPUs", str(e)) from e

    def co_restart(self) -> None:
        """Stop all roles; start prefill and decode together (PD servers pair up per request through
        the bootstrap server, not at start-up; one after the other where they share a GPU), health-gate
        them, then the router, gated until it has registered both; then warm up."""
        self.stop_all()
        self.check_ports_free()
        self.wait_gpus_free()
        self.held_since = time.monotonic()
        self.start_servers()
        self.start_role("router")
        if self.plan.warmup:
            self.warm_up()


# --- tiny HTTP helpers for gating (the workload has its own async client) -------------------------------


def http_get(url: str, timeout: float, limit: int = 2048) -> tuple[int, str]:
    """(status, the body's first `limit` bytes); status 0 and the error text when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read(limit).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(limit).decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))


def http_post_json(url: str, payload: dict, timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(4096).decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))
