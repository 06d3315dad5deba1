"""The Transport interface: how the orchestrator touches a host, local or remote.

Every host operation the deployment needs (run a command, start a detached server, check and stop
it, read its log) goes through this interface. Process control is written once, as POSIX shell
built with `shlex`, on top of two primitives each transport implements: `run_shell` (run one shell
command line on the host) and `read_file` / `write_file`. The local transport runs `sh -c` through
subprocess; the SSH transport runs the same lines through paramiko's exec_command and SFTP. So the
local transport exercises exactly the shell the remote hosts will see.

Lifecycle: a transport is built at the edge (from the cluster config), used for one arm, and closed
in a `finally` (it is a context manager).
"""

from __future__ import annotations

import enum
import logging
import shlex
import textwrap
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config.shell import command_line

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """A host could not be reached, or a command on it could not be run as asked."""


def brief(command: str, width: int = 160) -> str:
    """A command as an error names it: whitespace collapsed, cut at `width`. The preflight runs a whole
    Python program through `python -c`; named in full, it pushed the error's end (why the command failed)
    past what a run's failure tag keeps (fault campaign seed 1724820278)."""
    return textwrap.shorten(command, width=width, placeholder=" ...")


class CommandFailed(TransportError):
    def __init__(self, host: str, command: str, result: CommandResult):
        self.result = result
        tail = (result.stderr or result.stdout).strip()[-2000:]
        super().__init__(f"on {host}: `{brief(command)}` exited {result.returncode}: {tail}")


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


def start_of(pid: str) -> str:
    """A shell command that prints when process `pid` (a number, or a shell word such as "$p") started, in
    a form fixed for the process's life: on Linux its start in clock ticks after boot (/proc/PID/stat,
    field 22), elsewhere `ps -o lstart=`; nothing when it is gone. This is what a pid file records and
    what tells a recycled pid apart, so it must never change under a running process. `ps -o lstart=` on
    Linux does not: procps adds the boot time of /proc/stat, which the kernel recomputes at each read as
    the wall clock minus the time since boot, so a correction of the wall clock (NTP, a VM's time sync)
    moves every lstart (CI at 316548b: a live prefill read 20:57:27 at its start and 20:57:28 later, was
    judged a recycled pid, failed its arm and was left running). macOS's `ps` reads a start time the
    kernel stored once."""
    ticks = _proc_stat(pid, f'$20 "{TICKS}"')
    return f"{{ if [ -r /proc/self/stat ]; then {ticks}; else LC_ALL=C ps -o lstart= -p {pid}; fi; }}"


TICKS = " ticks after boot"  # how `start_of` writes a start read from /proc


def _proc_stat(pid: str, fields: str) -> str:
    """awk printing `fields` of /proc/PID/stat as they stand past the last ") " (a command name may hold
    spaces and parentheses): there $1 is the state (field 3) and $20 the start in ticks (field 22)."""
    return f"awk '{{ sub(/^.*\\) /, \"\"); print {fields} }}' /proc/{pid}/stat 2>/dev/null"


