"""Reading an SSH session's channel against a deadline: what both ways of running a command (a session per
command, and the persistent shell of ssh_shell.py) use to drain stdout and stderr together, so neither
pipe can fill and block the command, and to notice the session's end.
"""

from __future__ import annotations

import select
import time

import paramiko


def time_left(deadline: float | None) -> float | None:
    """Seconds to `deadline` (None: no deadline); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def drain(chan: paramiko.Channel, out: bytearray, err: bytearray) -> bool:
    """Move what arrived on stdout and stderr into `out` and `err`; True if anything did."""
    drained = False
    while chan.recv_ready():
        out += chan.recv(65536)
        drained = True
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(65536)
        drained = True
    return drained


def wait_readable(chan: paramiko.Channel, left: float | None) -> None:
    # the channel's fileno becomes readable on stdout or stderr data, or on EOF
    select.select([chan], [], [], min(left, 1.0) if left is not None else 1.0)


def ended(chan: paramiko.Channel) -> bool:
    """The session ended and everything it sent has been read."""
    return (chan.closed or chan.eof_received) and not chan.recv_ready() and not chan.recv_stderr_ready()


def collect(chan: paramiko.Channel, timeout: float | None) -> tuple[bytes, bytes, int]:
    """(stdout, stderr, exit status) of a session's one command: both streams drained together until the
    session ends, then its exit status awaited; TimeoutError once `timeout` passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    while True:
        left = time_left(deadline)  # every round: a command that never stops talking still times out
        drained = drain(chan, out, err)
        # closed is not the end: what arrived before the close may still be in the buffers
        if ended(chan):
            break
        if not drained:
            wait_readable(chan, left)
    if not chan.status_event.wait(time_left(deadline)):
        raise TimeoutError
    return bytes(out), bytes(err), chan.recv_exit_status()
