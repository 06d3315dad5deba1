"""The persistent shell of the SSH transport: what it is sent, and how its answers are framed and read.

A fresh SSH session per command makes the server start the login shell each time (bash reads
~/.bashrc under sshd: ~150 ms on a host whose .bashrc runs `pyenv init`). So commands go to a
persistent shell instead (`ssh.persistent_shell`, on by default): one long-lived `sh` per session,
started once through the login shell, reading command lines from its stdin. Each command still runs
as its own `sh -c '<line>'` child with stdin from /dev/null, so nothing (cwd, variables, `exit`)
carries over from one command to the next; its stdout and stderr go to two files in the shell's
private temp directory, sent back after it exits, each framed by markers carrying a random token
and the exit status (a command killed by signal N reads 128+N, as `$?`; a session per command gave
-1). A command costs a few ms. Output a command's background child writes after the command exited
is dropped (it went to the command's own file), where a session per command would wait for it.

How the transport pools these shells, retries a command a dead shell never started, and kills the
shell of a timed-out command is in ssh.py; this module is the protocol (`shell_init`,
`shell_command`, `frame`, `kill_command`: pure) and one command's exchange over a channel.
"""

from __future__ import annotations

import contextlib
import shlex
import time
import uuid
from dataclasses import dataclass

import paramiko

from orchestrator.remote.ssh_channel import drain, ended, time_left, wait_readable
from orchestrator.remote.ssh_errors import SSHError


def shell_init(token: str) -> str:
    """The first line the persistent shell reads: a private temp directory, removed when the shell
    exits however it ends (EOF on stdin, a closed session, HUP, TERM), then `<token> <pid> <dir>`."""
    return (
        "d=$(mktemp -d) || exit 1; trap 'rm -rf \"$d\"' EXIT; "
        "trap 'exit 129' HUP; trap 'exit 141' PIPE; trap 'exit 143' TERM; "
        f'printf "%s %s %s\\n" {token} "$$" "$d"\n'
    )


def shell_command(command: str, token: str) -> str:
    """One command for the persistent shell. It runs as `sh -c '<command>'`, stdin from /dev/null,
    stdout and stderr into two files of its own (a background child it leaves behind writes there,
    never into the next command's answer); then each file goes back framed on its stream as
    `<token>s\\n<bytes>\\n<token> <exit status>\\n` (see `frame`)."""
    o, e = f'"$d/{token}.o"', f'"$d/{token}.e"'
    return (
        f"printf '%s\\n' {token}s; printf '%s\\n' {token}s >&2; "
        f"sh -c {shlex.quote(command)} </dev/null >{o} 2>{e}; r=$?; "
        f"[ ! -s {o} ] || cat {o}; printf '\\n%s %s\\n' {token} \"$r\"; "
        f"[ ! -s {e} ] || cat {e} >&2; printf '\\n%s %s\\n' {token} \"$r\" >&2; "
        f"rm -f {o} {e} 2>/dev/null\n"
    )


def frame(buf: bytes | bytearray, token: str) -> tuple[bytes, int] | None:
    """(payload, exit status) once `buf` holds a whole frame of `shell_command`, else None. Bytes
    before the start marker (a login script's noise) are skipped; the random token is in no output."""
    start, end = f"{token}s\n".encode(), f"\n{token} ".encode()
    if not buf.endswith(b"\n"):
        return None
    first = buf.find(start)
    if first < 0:
        return None
    body = first + len(start)
    last = buf.rfind(end, body)
    status = buf[last + len(end) : -1] if last >= 0 else b""
    if not status.isdigit():
        return None
    return bytes(buf[body:last]), int(status)


def kill_command(pid: int, tmp: str) -> str:
    """The line that ends the shell `pid` of a timed-out command, run in a session of its own: SIGKILL to
    the shell's process group (sshd made it a session leader), so to the command and all it started
    there, though not to servers started detached (they have their own session); its temp directory
    removed. A shell that leads no group: it and its children."""
    children = f"$(ps -e -o pid=,ppid= | awk -v p={pid} '$2 == p {{print $1}}')"
    return (
        f"kill -KILL -{pid} 2>/dev/null || kill -KILL {pid} {children} 2>/dev/null; "
        f"rm -rf {shlex.quote(tmp)}; true"
    )


class NoShell(SSHError):
    """The host's persistent shell did not start (then each command gets its own session)."""


class ShellGone(SSHError):
    """The persistent shell's session ended before the command's answer was complete."""

    def __init__(self, why: str, may_have_run: bool):
        super().__init__(why)
        self.may_have_run = may_have_run


@dataclass
class PersistentShell:
    """A persistent `sh` on the host, used by one thread at a time."""

    chan: paramiko.Channel
    pid: int
    # its private temp directory (for the commands' output files)
    tmp: str

    def usable(self, transport: paramiko.Transport) -> bool:
        chan = self.chan
        return (
            chan.get_transport() is transport
            and transport.is_active()
            and not (chan.closed or chan.eof_received or chan.exit_status_ready())
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chan.shutdown_write()  # EOF on its stdin: sh exits, its EXIT trap removes tmp
        self.chan.close()


def await_ready(chan: paramiko.Channel, token: str, program: str, timeout: float) -> tuple[int, str]:
    """(pid, temp dir) from the persistent shell's first line; whatever the login shell printed
    before it is skipped."""
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    marker = f"{token} ".encode()
    while True:
        drained = drain(chan, out, err)
        at = out.find(marker)
        if at >= 0 and out.find(b"\n", at) >= 0:
            pid, _, tmp = out[at + len(marker) : out.find(b"\n", at)].decode(errors="replace").partition(" ")
            return int(pid), tmp
        if ended(chan):
            said = (err or out).decode(errors="replace").strip()[-500:]
            raise NoShell(f"`{program}` exited: {said or 'no output'}")
        try:
            left = time_left(deadline)
        except TimeoutError:
            raise NoShell(f"`{program}` did not answer within {timeout}s") from None
        if not drained:
            wait_readable(chan, left)


def run_framed(chan: paramiko.Channel, command: str, timeout: float | None) -> tuple[bytes, bytes, int]:
    """Run one command on a persistent shell: (stdout, stderr, exit status)."""
    token = uuid.uuid4().hex
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        chan.sendall(shell_command(command, token).encode())
    except (OSError, EOFError, paramiko.SSHException) as e:
        # the shell runs a line only once it has all of it: a line cut short never ran
        raise ShellGone(f"could not send the command: {e}", may_have_run=False) from e
    out, err = bytearray(), bytearray()
    out_frame = err_frame = None
    while True:
        left = time_left(deadline)  # every round: a command that never stops talking still times out
        drained = drain(chan, out, err)
        if out_frame is None:
            out_frame = frame(out, token)
        if err_frame is None:
            err_frame = frame(err, token)
        if out_frame is not None and err_frame is not None:
            return out_frame[0], err_frame[0], out_frame[1]
        if ended(chan):
            transport = chan.get_transport()
            # over a live connection the session's output all arrived: no start marker, nothing ran
            started = f"{token}s\n".encode() in out or transport is None or not transport.is_active()
            raise ShellGone("the shell's session ended", may_have_run=started)
        if not drained:
            wait_readable(chan, left)
