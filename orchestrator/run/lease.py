"""Cluster leases: one holder at a time per server work dir, whoever started the study.

Two studies on one cluster would stop each other's servers: every co-restart first stops what the pid
files name. So before an arm stops or starts anything it takes a lease on each of its hosts (one per
role work dir, in a fixed order, so two takers never deadlock), and its teardown gives them back after
the servers are stopped. A second study meets the lease and waits (up to `cluster.lease.wait_s`),
logging who holds it, then refuses naming the holder; it never touches the holder's servers.

On the host a lease is a directory, `<work_dir>/lease/`, made with `mkdir` (atomic on POSIX), holding
`holder.json` (who: run, study, the orchestrator's host and pid with its start time) and a `heartbeat`
file the holder touches while it runs. A lease is stale, and is taken over, when its holder's heartbeat is
older than `stale_after_s` by the host's own clock, or when the holder ran on this very machine and its
process is gone. A takeover renames the stale directory away first (atomic too), checking in the same
shell line that it is still the stale holder's.

The pool-of-clusters scheduler (Ray) decides which cluster an arm gets; this lease still guards every
host, so an arm started by hand beside the pool cannot clobber a pooled one.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from orchestrator.config.schema import LeaseConf
from orchestrator.remote.base import Transport
from orchestrator.remote.local import LocalTransport

log = logging.getLogger(__name__)

LEASE_DIR = "lease"


class LeaseHeld(RuntimeError):
    """The cluster is another holder's, and it did not come free in time."""

    def __init__(self, where: str, holder: Holder | None, waited_s: float):
        self.holder = holder
        who = holder.describe() if holder else "an unknown holder"
        super().__init__(
            f"{where} is leased by {who}; waited {waited_s:.0f}s. That study's servers were left alone. "
            f"Wait for it, stop it, or give this study its own cluster (other ports and work dirs); "
            f"cluster.lease.wait_s sets how long to wait"
        )


@dataclass(frozen=True)
class Holder:
    """Who holds a lease. `id` is unique per take; the rest is for people and for staleness."""

    id: str
    label: str  # the arm's run (study, arm, repetition, MLflow run id)
    hostname: str  # the machine the orchestrator runs on
    pid: int
    pid_started: str  # `remote.base.start_of` that pid: tells a recycled pid apart

    def describe(self) -> str:
        return f"{self.label} (orchestrator pid {self.pid} on {self.hostname})"

    @classmethod
    def this_process(cls, label: str) -> Holder:
        return cls(
            id=uuid.uuid4().hex,
            label=label,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            pid_started=local_start_time(os.getpid()),
        )


def local_start_time(pid: int) -> str:
    """A pid's start time on this machine, as every pid file records it (`Transport.start_time`)."""
    return LocalTransport().start_time(pid)


def is_stale(
    holder: Holder | None,
    heartbeat_age_s: float,
    stale_after_s: float,
    here: str,
    local_start_time: Callable[[int], str],
) -> bool:
    """Whether a lease can be taken over (pure, given how to read a local pid's start time). A holder
    on this machine is judged by its process (alive, and the same start time); any other by its
    heartbeat, which it renews every few seconds while it runs."""
    if holder is not None and holder.hostname == here:
        started = local_start_time(holder.pid)
        return not started or started != holder.pid_started
    return heartbeat_age_s > stale_after_s


