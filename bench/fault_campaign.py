"""A fault campaign: many short studies on the embedded default, one fault per arm at a random moment of a
random phase, and invariants checked over the whole history afterwards (in the manner of Jepsen: a
workload under a generator of faults, a checker over what was recorded).

    python bench/fault_campaign.py --faults 500 --seed 1 --json /tmp/faults-local.json
    python bench/fault_campaign.py --cluster ssh --faults 100      # every role over a real sshd
    python bench/fault_campaign.py --cluster ray --faults 50       # a Ray pool of two clusters
    python bench/fault_campaign.py --replay 1234567 --cluster local    # one episode again, by its seed

An episode is one study (`python -m orchestrator -m`, `--arms` arms: multi_stream on/off x repetitions) in
a sandbox of its own (free ports, work dirs, a sqlite MLflow store). A watcher reads the arms' progress
files and pid files, and when an arm reaches the phase drawn for it (preflight, start-up, health gate,
stress, bench, teardown, hand-over) it waits a random moment and injects the arm's fault:

- SIGKILL of prefill, decode or router; SIGSTOP of decode, with SIGCONT later or never;
- SIGINT, a double SIGINT, SIGTERM or SIGKILL of the orchestrator, then `resume=true` (faulted too);
- the tracking store locked (sqlite `BEGIN EXCLUSIVE`) for a few seconds;
- the hosts' work dirs on a small tmpfs of their own, filled up for a few seconds;
- a second study started on the same cluster;
- (ssh) every SSH session cut at sshd; (ray) SIGINT of the driver, SIGKILL of the worker running an arm.

Then, over every run in the store and every process on the machine:

- orphans: a process group named by a pid file still alive, a sandbox port still listening;
- finished_lost: a FINISHED run with complete outcomes that the final report does not pool;
- pooled_twice: a run pooled in two arms, or two runs of one (signature, repetition) pooled;
- unexplained_states: a run not FINISHED/FAILED/KILLED, or one whose status and reason the fault it got
  does not explain (`explained`); a sweep that hung; leases left behind;
- rebuild_mismatch: the report rebuilt from MLflow alone differs from the one the study wrote (after a
  resume this is "the verdicts equal an uninterrupted study's over the same runs").

Each failure carries its episode's seed; `--replay SEED` runs that episode alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from orchestrator.run.progress import ArmProgress, progress_dir, read_progress  # noqa: E402
from tests import warm  # noqa: E402
from tests.conftest import (  # noqa: E402
    free_port,
    local_cluster_overrides,
    pool_overrides,
    seed_mlflow_store,
    sim_clock,
)

ROLES = ("prefill", "decode", "router")
PHASES = ("preflight", "start-up", "health gate", "stress", "bench", "teardown", "hand-over")
SERVERS_UP = ("start-up", "health gate", "stress", "bench", "teardown")
STUDY = "campaign"
SECOND = "campaign-second"
# short arms: a few sessions, a tiny throughput sweep (on repetition 0), short timeouts
ARM = [
    "workload.sessions=6",
    "workload.rounds=2",
    "workload.concurrency=3",
    "workload.timeout_s=6",
    "bench.concurrency=[1,2]",
    "bench.requests_per_worker=1",
    "bench.output_len=16",
    "bench.timeout_s=6",
    "bench.warmup_requests=0",
    "deployment.stop_grace_s=2",
    "deployment.roles.prefill.startup_timeout_s=20",
    "deployment.roles.decode.startup_timeout_s=20",
    "deployment.roles.router.startup_timeout_s=20",
]
SWEEP_TIMEOUT_S = 300
# every orchestrator the campaign started and has not seen end: a Ctrl-C of the campaign stops them
RUNNING: set[subprocess.Popen] = set()


@dataclass(frozen=True)
class Kind:
    phases: tuple[str, ...]
    clusters: tuple[str, ...] = ("local", "ssh")
    ends_sweep: bool = False  # the orchestrator's own death or interrupt: a resume follows


KINDS: dict[str, Kind] = {
    "kill_prefill": Kind(SERVERS_UP, ("local", "ssh", "ray")),
    "kill_decode": Kind(SERVERS_UP, ("local", "ssh", "ray")),
    "kill_router": Kind(SERVERS_UP, ("local", "ssh", "ray")),
    "hang_decode": Kind(("health gate", "stress", "bench"), ("local", "ssh", "ray")),
    "hang_decode_never": Kind(("stress", "bench")),
    "sigint": Kind(PHASES, ("local", "ssh", "ray"), ends_sweep=True),
    "sigint_twice": Kind(PHASES, ends_sweep=True),
    "sigterm": Kind(PHASES, ends_sweep=True),
    "sigkill": Kind(PHASES, ends_sweep=True),
    "store_locked": Kind(("start-up", "stress", "bench", "teardown", "hand-over"), ("local", "ssh", "ray")),
    "disk_full": Kind(("preflight", "start-up", "stress", "teardown")),
    "second_study": Kind(("preflight", "stress", "hand-over")),
    "ssh_cut": Kind(("preflight", "start-up", "health gate", "stress", "teardown"), ("ssh",)),
    "worker_kill": Kind(("start-up", "stress"), ("ray",)),
}
# the longest wait after a phase begins, about its length in these short arms at the sim's default clock
# (0.2): a moment inside it (at 0.05 the phases shrank under these delays, and 38% of an SSH campaign's
# faults landed in teardown instead of 20%)
PHASE_DELAY_S = {"preflight": 0.3, "start-up": 0.8, "health gate": 0.8, "stress": 1.2, "bench": 0.4,
                 "teardown": 0.2, "hand-over": 0.3}  # fmt: skip
# the sim's clock those delays are for (the embedded default's), and the phases it paces: the sim's model
# load, and its tokens; a campaign at another clock scales these phases' delays with it
DEFAULT_CLOCK = 0.2
SIM_PACED = ("start-up", "health gate", "stress", "bench")
NO_FAULT = 0.08  # the share of arms that get none: they must simply finish

# what explains a run's end, per fault (its reason is matched; FINISHED where the fault may be survived)
DEATH = r"\b(prefill|decode|router)\b.*(died|exited|not healthy|warm-up request failed|no longer running)"
INTERRUPTED = r"interrupted|signal \d+"
LATE = ("teardown", "hand-over", "after")  # the arm's measurement was over when the fault came


def explained(kind: str | None, phase: str, status: str, reason: str) -> bool:
    """Whether a run that ended `status` with `reason` is what fault `kind`, injected in `phase`, leads
    to (pure). Every fault may also leave a run FINISHED when it came after the measurement."""
    if status not in ("FINISHED", "FAILED", "KILLED"):
        return False
    if status == "FINISHED" and (kind is None or phase in LATE):
        return True

    def failed(pattern: str) -> bool:
        return status == "FAILED" and re.search(pattern, reason) is not None

    if kind is None:
        return False
    if kind.startswith("kill_"):
        return failed(DEATH)
    if kind.startswith("hang_"):
        return status == "FINISHED" or failed(DEATH + r"|timed out|timeout|not healthy")
    if kind in ("sigint", "sigint_twice", "sigterm"):
        return status == "KILLED" and re.search(INTERRUPTED, reason) is not None
    if kind == "sigkill":
        return failed(r"orchestrator process .* died")
    if kind == "store_locked":
        return status == "FINISHED" or failed(r"database is locked")
    if kind == "disk_full":
        return status == "FINISHED" or failed(r"No space left|I/O error|cannot write|" + DEATH)
    if kind == "second_study":
        return status == "FINISHED"
    if kind == "ssh_cut":
        # (a persistent shell's session is an SSH session: "the shell running `...` ended")
        return status == "FINISHED" or failed(r"(?i)ssh|connection|channel|socket|EOF|shell")
    if kind == "worker_kill":
        return failed(r"Ray worker was lost")
    raise ValueError(f"unknown fault kind {kind!r}")


# --- the sandbox of one episode -------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str | None
    phase: str
    delay_s: float
    job: int
    attempt: int
    injected_phase: str = ""
    injected: bool = False
    note: str = ""
    at: float = 0.0  # wall clock (time.time(), as the progress files), when it was injected
    until: float = 0.0  # and when its effect ended (a disk freed, a lock let go), as far as is known


@dataclass
class Sandbox:
    root: Path
    cluster: str  # local | ssh | ray
    cluster_overrides: list[str]
    ports: set[int]
    env: dict[str, str]
    tight: Path | None = None  # the hosts' work dirs' small filesystem (disk_full), if it could be made
    clock: float = DEFAULT_CLOCK  # the sim's (HEISENHUNT_SIM_TIME_SCALE)

    @property
    def db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.db}"

    def sweep_dir(self, name: str) -> Path:
        return self.root / "sweeps" / name

    def argv(self, study: str, sweep: str, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "orchestrator", "-m", *self.cluster_overrides,
            f"tracking.uri={self.uri}", f"report.dir={self.root}/reports", f"study.name={study}",
            f"hydra.sweep.dir={self.sweep_dir(sweep)}", "hydra.sweep.subdir=${hydra.job.num}", *ARM,
            *(sim_clock(self.clock) if self.clock != DEFAULT_CLOCK else ()),
            *extra,
        ]  # fmt: skip

    def delay_s(self, phase: str) -> float:
        """The longest wait after `phase` begins for a fault drawn into it, at this sandbox's clock."""
        return PHASE_DELAY_S[phase] * (self.clock / DEFAULT_CLOCK if phase in SIM_PACED else 1.0)

    def start(self, argv: list[str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:  # forked from a warm zygote where that runs it as exec would
            proc = warm.popen(
                argv,
                cwd=self.root,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: a fault to it is not one to the campaign
            )
        RUNNING.add(proc)
        return proc

    @property
    def work_dirs(self) -> list[Path]:
        """Every host work dir of the sandbox, as the cluster overrides name them."""
        return sorted({Path(o.split("=", 1)[1]) for o in self.cluster_overrides if ".work_dir=" in o})

    def pid_files(self) -> list[Path]:
        return [
            wd / f"{wd.name.split('-')[-1]}.pid"
            for wd in self.work_dirs
            if (wd / f"{wd.name.split('-')[-1]}.pid").exists()
        ]

    def role_pid_file(self, role: str, job: ArmProgress | None = None) -> Path | None:
        """The pid file of `role` on the cluster this job runs on (a pool: the member its lease names),
        written since the job began: one older names a server an earlier (killed) sweep left running."""
        if self.cluster != "ray":
            found = [p for p in self.pid_files() if p.name == f"{role}.pid"]
            path = found[0] if found else None
            # and the cluster is this arm's: a second study may hold it meanwhile
            if path is not None and job is not None and not self.leased_to(path.parent, job):
                return None
        else:
            member = self.member_of(job)
            path = self.root / f"{member}-{role}" / f"{role}.pid" if member else None
        try:
            return path if path and (job is None or path.stat().st_mtime >= self.since(job, path)) else None
        except OSError:
            return None

    def since(self, job: ArmProgress, pid_file: Path) -> float:
        """When the job's own servers can have been written: after it began and after it took the lease
        of their cluster. A job of a pool waits for its lease; the servers of an arm whose Ray worker was
        killed stay until the next holder's co-restart stops them, with pid files written after the
        waiting job began: the checker's own mistake once (seed 2087043557, a decode killed in the
        "health gate" of an arm that then FINISHED: the decode was the killed arm's)."""
        lease = pid_file.parent.parent / f"{pid_file.parent.name.rsplit('-', 1)[0]}-prefill" / "lease"
        try:
            taken = (lease / "holder.json").stat().st_mtime
        except OSError:
            taken = 0.0
        return max(job.started, taken)

    @staticmethod
    def leased_to(work_dir: Path, job: ArmProgress) -> bool:
        """The work dir's lease names this job's arm (both launchers' holders say "study S, arm A #r")."""
        try:
            label = json.loads((work_dir / "lease" / "holder.json").read_text()).get("label", "")
        except (OSError, ValueError):
            return False
        return f"study {STUDY}, arm {job.label} #{job.repetition}" in label

    def member_of(self, job: ArmProgress | None) -> str | None:
        if job is None:
            return None
        for work_dir in self.root.glob("*-prefill"):
            if self.leased_to(work_dir, job):
                return work_dir.name.split("-")[0]
        return None

    def holder_pid(self, job: ArmProgress) -> int | None:
        member = self.member_of(job)
        with contextlib.suppress(OSError, ValueError, KeyError):
            return int(
                json.loads((self.root / f"{member}-prefill" / "lease" / "holder.json").read_text())["pid"]
            )
        return None


def pid_of(path: Path | None) -> int | None:
    try:
        first = path.read_text().splitlines()[0].strip() if path else ""
    except (OSError, IndexError):
        return None
    return int(first) if first.isdigit() else None


def live_groups() -> dict[int, list[str]]:
    """pgid -> the states of its live (non-zombie) processes, from /proc."""
    groups: dict[int, list[str]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            groups[int(fields[2])].append(fields[0])
    return groups


def listening_ports() -> set[int]:
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


# --- injecting -----------------------------------------------------------------------------------------


class Injector(threading.Thread):
    """Watches one sweep's arms and injects each arm's fault at its moment."""

    def __init__(self, sb: Sandbox, sweep: str, proc: subprocess.Popen, rng: random.Random, attempt: int,
                 kinds: list[str], allow_ending: bool, side: list[subprocess.Popen]) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.sb, self.sweep, self.proc, self.rng, self.attempt = sb, sweep, proc, rng, attempt
        self.kinds, self.allow_ending, self.side = kinds, allow_ending, side
        self.faults: dict[int, Fault] = {}
        self.ended_by: Fault | None = None
        self.timers: list[threading.Timer] = []

    def draw(self, job: ArmProgress) -> Fault:
        kinds = [k for k in self.kinds if self.allow_ending or not KINDS[k].ends_sweep]
        if not kinds or self.ended_by is not None or self.rng.random() < NO_FAULT:
            return Fault(None, "", 0.0, job.job, self.attempt)
        # only repetition 0 runs the throughput sweep (bench.repetitions' default)
        kinds = [k for k in kinds if job.repetition == 0 or KINDS[k].phases != ("bench",)]
        # a fault that ends the sweep costs a resume (a new process, the arms left): drawn half as often
        weights = [0.5 if KINDS[k].ends_sweep else 1.0 for k in kinds]
        kind = self.rng.choices(kinds, weights)[0]
        phases = [p for p in KINDS[kind].phases if p != "bench" or job.repetition == 0]
        phase = self.rng.choice(phases)
        return Fault(kind, phase, self.rng.uniform(0.0, self.sb.delay_s(phase)), job.job, self.attempt)

    def phase_of(self, job: ArmProgress, by_job: dict[int, ArmProgress]) -> str:
        if job.phase == "done":
            later = [j for j in by_job if j > job.job]
            return "after" if later else "hand-over"
        if job.phase != "start-up":
            return job.phase
        if self.sb.role_pid_file("router", job):
            return "health gate"
        if self.sb.role_pid_file("prefill", job) or self.sb.role_pid_file("decode", job):
            return "start-up"
        return "preflight"

    def run(self) -> None:
        due: dict[int, float] = {}
        folder = progress_dir(self.sb.sweep_dir(self.sweep))
        while self.proc.poll() is None:
            by_job = {p.job: p for p in read_progress(folder)}
            for num, job in by_job.items():
                if num not in self.faults:
                    self.faults[num] = self.draw(job)
                fault = self.faults[num]
                if fault.kind is None or fault.injected or self.ended_by is not None:
                    continue
                now = time.monotonic()
                if num not in due and self.phase_of(job, by_job) == fault.phase:
                    due[num] = now + fault.delay_s
                if num in due and now >= due[num]:
                    fault.injected_phase = self.phase_of(job, by_job)
                    fault.at = fault.until = time.time()
                    fault.injected = self.inject(fault, job)
                    if fault.injected and KINDS[fault.kind].ends_sweep:
                        self.ended_by = fault
            time.sleep(0.02)

    def inject(self, fault: Fault, job: ArmProgress) -> bool:
        kind, sb = fault.kind, self.sb
        assert kind is not None
        if kind.startswith(("kill_", "hang_")):
            role = kind.split("_")[1]
            pgid = pid_of(sb.role_pid_file(role, job))
            if not pgid:
                fault.note = f"no {role} pid file"
                return False
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if kind.startswith("kill_"):
                    os.killpg(pgid, signal.SIGKILL)
                else:
                    os.killpg(pgid, signal.SIGSTOP)
                    if kind == "hang_decode":
                        self.later(self.rng.uniform(0.3, 3.0), lambda: _cont(pgid))
            return True
        if kind in ("sigint", "sigterm", "sigint_twice", "sigkill"):
            if self.proc.poll() is not None:
                return False
            signum = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}.get(kind, signal.SIGINT)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)
                if kind == "sigint_twice":
                    time.sleep(0.2)
                    self.proc.send_signal(signal.SIGINT)
            return True
        if kind == "store_locked":
            threading.Thread(
                target=_lock_store, args=(sb.db, self.rng.uniform(1.0, 8.0)), daemon=True
            ).start()
            return True
        if kind == "disk_full":
            if sb.tight is None:
                fault.note = "no small filesystem"
                return False
            _fill(sb.tight)

            def unfill() -> None:
                _unfill(sb.tight)
                fault.until = time.time()

            fault.until = float("inf")
            self.later(self.rng.uniform(1.0, 4.0), unfill)
            return True
        if kind == "second_study":
            argv = sb.argv(SECOND, f"second-{self.attempt}-{fault.job}", "factor/multi_stream=off",
                           "repetition=0", "cluster.lease.wait_s=3")  # fmt: skip
            if sb.cluster == "ray":
                return False
            self.side.append(sb.start(argv, sb.root / "logs" / f"second-{self.attempt}-{fault.job}.log"))
            return True
        if kind == "ssh_cut":
            return _cut_ssh(sb.env["HH_SSHD_DIR"])
        if kind == "worker_kill":
            pid = sb.holder_pid(job)
            if not pid:
                fault.note = "no holder pid"
                return False
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return True
        raise ValueError(kind)

    def later(self, seconds: float, action) -> None:
        once = threading.Lock()  # the action runs once: from its timer, or from `finish`

        def run_once() -> None:
            if once.acquire(blocking=False):
                action()

        timer = threading.Timer(seconds, run_once)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)

    def finish(self) -> None:
        """The faults' own ends that are still due (a SIGCONT, a disk freed) happen now: a fault lasts
        at most as long as the sweep it was injected into, so the next attempt starts from a whole
        machine (a hang without an end is `hang_decode_never`, which has none to run)."""
        for timer in self.timers:
            timer.cancel()
            timer.function()  # (run_once: nothing, if the timer ran it already)


