"""A pool of PD clusters (`cluster_pool=NAME`): which cluster an arm runs on, held for the whole arm.

An arm takes one member of its pool before anything is planned against hosts, holds it through preflight,
co-restart, stress, bench and teardown, and gives it back in `finally`. Who decides which member:

- **Under Ray** (the job runs in a Ray task: `hydra/launcher=heisenhunt_ray`, or Hydra's own `ray`), one
  named Ray actor per pool, `PoolLessor`, in the Ray cluster (namespace "heisenhunt", detached, so every
  study on that Ray cluster shares it). It grants a free member, or makes the taker wait. The holder
  renews its lease every `lease_ttl_s / 4`; a holder silent for `lease_ttl_s` is lost (its worker or node
  died), and so is one whose Ray task the launcher saw fail (`lose_task`, at once). A lost member comes
  back marked lost: whoever takes it next first marks the lost arm's MLflow run FAILED with the reason,
  and its co-restart stops what the lost arm left running before anything starts; a member still lost
  when the sweep ends is torn down then (`clean_up_lost`, from the study callback).
- **Elsewhere** (Hydra's basic launcher, or joblib on one host), the host-side leases of lease.py decide:
  the first member whose host leases are all free is taken. There is no second lease mechanism.

Either way the member's host leases (lease.py) are taken at once with the grant (`HostLeases`) and the arm
holds them under the same holder to its last teardown step (`arm.run_arm`), so a study started by hand on
a member's hosts and a pooled arm never run there at once. Under Ray a member whose hosts are held that
way is set aside for a while (`set_aside`) and the job asks for another, instead of waiting on it.

The lease state is a pure value (`PoolState`, its transitions plain functions); the Ray actor only
holds it and wakes waiters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from orchestrator.config.schema import ClusterPoolConf, JobConf
from orchestrator.run import lease as host_lease

log = logging.getLogger(__name__)

NAMESPACE = "heisenhunt"
BY_RAY, BY_HOST_LEASES = "ray", "host leases"


# --- the lease state (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolHolder:
    """Who holds a member: the process that takes the member's host leases (`host_holder`, the one
    holder type of lease.py: its label, machine and pid), and what the pool adds for recovery (its run,
    where it is recorded) and for Ray (its task, to be told apart when the launcher sees that task fail)."""

    label: str
    study: str
    tracking_uri: str
    task_id: str | None = None
    run_id: str | None = None
    host_holder: host_lease.Holder | None = None  # None: this process, under `label`

    def __post_init__(self) -> None:
        if self.host_holder is None:
            object.__setattr__(self, "host_holder", host_lease.Holder.this_process(self.label))

    def describe(self) -> str:
        who = self.host_holder
        assert who is not None  # filled in at construction
        where = f"pid {who.pid} on {who.hostname}" + (
            f", Ray task {self.task_id[:12]}" if self.task_id else ""
        )
        return f"{self.label} ({where})"


@dataclass(frozen=True)
class PoolLease:
    member: str
    token: str
    holder: PoolHolder
    since: float  # unix time
    beat: float


@dataclass(frozen=True)
class LostLease:
    """A lease whose holder was lost before giving it back: its member may still run that arm's servers."""

    lease: PoolLease
    reason: str
    at: float


@dataclass(frozen=True)
class Grant:
    """What a taker gets: its lease, and the lost lease it found on that member (to recover first)."""

    lease: PoolLease
    lost: LostLease | None = None
    by: str = BY_RAY

    @property
    def member(self) -> str:
        return self.lease.member

    @property
    def host_holder(self) -> host_lease.Holder | None:
        """The lease.py holder that took the member's host leases (the arm holds them under it)."""
        return self.lease.holder.host_holder


@dataclass
class PoolState:
    members: tuple[str, ...]
    leases: dict[str, PoolLease] = field(default_factory=dict)
    lost: dict[str, LostLease] = field(default_factory=dict)
    # members found held outside the pool (a study started by hand on their hosts), skipped until then
    busy_until: dict[str, float] = field(default_factory=dict)


def expire(state: PoolState, now: float, ttl_s: float) -> list[LostLease]:
    """Leases not renewed within ttl_s become lost; returns those."""
    gone = []
    for member, lease in list(state.leases.items()):
        if now - lease.beat > ttl_s:
            reason = (
                f"its holder, {lease.holder.describe()}, stopped renewing its lease on {member} "
                f"{now - lease.beat:.0f}s before (its Ray worker or node was lost)"
            )
            gone.append(_lose(state, member, reason, now))
    return gone