# --- on one host ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostLease:
    """The lease directory of one work dir, through its host's transport."""

    transport: Transport
    work_dir: str

    @property
    def path(self) -> str:
        return f"{self.work_dir.rstrip('/')}/{LEASE_DIR}"

    @property
    def where(self) -> str:
        return f"{self.transport.host}:{self.work_dir}"

    def try_take(self, holder: Holder) -> tuple[bool, Holder | None, float]:
        """(taken, the current holder, its heartbeat age in seconds by the host's clock)."""
        d = shlex.quote(self.path)
        info = shlex.quote(json.dumps(asdict(holder), sort_keys=True))
        line = (
            f"mkdir -p {shlex.quote(self.work_dir)} || exit 3; "
            f"if mkdir {d} 2>/dev/null; then printf '%s\\n' {info} >{d}/holder.json && touch {d}/heartbeat "
            # a lease that cannot say whose it is (a full disk) is not left behind to block every taker
            f"&& echo TAKEN && exit 0; rm -rf {d}; exit 4; fi; "
            # re-entrant: a holder that took it already (a pool pick, then the arm) has it
            f"grep -q {shlex.quote(holder.id)} {d}/holder.json 2>/dev/null && touch {d}/heartbeat "
            f"&& echo TAKEN && exit 0; "
            # the heartbeat's age by the host's own clock (no skew); a take still half-way has only the dir
            f"echo HELD; now=$(date +%s); "
            f"hb=$(stat -c %Y {d}/heartbeat 2>/dev/null || stat -c %Y {d} 2>/dev/null) || "
            # released between the two looks (found by the fault campaign, seed 153127525): not an error
            f"{{ echo GONE; exit 0; }}; "
            f'echo "$((now - hb))"; cat {d}/holder.json 2>/dev/null; true'
        )
        result = self.transport.run_shell(line, timeout=30.0)
        lines = result.stdout.splitlines()
        if result.returncode != 0 or not lines:
            raise OSError(f"lease on {self.where}: {result.stderr.strip() or result.stdout.strip()}")
        if lines[0] == "TAKEN":
            return True, holder, 0.0
        if len(lines) < 2 or not lines[1].lstrip("-").isdigit():
            # the lease went away between the two checks: try again at once
            return False, None, 0.0
        return False, _parse_holder("\n".join(lines[2:])), float(lines[1])

    def take_over(self, stale: Holder | None) -> bool:
        """Rename a stale lease away, if it is still that holder's; the caller then tries again."""
        d = shlex.quote(self.path)
        moved = shlex.quote(f"{self.path}.stale.{uuid.uuid4().hex[:8]}")
        expected = shlex.quote(stale.id if stale else "")
        line = (
            f'cur=$(sed -n \'s/.*"id": "\\([0-9a-f]*\\)".*/\\1/p\' {d}/holder.json 2>/dev/null); '
            f'[ "$cur" = {expected} ] && mv {d} {moved} && rm -rf {moved} && echo MOVED'
        )
        return self.transport.run_shell(line, timeout=30.0).stdout.strip() == "MOVED"

    def heartbeat(self, holder: Holder) -> None:
        d = shlex.quote(self.path)
        line = f"grep -q {shlex.quote(holder.id)} {d}/holder.json 2>/dev/null && touch {d}/heartbeat"
        self.transport.run_shell(line, timeout=30.0)

    def release(self, holder: Holder) -> None:
        """Give the lease back, only if it is still ours (a takeover may have happened meanwhile)."""
        d = shlex.quote(self.path)
        line = f"grep -q {shlex.quote(holder.id)} {d}/holder.json 2>/dev/null && rm -rf {d}; true"
        self.transport.run_shell(line, timeout=30.0)


def _parse_holder(text: str) -> Holder | None:
    try:
        data = json.loads(text)
        return Holder(**{k: data[k] for k in ("id", "label", "hostname", "pid", "pid_started")})
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


# --- the whole cluster -------------------------------------------------------------------------------------


def cluster_leases(transports: Mapping[str, Transport], work_dirs: Mapping[str, str]) -> list[HostLease]:
    """One lease per distinct (host, work dir), in a fixed order so that two takers never deadlock."""
    seen: dict[tuple[str, str], HostLease] = {}
    for role in sorted(work_dirs):
        key = (transports[role].host, work_dirs[role].rstrip("/"))
        seen.setdefault(key, HostLease(transports[role], work_dirs[role]))
    return [seen[key] for key in sorted(seen)]