def detached_command(
    argv: Sequence[str], env: Mapping[str, str], log_path: str, pid_path: str, cwd: str | None = None
) -> str:
    """A shell line that starts `argv` in a new session (so its pid is its process group id),
    stdout+stderr appended to `log_path`, stdin from /dev/null, writes the pid and its start time to
    `pid_path` (two lines) and prints the pid. The process survives the shell (and the SSH channel)
    that started it. The start time tells a later run whether the pid was recycled, so a pid file is
    never written without one: a process already gone leaves none (there is nothing to stop). A process
    whose pid file cannot be written is killed before the line fails."""
    if not argv:
        raise ValueError("empty command")
    launch = command_line(argv, env)
    cd = f"cd {shlex.quote(cwd)} || exit 1; " if cwd else ""
    log, pid = shlex.quote(log_path), shlex.quote(pid_path)
    parent = shlex.quote(str(_parent(log_path)))
    pid_parent = shlex.quote(str(_parent(pid_path)))
    started = start_of('"$p"')
    # Plain `;` sequencing: with `A && B & C`, the shell would background the whole `A && B` list and
    # $! would name a subshell, not the server.
    return (
        f"mkdir -p {parent} {pid_parent} || exit 1; {cd}"
        f"setsid nohup {launch} >>{log} 2>&1 </dev/null & "
        f"p=$!; t=$({started}); "
        f'if [ -n "$t" ]; then printf "%s\\n%s\\n" "$p" "$t" >{pid} '
        # a server whose pid file cannot be written (a full disk) is stopped at once: nothing could
        # ever find it again to stop it
        # (the pid too: its `setsid` may not have made the group yet)
        f'|| {{ kill -KILL -"$p" "$p" 2>/dev/null; rm -f {pid}; echo "cannot write {pid}" >&2; exit 1; }}; '
        'fi; echo "$p"'
    )


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."


class Liveness(enum.Enum):
    ALIVE = "alive"
    GONE = "gone"  # no process of the group is left (zombies aside)
    RECYCLED = "recycled"  # the group is gone and its leader's pid now names another process


@dataclass(frozen=True)
class GroupLook:
    """What one look at a process group saw on its host."""

    kernel_knows: bool  # `kill -0 -PGID` found a process in the group (or was refused one: EPERM)
    live: int | None  # non-zombie members `ps` listed (None: not counted, the leader runs)
    zombies: int | None  # zombie members `ps` listed (None: not counted)
    leader_started: str  # `start_of` the pid PGID ('' when no such process)
    leader_state: str = ""  # `ps -o stat=` of the pid PGID ('' when no such process)
    # the kernel asked again after `ps`: a group reaped in between (zombies gone) reads as gone, not as a
    # group `ps` missed (the suite once saw a stopped server's group judged alive that way)
    kernel_knows_after: bool = True


def liveness_command(pgid: int) -> str:
    """One POSIX shell line that prints a `GroupLook` of group `pgid` (parsed by `parse_group_look`).
    Where /proc shows the leader running, that settles it (`judge_liveness`): its state and start, read
    from one file ("LEADER"). Otherwise the kernel's answer to a signal 0 sent to the group, the members
    `ps` lists, the leader's state and start, and the kernel's answer again: `ps -e` walks every process
    on the host, a cost a look at a running server (nearly every look) no longer pays."""
    g = int(pgid)
    running = _proc_stat(str(g), f'$1, $20 "{TICKS}"')
    return (
        f'l=$({running}); case "$l" in ""|Z*|X*) {whole_look_command(g)};; '
        f'*) echo LEADER; echo "S ${{l%% *}}"; echo "T ${{l#* }}";; esac; true'
    )


def whole_look_command(pgid: int) -> str:
    """The look at a group whose leader is not seen running: the kernel's answer to a signal 0 sent to
    the group, the members `ps` lists, the leader's state and start, and the kernel's answer again."""
    g = int(pgid)
    if g <= 1:
        raise ValueError(f"refusing to look at process group {g}")
    kernel = (
        f"k=$(LC_ALL=C kill -0 -{g} 2>&1) && echo KNOWN || "
        f'{{ case "$k" in *ermitted*) echo KNOWN;; *) echo UNKNOWN;; esac; }}'
    )
    # one `ps` of every process: the group's members, and the leader's state; then the leader's start
    members = (
        f"ps -e -o pid=,pgid=,stat= | awk '"
        f"$2 == {g} {{ if ($3 ~ /^Z/) z++; else l++ }} "
        f"$1 == {g} {{ s = $3 }} "
        f'END {{ print l + 0; print z + 0; print "S " s }}\''
    )
    leader = f'echo "T $({start_of(str(g))})"'
    return f"{kernel}; {members}; {leader}; {kernel}"