def _lose(state: PoolState, member: str, reason: str, now: float) -> LostLease:
    lost = LostLease(state.leases.pop(member), reason, now)
    state.lost[member] = lost
    return lost


def take(
    state: PoolState, holder: PoolHolder, now: float, token: str, only: Sequence[str] | None = None
) -> Grant | None:
    """The first free member, a lost one first (taking it tears down what its lost arm left running, and
    gives the pool its capacity back), leased to `holder`; None when all are held."""
    free = [
        m
        for m in state.members
        if m not in state.leases and state.busy_until.get(m, 0.0) <= now and (only is None or m in only)
    ]
    if not free:
        return None
    member = min(free, key=lambda m: m not in state.lost)  # stable: pool order, lost ones first
    lease = PoolLease(member=member, token=token, holder=holder, since=now, beat=now)
    state.leases[member] = lease
    return Grant(lease=lease, lost=state.lost.pop(member, None))


def renew(state: PoolState, member: str, token: str, now: float, run_id: str | None = None) -> bool:
    """Renew a lease (and record its holder's run); False when it is no longer this token's."""
    lease = state.leases.get(member)
    if lease is None or lease.token != token:
        return False
    holder = dataclasses.replace(lease.holder, run_id=run_id) if run_id else lease.holder
    state.leases[member] = dataclasses.replace(lease, beat=now, holder=holder)
    return True


def give_back(state: PoolState, member: str, token: str) -> bool:
    lease = state.leases.get(member)
    if lease is None or lease.token != token:
        return False
    del state.leases[member]
    return True


def set_aside(state: PoolState, grant: Grant, until: float) -> bool:
    """Give a granted member back unused, skipped by `take` until `until`: its hosts are held outside the
    pool. A lost lease it carried stays to be recovered by whoever takes it next."""
    if not give_back(state, grant.member, grant.lease.token):
        return False
    state.busy_until[grant.member] = until
    if grant.lost is not None:
        state.lost[grant.member] = grant.lost
    return True


def next_change(state: PoolState, now: float, ttl_s: float) -> float:
    """How long a waiting taker sleeps at most before looking again: a quarter of the lease ttl, or
    until the first member set aside comes back."""
    back = [t - now for t in state.busy_until.values() if t > now]
    return max(0.05, min([ttl_s / 4, *back]))


def lose_task(state: PoolState, task_id: str, reason: str, now: float) -> LostLease | None:
    """The launcher saw this Ray task fail: its lease (if it still holds one) is lost now."""
    for member, lease in list(state.leases.items()):
        if lease.holder.task_id == task_id:
            return _lose(state, member, reason, now)
    return None


# --- the Ray actor ---------------------------------------------------------------------------------------


class PoolLessor:
    """The Ray actor of one pool (async: a waiting taker does not block the others)."""

    def __init__(self, members: Sequence[str], ttl_s: float):
        self.state = PoolState(members=tuple(members))
        self.ttl_s = float(ttl_s)
        self.changed: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self.changed is None:  # made on the actor's own event loop
            self.changed = asyncio.Condition()
        return self.changed

    async def acquire(
        self, holder: PoolHolder, only: Sequence[str] | None = None, timeout_s: float | None = None
    ) -> Grant | None:
        cond, deadline = self._cond(), None if timeout_s is None else time.time() + timeout_s
        async with cond:
            while True:
                now = time.time()
                expire(self.state, now, self.ttl_s)
                grant = take(self.state, holder, now, uuid.uuid4().hex, only)
                if grant is not None or (deadline is not None and now >= deadline):
                    return grant
                wait = next_change(self.state, now, self.ttl_s)
                wait = wait if deadline is None else min(wait, deadline - now)
                with suppress(TimeoutError):
                    await asyncio.wait_for(cond.wait(), timeout=max(0.05, wait))

    async def renew(self, member: str, token: str, run_id: str | None = None) -> bool:
        return renew(self.state, member, token, time.time(), run_id)

    async def release(self, member: str, token: str) -> bool:
        cond = self._cond()
        async with cond:
            done = give_back(self.state, member, token)
            cond.notify_all()
        return done

    async def set_aside(self, grant: Grant, for_s: float) -> bool:
        cond = self._cond()
        async with cond:
            done = set_aside(self.state, grant, time.time() + for_s)
            cond.notify_all()
        return done

    async def lose_task(self, task_id: str, reason: str) -> LostLease | None:
        cond = self._cond()
        async with cond:
            lost = lose_task(self.state, task_id, reason, time.time())
            cond.notify_all()
        return lost

    async def lost_members(self) -> list[str]:
        expire(self.state, time.time(), self.ttl_s)
        return sorted(m for m in self.state.lost if m not in self.state.leases)