def acquire(
    leases: Sequence[HostLease],
    holder: Holder,
    conf: LeaseConf,
    on_wait: Callable[[str], None] = log.warning,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Take every lease, waiting for a live holder up to conf.wait_s; raises LeaseHeld (having given back
    what it took) when one stays held."""
    taken: list[HostLease] = []
    try:
        for lease in leases:
            _acquire_one(lease, holder, conf, on_wait, sleep)
            taken.append(lease)
    except BaseException:
        release(taken, holder)
        raise


def try_acquire(leases: Sequence[HostLease], holder: Holder, conf: LeaseConf) -> bool:
    """Take every lease now or none (a stale holder's is taken over): False, having given back what it
    took, when a live holder has one. How a pool outside Ray picks a free cluster (pool.py)."""
    here = socket.gethostname()
    taken: list[HostLease] = []
    for lease in leases:
        if not _take_now(lease, holder, conf, here)[0]:
            release(taken, holder)
            return False
        taken.append(lease)
    return True


def _take_now(lease: HostLease, holder: Holder, conf: LeaseConf, here: str) -> tuple[bool, Holder | None]:
    """Take the lease if it is free or its holder is gone (taken over first): (True, None); else
    (False, the live holder)."""
    while True:
        taken, current, age = lease.try_take(holder)
        if taken:
            return True, None
        if current is None and age == 0.0:
            continue  # it went away between the two checks: try again at once
        if not is_stale(current, age, conf.stale_after_s, here, local_start_time):
            return False, current
        who = current.describe() if current else "a holder that left no record"
        log.warning("lease on %s: %s is gone; taking the cluster over", lease.where, who)
        lease.take_over(current)


def _acquire_one(
    lease: HostLease,
    holder: Holder,
    conf: LeaseConf,
    on_wait: Callable[[str], None],
    sleep: Callable[[float], None],
) -> None:
    start = time.monotonic()
    last_said = -1e9
    here = socket.gethostname()
    while True:
        taken, current = _take_now(lease, holder, conf, here)
        if taken:
            return
        waited = time.monotonic() - start
        if waited >= conf.wait_s:
            raise LeaseHeld(lease.where, current, waited)
        if waited - last_said >= 30:
            who = current.describe() if current else "another study"
            on_wait(f"cluster {lease.where} is held by {who}; waiting (up to {conf.wait_s:.0f}s)")
            last_said = waited
        sleep(min(conf.poll_s, max(0.05, conf.wait_s - waited)))


def release(leases: Sequence[HostLease], holder: Holder) -> None:
    """Give every lease back (never raises: used in teardown)."""
    for lease in reversed(list(leases)):
        try:
            lease.release(holder)
        except Exception as e:
            log.error("could not release the lease on %s: %s", lease.where, e)


@contextmanager
def renewing(every_s: float | None, renew: Callable[[], None], name: str) -> Iterator[None]:
    """Call `renew` every `every_s` seconds on a daemon thread while the block runs (None: never);
    the thread is stopped and joined before the block's exit goes on. How whatever is held for a block
    stays alive: the host leases' heartbeat here, a pool member's renewal (pool.held). `renew` handles
    its own failures: a missed beat is retried at the next one."""
    if every_s is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            renew()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@contextmanager
def hosts_held(
    leases: Sequence[HostLease], holder: Holder, conf: LeaseConf, on_wait: Callable[[str], None] = log.warning
) -> Iterator[None]:
    """Hold the cluster's hosts for the block: acquired, kept alive by a heartbeat, released at the end."""
    acquire(leases, holder, conf, on_wait)

    def beat() -> None:
        for lease in leases:
            try:
                lease.heartbeat(holder)
            except Exception as e:  # a missed beat is retried; only a long outage makes the lease stale
                log.warning("lease heartbeat on %s failed: %s", lease.where, e)

    try:
        with renewing(conf.heartbeat_s, beat, "lease-heartbeat"):
            yield
    finally:
        release(leases, holder)