def parse_group_look(stdout: str) -> GroupLook:
    lines = stdout.splitlines()
    if lines[:1] == ["LEADER"]:  # the leader runs: nothing else was looked at
        if len(lines) < 3 or lines[1][:1] != "S" or lines[2][:1] != "T" or not lines[1][1:].strip():
            raise TransportError(f"unexpected answer to a process-group look: {stdout!r}")
        return GroupLook(True, None, None, lines[2][1:].strip(), lines[1][1:].strip())
    kernel = ("KNOWN", "UNKNOWN")
    if (
        len(lines) < 6
        or lines[0] not in kernel
        or lines[3][:1] != "S"
        or lines[4][:1] != "T"
        or lines[5] not in kernel
    ):
        raise TransportError(f"unexpected answer to a process-group look: {stdout!r}")
    state, started = lines[3][1:].strip(), lines[4][1:].strip()
    return GroupLook(lines[0] == "KNOWN", int(lines[1]), int(lines[2]), started, state, lines[5] == "KNOWN")


def judge_liveness(look: GroupLook, started_at: str = "") -> Liveness:
    """Alive or gone, from one look (pure).
    - A leader alive under another start time is a recycled pid: Linux never reuses a pid while its
      group has members, so ours is gone.
    - The leader itself running is alive, whatever its group: just after its start it may not have run
      `setsid` yet, and its group does not exist (found by the fault campaign over SSH, seed 2072488418:
      a router taken for exited in its first look was left running without its pid file).
    - Otherwise the kernel is the authority on "gone": `ps` walks /proc and was seen to miss a live router
      on a loaded machine, so a group `ps` does not list is gone only when the kernel agrees (before `ps`
      or after it: a group of zombies reaped while `ps` ran is gone, not missed), or when `ps` lists its
      members and all are zombies."""
    if look.leader_started and started_at and look.leader_started != started_at:
        return Liveness.RECYCLED
    if look.leader_state and not look.leader_state.startswith("Z"):
        return Liveness.ALIVE
    if not look.kernel_knows or not look.kernel_knows_after:
        return Liveness.GONE
    if look.live == 0 and (look.zombies or 0) > 0:
        return Liveness.GONE
    return Liveness.ALIVE