def actor_name(pool: ClusterPoolConf) -> str:
    """One actor per pool and membership: a pool redefined with other clusters gets its own."""
    members = ",".join(
        f"{m}={c.hosts.prefill.address}:{c.hosts.prefill.port}" for m, c in sorted(pool.clusters.items())
    )
    return f"heisenhunt-pool-{pool.name}-{hashlib.sha256(members.encode()).hexdigest()[:10]}"


def pool_actor(pool: ClusterPoolConf, create: bool = True) -> Any:
    """The pool's lessor actor in the connected Ray cluster (created by the first taker), or None."""
    import ray

    name = actor_name(pool)
    if not create:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
    return (
        ray.remote(PoolLessor)
        .options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote(sorted(pool.clusters), pool.lease_ttl_s)
    )


def awaited(ref: Any, timeout_s: float | None = None, poll_s: float = 0.5) -> Any:
    """`ray.get(ref)` for a job waiting on the pool's actor, without telling Ray that the job is blocked: Ray
    lends a blocked task's CPU to the next job queued, starting a worker for it (a cold interpreter, seconds
    of CPU beside the arms running), and that job then waits on the pool too. Polled, so that a cancelled
    job's KeyboardInterrupt (Ctrl-C) still arrives within `poll_s`."""
    future = ref.future()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
        try:
            return future.result(timeout=max(0.0, left))
        except TimeoutError:  # (concurrent.futures' is the builtin)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from the pool's lessor in {timeout_s:.0f}s") from None