def _cont(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)


def _lock_store(db: Path, seconds: float) -> None:
    conn = sqlite3.connect(db, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        time.sleep(seconds)
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass
    finally:
        conn.close()


def _fill(mount: Path) -> None:
    with contextlib.suppress(OSError), (mount / "filler").open("wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()


def _unfill(mount: Path) -> None:
    with contextlib.suppress(OSError):
        (mount / "filler").unlink()


def _cut_ssh(sshd_dir: str) -> bool:
    """Kill every session of the test's sshd (its children): each open SSH connection drops at once."""
    try:
        listener = int(Path(sshd_dir, "sshd.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    children = subprocess.run(["pgrep", "-P", str(listener)], capture_output=True, text=True).stdout.split()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    return bool(children)


# --- one episode -----------------------------------------------------------------------------------------


@dataclass
class Episode:
    seed: int
    cluster: str
    faults: list[Fault] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    attempts: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def own_sshd(sshd_dir: Path) -> Iterator[dict[str, str]]:
    """A real sshd on loopback (scripts/ci-ssh-setup.sh) in `sshd_dir`; the HH_SSH_* variables for it."""
    env = {**os.environ, "HH_SSHD_DIR": str(sshd_dir)}
    script = str(REPO / "scripts/ci-ssh-setup.sh")
    out = subprocess.run(
        ["bash", script, "start"], env=env, check=True, capture_output=True, text=True
    ).stdout
    found = {k: v.strip("'\"") for k, v in re.findall(r"export (HH_SSH_\w+)=(\S+)", out)}
    try:
        yield {**found, "HH_SSHD_DIR": str(sshd_dir)}
    finally:
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True)


@contextlib.contextmanager
def sandbox(cluster: str, ssh_env: dict[str, str], clock: float = DEFAULT_CLOCK) -> Iterator[Sandbox]:
    root = Path(tempfile.mkdtemp(prefix="hh-faults-"))
    tight: Path | None = root / "tight"
    tight.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(tight)],
                             capture_output=True).returncode == 0  # fmt: skip
    if not mounted:
        tight = None
    work = tight or root
    seed_mlflow_store(root / "mlflow.db")
    stack = contextlib.ExitStack()
    if cluster == "ssh":
        ssh_env = {**ssh_env, **stack.enter_context(own_sshd(root / "sshd"))}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ssh_env}
    env.pop("HEISENHUNT_PARENT_RUN_ID", None)
    if cluster == "ray":
        overrides = pool_overrides(root)
        address = ssh_env["RAY_ADDRESS"]
        overrides = ["hydra/launcher=heisenhunt_ray", f"hydra.launcher.ray.init.address={address}",
                     "cluster_pool.lease_ttl_s=20", *overrides]  # fmt: skip
        env.pop("RAY_ADDRESS", None)
    else:
        overrides = [o.replace(f"={root}/", f"={work}/") for o in local_cluster_overrides(root)]
        if cluster == "ssh":
            overrides = ["cluster=ssh_local", *overrides]
    ports = {
        int(o.split("=", 1)[1])
        for o in overrides
        if re.search(r"\.(port|bootstrap_port|metrics_port)=\d+$", o)
    }
    try:
        yield Sandbox(root, cluster, overrides, ports, env, tight, clock)
    finally:
        for path in root.rglob("*.pid"):  # never leave anything behind, whatever was found (nothing runs now)
            pgid = pid_of(path)
            if pgid and pgid in live_groups() and path.parent.name != "sshd":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGCONT)
                    os.killpg(pgid, signal.SIGKILL)
        stack.close()
        if tight is not None:
            subprocess.run(["umount", "-l", str(tight)], capture_output=True)
        if os.environ.get("HH_FAULTS_KEEP"):
            print(f"kept {root}", file=sys.stderr)
        else:
            subprocess.run(["rm", "-rf", str(root)], capture_output=True)