class Transport(ABC):
    """One host. Subclasses provide `run_shell`, `read_file`, `write_file`; the rest is shared."""

    #: a short name for messages ("local", "gpu-node-1")
    host: str

    @abstractmethod
    def run_shell(self, command: str, timeout: float | None = 60.0) -> CommandResult:
        """Run one POSIX shell command line on the host and wait for it."""

    @abstractmethod
    def read_file(self, path: str) -> bytes:
        """The bytes of a file on the host; FileNotFoundError if it does not exist."""

    @abstractmethod
    def write_file(self, path: str, data: bytes) -> None:
        """Write a file on the host, creating parent directories."""

    def close(self) -> None:  # noqa: B027 - a transport without connections has nothing to release
        """Release connections. Processes started detached keep running."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared behaviour, all through run_shell -------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
        check: bool = True,
        cwd: str | None = None,
    ) -> CommandResult:
        """Run `argv` (quoted for the shell) with extra `env`, wait for it."""
        line = command_line(argv, env)
        if cwd:
            line = f"cd {shlex.quote(cwd)} && {line}"
        result = self.run_shell(line, timeout=timeout)
        if check and result.returncode != 0:
            raise CommandFailed(self.host, line, result)
        return result

    def run_again(self, command: str, timeout: float | None = 15.0) -> CommandResult:
        """`run_shell` for a command that may run twice (a look at processes, ports or a log; a signal to
        a group): one cut short by a lost connection runs once more, on the connection the transport
        makes anew (found by the fault campaign: an SSH session killed mid-look failed the arm)."""
        try:
            return self.run_shell(command, timeout=timeout)
        except TransportError as e:
            log.warning("%s: %s; running it again", self.host, e)
            return self.run_shell(command, timeout=timeout)

    def start_detached(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: str,
        pid_path: str,
        cwd: str | None = None,
    ) -> int:
        """Start `argv` detached in its own session; returns its pid (= its process group id)."""
        line = detached_command(argv, env, log_path, pid_path, cwd)
        result = self.run_shell(line, timeout=30.0)
        if result.returncode != 0 or not result.stdout.strip().isdigit():
            raise CommandFailed(self.host, line, result)
        return int(result.stdout.strip())

    def is_alive(self, pid: int) -> bool:
        """True if `pid` exists and is not a zombie."""
        result = self.run_again(f"ps -o stat= -p {int(pid)}", timeout=15.0)
        state = result.stdout.strip()
        return result.returncode == 0 and bool(state) and not state.startswith("Z")

    def start_time(self, pid: int) -> str:
        """When the process started, as its pid file records it (`start_of`; '' when it is gone)."""
        return self.run_again(start_of(str(int(pid))), timeout=15.0).stdout.strip()

    def group_liveness(self, pgid: int, started_at: str = "") -> Liveness:
        """Whether process group `pgid` (started at `started_at`, as its pid file records it) still runs:
        the one liveness check of every transport, read by one shell line (`liveness_command`) and judged
        by `judge_liveness`, which never calls a live group gone."""
        result = self.run_again(liveness_command(pgid), timeout=15.0)
        if result.returncode != 0:
            raise TransportError(f"on {self.host}: could not look at process group {pgid}: {result.stderr}")
        return judge_liveness(parse_group_look(result.stdout), started_at)

    def group_alive(self, pgid: int, started_at: str = "") -> bool:
        """True while any non-zombie process of group `pgid` runs (and, given `started_at`, while its
        leader is that process and not a recycled pid)."""
        return self.group_liveness(pgid, started_at) is Liveness.ALIVE

    def stop_group(
        self,
        pgid: int,
        grace_s: float = 10.0,
        poll_s: float = 0.1,
        started_at: str = "",
        seen_alive: bool = False,
    ) -> bool:
        """TERM the process group, wait up to `grace_s`, then KILL. Returns True if it had to KILL. Only a
        group the kernel says is gone ends the wait early (`group_liveness`): a look that merely missed
        it cannot skip the KILL. `seen_alive`: the caller has just looked and found the group alive (and
        its leader ours), so it is not looked at again before the TERM."""
        pgid = int(pgid)
        if pgid <= 1:
            raise ValueError(f"refusing to signal process group {pgid}")
        if started_at and not seen_alive and not self.group_alive(pgid, started_at):
            return False  # gone, or its pid now names another process: nothing of ours to signal
        self.run_again(f"kill -TERM -{pgid} {pgid} 2>/dev/null; true", timeout=15.0)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)  # a look right after the TERM would find it still running
            if not self.group_alive(pgid, started_at):
                return False
        self.run_again(f"kill -KILL -{pgid} {pgid} 2>/dev/null; true", timeout=15.0)
        kill_deadline = time.monotonic() + 5.0
        while self.group_alive(pgid, started_at) and time.monotonic() < kill_deadline:
            time.sleep(poll_s)
        return True

    def read_text_tail(self, path: str, max_bytes: int = 8192) -> str:
        """The last `max_bytes` of a text file, or '' when it does not exist."""
        result = self.run_again(f"tail -c {int(max_bytes)} {shlex.quote(path)} 2>/dev/null", timeout=15.0)
        return result.stdout if result.returncode == 0 else ""

    def port_listening(self, port: int) -> bool:
        """True if something listens on TCP `port` on this host (any address)."""
        listeners = "(ss -Htln 2>/dev/null || netstat -tln 2>/dev/null) | awk '{print $4}'"
        result = self.run_again(f"{listeners} | grep -E ':{int(port)}$'", timeout=15.0)
        return bool(result.stdout.strip())