def in_ray_task() -> bool:
    """Whether this process is a Ray worker running a task (then Ray decides who runs where)."""
    import sys

    if "ray" not in sys.modules:  # a Ray worker has imported it; nothing else needs to
        return False
    import ray

    return bool(ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


# --- who decides: the lessors ---------------------------------------------------------------------------


class Lessor(Protocol):
    def acquire(self, holder: PoolHolder) -> Grant: ...
    def renew(self, grant: Grant, run_id: str | None = None) -> bool: ...
    def release(self, grant: Grant) -> None: ...

    renew_every_s: float | None


class HostLeases:
    """A member's host leases (lease.py), taken now or not at all, and given back: how both lessors make
    sure a member is not held outside the pool (a study started by hand on its hosts)."""

    def __init__(
        self,
        pool: ClusterPoolConf,
        make_transports: Callable[[Mapping[str, Any]], Mapping[str, Any]],
        close_all: Callable[[Mapping[str, Any]], None],
    ):
        self.pool = pool
        self.make_transports = make_transports
        self.close_all = close_all
        self.taken: dict[str, tuple[list, Mapping[str, Any]]] = {}

    def try_take(self, member: str, holder: host_lease.Holder) -> bool:
        cluster = self.pool.clusters[member]
        hosts = _hosts(cluster)
        transports = self.make_transports(hosts)
        leases = host_lease.cluster_leases(transports, {role: host.work_dir for role, host in hosts.items()})
        if not host_lease.try_acquire(leases, holder, cluster.lease):
            self.close_all(transports)
            return False
        self.taken[member] = (leases, transports)
        return True

    def give_back(self, member: str, holder: host_lease.Holder) -> None:
        """(After the arm gave them back itself, a no-op: a lease is released only by its holder.)"""
        leases, transports = self.taken.pop(member, ([], {}))
        host_lease.release(leases, holder)
        self.close_all(transports)


class RayLessor:
    """The pool's Ray actor, from a job running in a Ray task. A member it grants whose hosts turn out to
    be held outside the pool is set aside for a while and another asked for."""

    def __init__(self, pool: ClusterPoolConf, hosts: HostLeases):
        self.actor = pool_actor(pool)
        self.hosts = hosts
        self.renew_every_s: float | None = pool.lease_ttl_s / 4

    def acquire(self, holder: PoolHolder) -> Grant:
        import ray

        context = ray.get_runtime_context()
        holder = dataclasses.replace(holder, task_id=context.get_task_id())
        while True:
            grant = awaited(self.actor.acquire.remote(holder))
            if self.hosts.try_take(grant.member, grant.host_holder):
                return grant
            wait_s = 5 * self.hosts.pool.clusters[grant.member].lease.poll_s
            log.warning(
                "cluster pool: %s is held outside the pool (a study started by hand on its hosts?); set "
                "aside for %.0fs, asking for another",
                grant.member,
                wait_s,
            )
            awaited(self.actor.set_aside.remote(grant, wait_s))

    def renew(self, grant: Grant, run_id: str | None = None) -> bool:
        return bool(awaited(self.actor.renew.remote(grant.member, grant.lease.token, run_id), timeout_s=30))

    def release(self, grant: Grant) -> None:
        try:
            awaited(self.actor.release.remote(grant.member, grant.lease.token), timeout_s=30)
        finally:
            self.hosts.give_back(grant.member, grant.host_holder)


class HostLeaseLessor:
    """Outside Ray: the first member whose host leases are all free; waits while all are held. The grant
    keeps the host leases taken, under the holder `arm.run_arm` is then given, so the arm holds them from
    the pick to its last teardown step."""

    def __init__(self, pool: ClusterPoolConf, hosts: HostLeases):
        self.pool = pool
        self.hosts = hosts
        self.renew_every_s: float | None = None  # the arm's own host leases beat (lease.hosts_held)

    def acquire(self, holder: PoolHolder) -> Grant:
        conf = next(iter(self.pool.clusters.values())).lease
        lease_holder = holder.host_holder
        start, said = time.monotonic(), -1e9
        while True:
            for member in self.pool.clusters:
                if self.hosts.try_take(member, lease_holder):
                    now = time.time()
                    lease = PoolLease(member, lease_holder.id, holder, now, now)
                    return Grant(lease=lease, by=BY_HOST_LEASES)
            waited = time.monotonic() - start
            if waited >= conf.wait_s:
                raise host_lease.LeaseHeld(f"every cluster of pool {self.pool.name}", None, waited)
            if waited - said >= 30:
                log.warning(
                    "every cluster of pool %s is held; waiting (up to %.0fs)", self.pool.name, conf.wait_s
                )
                said = waited
            time.sleep(conf.poll_s)

    def renew(self, grant: Grant, run_id: str | None = None) -> bool:
        return True

    def release(self, grant: Grant) -> None:
        self.hosts.give_back(grant.member, grant.host_holder)


def _hosts(cluster: Any) -> dict[str, Any]:
    from orchestrator.config.schema import ROLES

    return {role: getattr(cluster.hosts, role) for role in ROLES}


def lessor_for(pool: ClusterPoolConf) -> Lessor:
    from orchestrator.remote import close_all, make_transports

    hosts = HostLeases(pool, make_transports, close_all)
    return RayLessor(pool, hosts) if in_ray_task() else HostLeaseLessor(pool, hosts)


# --- holding a member for a whole arm -------------------------------------------------------------------


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="microseconds")


def lease_tags(pool: ClusterPoolConf, grant: Grant) -> dict[str, str]:
    """What a run records of where it ran (the end is tagged when the lease is given back)."""
    cluster = pool.clusters[grant.member]
    tags = {
        "cluster": cluster.name,
        "cluster_pool": pool.name,
        "cluster_pool.member": grant.member,
        "lease.by": grant.by,
        "lease.start": iso(grant.lease.since),
        "lease.holder": grant.lease.holder.describe(),
    }
    if grant.lost is not None:
        tags["lease.recovered_from"] = grant.lost.reason
    return tags


class Hold:
    """A member held for an arm: the grant, and the arm's run once it exists (told to the lessor, so that
    recovery after a lost worker can mark that run FAILED)."""

    def __init__(self, grant: Grant, lessor: Lessor | None = None):
        self.grant = grant
        self.run_id: str | None = None
        self._lessor = lessor

    @property
    def member(self) -> str:
        return self.grant.member

    def record_run(self, run_id: str) -> None:
        """The arm's run, told to the lessor now. Left to the next renewal (a quarter of the lease's ttl
        later), a worker lost in between left a lease naming no run, and its run RUNNING for good."""
        self.run_id = run_id
        if self._lessor is None:
            return
        try:
            self._lessor.renew(self.grant, run_id)
        except Exception as e:  # the renewal thread tells it at its next beat
            log.warning("could not tell the pool's lessor the run on %s yet: %s", self.member, e)