def run_episode(
    seed: int, cluster: str, arms: int, ssh_env: dict[str, str], sweeps: int = 4, clock: float = DEFAULT_CLOCK
) -> Episode:
    """One study of `arms` arms, a fault drawn for each: the first sweep and up to `sweeps - 1` resumes.
    The last sweep draws no fault that ends the orchestrator, so every episode ends with a whole study to
    check; every sweep before it may end in one (the next resumes). `clock` is the sim's: a faster one
    shortens the phases it paces, and the faults' delays into them with it."""
    rng = random.Random(seed)
    ep = Episode(seed, cluster)
    kinds = [k for k, v in KINDS.items() if cluster in v.clusters]
    reps = ",".join(str(r) for r in range(max(1, arms // 2)))
    t0 = time.monotonic()
    with sandbox(cluster, ssh_env, clock) as sb:
        side: list[subprocess.Popen] = []
        parents: dict[str, int] = {}  # parent run id -> attempt
        jobs: dict[tuple[int, int], ArmProgress] = {}
        for attempt in range(sweeps):
            ep.attempts = attempt + 1
            sweep = f"a{attempt}"
            extra = ["factor/multi_stream=on,off", f"repetition={reps}"] + (
                ["resume=true"] if attempt else []
            )
            proc = sb.start(sb.argv(STUDY, sweep, *extra), sb.root / "logs" / f"{sweep}.log")
            injector = Injector(sb, sweep, proc, rng, attempt, kinds, attempt < sweeps - 1, side)
            injector.start()
            try:
                proc.wait(timeout=SWEEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                ep.problems["unexplained_states"].append(
                    f"seed {seed}: sweep {sweep} hung for {SWEEP_TIMEOUT_S}s"
                )
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            injector.join(timeout=5)
            injector.finish()
            ep.faults += [f for f in injector.faults.values() if f.kind is not None or f.job >= 0]
            parent = _read(sb.sweep_dir(sweep) / ".heisenhunt" / "parent_run_id")
            if parent:
                parents[parent] = attempt
            for p in read_progress(progress_dir(sb.sweep_dir(sweep))):
                jobs[(attempt, p.job)] = p
            if injector.ended_by is None:
                if proc.returncode != 0:
                    tail = (sb.root / "logs" / f"{sweep}.log").read_text()[-600:]
                    ep.problems["unexplained_states"].append(
                        f"seed {seed}: sweep {sweep} exited {proc.returncode} with no orchestrator fault: "
                        + tail
                    )
                break
        for p in side:
            try:
                p.wait(timeout=SWEEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                ep.problems["unexplained_states"].append(f"seed {seed}: the second study hung")
                os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.3)
        check(sb, ep, parents, jobs)
    ep.seconds = time.monotonic() - t0
    return ep


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# --- the checker -----------------------------------------------------------------------------------------


def check(
    sb: Sandbox, ep: Episode, parents: dict[str, int], jobs: dict[tuple[int, int], ArmProgress]
) -> None:
    from mlflow.tracking import MlflowClient

    seed, problems = ep.seed, ep.problems
    groups = live_groups()
    for path in sb.pid_files():
        pgid = pid_of(path)
        if pgid and pgid in groups:
            problems["orphans"].append(
                f"seed {seed}: {path.relative_to(sb.root)} names live group {pgid} {groups[pgid]}"
            )
    for port in sorted(sb.ports & listening_ports()):
        problems["orphans"].append(f"seed {seed}: port {port} still listening")
    for lease in (wd / "lease" for wd in sb.work_dirs):
        if lease.is_dir():
            problems["unexplained_states"].append(f"seed {seed}: lease left at {lease.relative_to(sb.root)}")
    client = MlflowClient(sb.uri)
    job_by_key = {(a, p.label, p.repetition): p for (a, _), p in jobs.items()}
    by_key = {(a, p.label, p.repetition): f for f in ep.faults for (a, j), p in jobs.items()
              if f.attempt == a and f.job == j}  # fmt: skip
    for name in (STUDY, SECOND):
        exp = client.get_experiment_by_name(name)
        if exp is None:
            continue
        for run in client.search_runs([exp.experiment_id], max_results=1000):
            tags, status = run.data.tags, run.info.status
            reason = tags.get("failure_reason", "")
            if tags.get("heisenhunt.kind") != "arm":
                if status == "RUNNING":
                    problems["unexplained_states"].append(
                        f"seed {seed}: parent run {run.info.run_id} RUNNING"
                    )
                continue
            if name == SECOND:
                # it shares the cluster: a fault aimed at the first study's arm may hit its servers
                ok = (status == "FAILED" and "leased by" in reason) or any(
                    explained(f.kind, f.injected_phase, status, reason) for f in ep.faults if f.injected
                )
                if not ok:
                    problems["unexplained_states"].append(
                        f"seed {seed}: second study's run {status}: {reason[:200]}"
                    )
                continue
            attempt = parents.get(tags.get("mlflow.parentRunId", ""), -1)
            key = (attempt, tags.get("arm"), int(tags.get("repetition", -1)))
            fault = by_key.get(key)
            kind = fault.kind if fault and fault.injected else None
            phase = fault.injected_phase if fault else ""
            job_dir = sb.sweep_dir(f"a{attempt}") / str(fault.job) if fault else None
            if fault and fault.injected and job_dir and fault.at >= measured_until(job_dir):
                # the arm's last measurement was written before the fault came (the moment between the
                # last request and the progress file's "teardown" is an arm's own last check, ~0.1 s)
                phase = "after"
            if not explained(kind, phase, status, reason):
                # a fault's effect may outlast its arm (the store's lock, a full disk): any fault whose
                # effect overlapped this arm's time may explain it
                job = job_by_key.get(key)
                # (an arm that never reached "done" lasted until its sweep ended: a SIGKILL of the
                # orchestrator stops its progress file where it was)
                overlapping = [
                    f
                    for f in ep.faults
                    if f.injected
                    and job is not None
                    and (f.at <= job.updated or not job.done)
                    and f.until + 1.0 >= job.started
                ]
                if not any(explained(f.kind, f.injected_phase, status, reason) for f in overlapping):
                    problems["unexplained_states"].append(
                        f"seed {seed}: {tags.get('arm')} #{tags.get('repetition')} (attempt {attempt}) "
                        f"{status} "
                        f"after {kind or 'no fault'} in {phase or '-'}: {reason[:240]}"
                    )
    check_report(sb, ep, client)


def measured_until(job_dir: Path) -> float:
    """When the arm wrote its last measurement (its stress outcomes, its throughput levels): wall clock."""
    written = [
        p.stat().st_mtime for p in (*job_dir.glob("stress/*"), *job_dir.glob("bench/*")) if p.is_file()
    ]
    return max(written, default=float("inf"))


def check_report(sb: Sandbox, ep: Episode, client) -> None:
    seed, problems = ep.seed, ep.problems
    written = sb.root / "reports" / STUDY / "report.json"
    if not written.exists():
        problems["rebuild_mismatch"].append(f"seed {seed}: the study wrote no report")
        return
    report = json.loads(written.read_text())
    pooled = Counter(r["run_id"] for arm in report["arms"] for r in arm["runs"] if r.get("used"))
    problems["pooled_twice"] += [f"seed {seed}: run {rid} pooled {n}x" for rid, n in pooled.items() if n > 1]
    used_keys = Counter(
        (arm["signature"], r["repetition"]) for arm in report["arms"] for r in arm["runs"] if r.get("used")
    )
    problems["pooled_twice"] += [
        f"seed {seed}: {k} pooled from {n} runs" for k, n in used_keys.items() if n > 1
    ]
    exp = client.get_experiment_by_name(STUDY)
    for run in client.search_runs([exp.experiment_id], "tags.`heisenhunt.kind` = 'arm'", max_results=1000):
        if run.info.status == "FINISHED" and run.data.tags.get("outcomes") == "complete":
            key = (run.data.tags["signature"], int(run.data.tags["repetition"]))
            if run.info.run_id not in pooled and used_keys.get(key, 0) == 0:
                problems["finished_lost"].append(
                    f"seed {seed}: FINISHED run {run.info.run_id} {key} not pooled"
                )
    rebuilt_dir = sb.root / "rebuilt"
    # what `python -m orchestrator.report --study S --out DIR --no-plots` does, in this process (a process
    # of its own per episode was 4 s of CPU: MLflow's import again)
    from orchestrator.report.pipeline import build_report

    try:
        build_report(sb.uri, STUDY, rebuilt_dir, plots=False)
    except Exception as e:  # any failure to rebuild is the finding
        problems["rebuild_mismatch"].append(f"seed {seed}: rebuild failed: {type(e).__name__}: {e}")
        return
    rebuilt = json.loads((rebuilt_dir / STUDY / "report.json").read_text())
    for what, a, b in [
        ("verdicts", verdicts(report), verdicts(rebuilt)),
        ("arms", arms(report), arms(rebuilt)),
    ]:
        if a != b:
            problems["rebuild_mismatch"].append(f"seed {seed}: {what} differ: written {a} rebuilt {b}")


def verdicts(report: dict) -> list:
    return [
        (h["id"], h["verdict"], h["baseline_counts"], h["treatment_counts"]) for h in report["hypotheses"]
    ]


def arms(report: dict) -> list:
    return sorted(
        (a["signature"], a["n"], a["corrupted"], sorted(r["run_id"] for r in a["runs"] if r.get("used")))
        for a in report["arms"]
    )


# --- the campaign ------------------------------------------------------------------------------------------

COUNTS = ("orphans", "finished_lost", "pooled_twice", "unexplained_states", "rebuild_mismatch")


@contextlib.contextmanager
def cluster_env(cluster: str) -> Iterator[dict[str, str]]:
    """What the episodes' cluster needs running: a real sshd on loopback, or a one-node Ray on loopback."""
    if cluster == "local":
        yield {}
    elif cluster == "ssh":
        yield {}  # each episode starts an sshd of its own (`own_sshd`): a cut must hit its episode only
    else:
        from tests.pool.ray_head import RAY_ENV, local_ray_head

        os.environ.update(RAY_ENV)
        with local_ray_head(free_port) as address:
            yield {**RAY_ENV, "RAY_ADDRESS": address}


def summarise(episodes: list[Episode], seconds: float) -> dict:
    injected = [f for ep in episodes for f in ep.faults if f.injected]
    by_kind: dict[str, dict] = {}
    for f in injected:
        row = by_kind.setdefault(f.kind, {"injected": 0, "phases": Counter()})
        row["injected"] += 1
        row["phases"][f.injected_phase] += 1
    out: dict = {
        "faults_injected": len(injected),
        "arms_without_fault": sum(1 for ep in episodes for f in ep.faults if f.kind is None),
        "faults_missed": sum(1 for ep in episodes for f in ep.faults if f.kind and not f.injected),
        "episodes": len(episodes),
        "by_kind": {
            k: {"injected": v["injected"], "phases": dict(v["phases"])} for k, v in sorted(by_kind.items())
        },
        "seconds": round(seconds, 1),
    }
    for name in COUNTS:
        out[name] = sum(len(ep.problems.get(name, [])) for ep in episodes)
    out["failures"] = [
        {"seed": ep.seed, "cluster": ep.cluster, "problems": {k: v for k, v in ep.problems.items() if v}}
        for ep in episodes
        if any(ep.problems.values())
    ]
    return out


def campaign(
    cluster: str,
    faults: int,
    seed: int,
    arms: int,
    replay: int | None = None,
    progress=print,
    parallel: int = 1,
    sweeps: int = 4,
    clock: float = DEFAULT_CLOCK,
) -> dict:
    """Episodes until `faults` faults were injected (`parallel` at once, each in its own sandbox), or the
    one episode `replay`; the summary."""
    episodes: list[Episode] = []
    t0 = time.monotonic()
    master = random.Random(seed)
    lock = threading.Lock()

    def injected() -> int:
        return sum(f.injected for e in episodes for f in e.faults)

    def one(ep_seed: int, env: dict[str, str]) -> None:
        ep = run_episode(ep_seed, cluster, arms, env, sweeps, clock)
        with lock:
            episodes.append(ep)
            bad = {k: len(v) for k, v in ep.problems.items() if v}
            progress(
                f"episode {len(episodes)} seed {ep_seed}: {sum(f.injected for f in ep.faults)} faults, "
                f"{ep.attempts} attempt(s), {ep.seconds:.0f}s; total {injected()}/{faults}"
                + (f"; PROBLEMS {bad}" if bad else "")
            )
            for name, found in ep.problems.items():
                for line in found[:4]:
                    progress(f"  {name}: {line}")

    def worker(env: dict[str, str]) -> None:
        while True:
            with lock:
                if injected() >= faults:
                    return
                ep_seed = master.randrange(1 << 31)
            one(ep_seed, env)

    with cluster_env(cluster) as env:
        if replay is not None:
            one(replay, env)
        else:
            threads = [threading.Thread(target=worker, args=(env,), daemon=True) for _ in range(parallel)]
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    thread.join()
            except KeyboardInterrupt:  # each orchestrator stops its own servers, as a user's Ctrl-C does
                live = [p for p in RUNNING if p.poll() is None]
                for proc in live:
                    proc.send_signal(signal.SIGINT)
                for proc in live:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=60)
                raise
    return summarise(episodes, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=50, help="inject at least this many faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster", choices=("local", "ssh", "ray"), default="local")
    ap.add_argument("--arms", type=int, default=6, help="arms per study (multi_stream on/off x repetitions)")
    ap.add_argument("--replay", type=int, default=None, help="run the one episode of this seed")
    ap.add_argument("--parallel", type=int, default=1, help="episodes at once (each in its own sandbox)")
    ap.add_argument("--sweeps", type=int, default=4, help="per study: the first and up to N-1 resumes")
    ap.add_argument("--clock", type=float, default=DEFAULT_CLOCK,
                    help="the sim's clock (HEISENHUNT_SIM_TIME_SCALE): smaller is faster")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="fork the orchestrators from a warm zygote (tests/warm.py), as the suite's campaign test does: "
        "cheaper, but no fault lands while a cold start imports",
    )
    args = ap.parse_args(argv)
    if not args.warm:  # every orchestrator a cold `python -m orchestrator`, as a user's
        os.environ[warm.COLD_ENV] = "1"
    summary = campaign(
        args.cluster,
        args.faults,
        args.seed,
        args.arms,
        args.replay,
        parallel=args.parallel,
        sweeps=args.sweeps,
        clock=args.clock,
    )
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if not any(summary[k] for k in COUNTS) else 1


if __name__ == "__main__":
    sys.exit(main())