@contextmanager
def held(lessor: Lessor, holder: PoolHolder, on_end: Callable[[Hold, float], None]) -> Iterator[Hold]:
    """A member for the block: taken, renewed while the block runs (lease.renewing), given back at the
    end, then `on_end(hold, end_time)`."""
    hold = Hold(lessor.acquire(holder), lessor)
    log.info("cluster pool: %s leased to this arm (by %s)", hold.member, hold.grant.by)

    def renew() -> None:
        try:
            if not lessor.renew(hold.grant, hold.run_id):
                log.error(
                    "the lease on %s was declared lost while this arm ran: a later arm may restart it",
                    hold.member,
                )
        except Exception as e:  # retried at the next beat; only a long outage loses the lease
            log.warning("lease renewal on %s failed: %s", hold.member, e)

    try:
        with host_lease.renewing(lessor.renew_every_s or None, renew, "pool-lease"):
            yield hold
    finally:
        end = time.time()
        try:
            lessor.release(hold.grant)
        except Exception as e:
            log.error(
                "could not give %s back to the pool (it comes back when its lease expires): %s",
                hold.member,
                e,
            )
        on_end(hold, end)


# --- recovery of a lost member --------------------------------------------------------------------------


def mark_lost_run(lost: LostLease, found_by: str) -> None:
    """The lost arm's MLflow run ends FAILED with the reason (if it is still RUNNING)."""
    from orchestrator.tracking.write import end_lost_run

    run_id = lost.lease.holder.run_id
    if not run_id:
        log.warning(
            "the lost lease on %s names no run (its holder died before starting one)", lost.lease.member
        )
        return
    member = lost.lease.member
    reason = (
        f"lost while it held cluster {member} of its pool: {lost.reason}; {member} is torn down before "
        f"any other arm runs there (found {found_by})"
    )
    end_lost_run(lost.lease.holder.tracking_uri, run_id, reason, iso(lost.at))


def teardown_member(job: JobConf, member: str) -> list[str]:
    """Stop what a lost arm left running on a member, under that member's host leases (a study started by
    hand meanwhile keeps its servers). Returns the problems met."""
    from orchestrator.config.plan import on_cluster, plan_arm
    from orchestrator.remote import close_all, make_transports
    from orchestrator.run.deploy import Deployment

    plan = plan_arm(on_cluster(job, member))
    transports = make_transports({role: rp.host for role, rp in plan.roles.items()})
    holder = host_lease.Holder.this_process(f"study {job.study.name}: tearing down {member} after a lost arm")
    work_dirs = {role: rp.host.work_dir for role, rp in plan.roles.items()}
    try:
        with host_lease.hosts_held(
            host_lease.cluster_leases(transports, work_dirs), holder, job.cluster.lease
        ):
            return Deployment(plan, transports, run_label="pool-recovery").stop_all()
    finally:
        close_all(transports)


def clean_up_lost(job: JobConf) -> list[str]:
    """At the end of a sweep under Ray: every member of the job's pool still lost is taken, its lost run
    marked FAILED, its servers stopped, and given back. Returns the members cleaned."""
    import ray

    assert job.cluster_pool is not None
    if not ray.is_initialized():
        return []
    actor = pool_actor(job.cluster_pool, create=False)
    if actor is None:
        return []
    cleaned = []
    for member in ray.get(actor.lost_members.remote()):
        holder = PoolHolder(
            f"study {job.study.name}: end-of-sweep clean-up", job.study.name, job.tracking.uri
        )
        grant = ray.get(actor.acquire.remote(holder, [member], 5.0))
        if grant is None:
            continue  # another study took it: its co-restart stops the leftovers
        try:
            if grant.lost is not None:
                log.warning("cluster pool: %s was lost (%s); tearing it down", member, grant.lost.reason)
                mark_lost_run(grant.lost, "at the end of the sweep")
                problems = teardown_member(job, member)
                if problems:
                    log.error("tearing down %s: %s", member, problems)
                cleaned.append(member)
        finally:
            ray.get(actor.release.remote(member, grant.lease.token))
    return cleaned
