"""Behaviour every Transport must show, run against each one (test_local.py, test_ssh.py).

A subclass provides a `transport` fixture; the host must share this machine's filesystem and process
table (local, or SSH to loopback / a network namespace), so the tests can check from outside too.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.remote.base import Liveness, Transport, TransportError, liveness_command, parse_group_look

HOSTILE = {
    "SUBST": "$(touch {pwned})",
    "BACKTICK": "`touch {pwned}`",
    "QUOTES": "it's \"double\" and 'single'",
    "NEWLINES": "line1\nline2\n\nline4",
    "SPACES": "  leading and  inner  and trailing  ",
    "SEMICOLON": "a; touch {pwned}; b",
    "GLOB_AND_VARS": "* ~ $HOME ${{HOME}} \\n \\ back",
    "EMPTY": "",
}

DUMP_ENV = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"
DUMP_ENV_TO_FILE = (
    "import json, os, sys; "
    "open(sys.argv[1], 'w').write(json.dumps({k: os.environ.get(k) for k in sys.argv[2:]}))"
)


def _start_term_ignoring_group(transport: Transport, tmp_path: Path) -> int:
    """A detached group of three processes that ignore SIGTERM, once all three run; its pgid."""
    script = "trap '' TERM; sleep 300 & sleep 300"
    pid = transport.start_detached(["sh", "-c", script], {}, str(tmp_path / "l"), str(tmp_path / "p"))
    deadline = time.monotonic() + 10
    while len(_pgid_members(pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def _running_with(marker: str) -> list[int]:
    """Live pids whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in entry.read_bytes():
                state = (entry.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.parent.name))
        except OSError:
            continue
    return found


def _pgid_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group `pgid`, read from /proc on this machine."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class TransportContract:
    @pytest.fixture
    def transport(self) -> Transport:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_run_gives_stdout_stderr_and_status(self, transport: Transport) -> None:
        result = transport.run_shell("echo out; echo err >&2; exit 3")
        assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")

    def test_run_raises_on_failure_when_checked(self, transport: Transport) -> None:
        with pytest.raises(TransportError, match="exited 7"):
            transport.run(["sh", "-c", "echo boom >&2; exit 7"])
        assert transport.run(["false"], check=False).returncode == 1

    def test_a_long_program_that_fails_is_named_in_brief_and_the_error_ends_with_why(
        self, transport: Transport
    ) -> None:
        # the preflight's host side is a whole program run with `python -c`: named in full, it pushed why
        # the command failed past what a run's failure tag keeps (fault campaign seed 1724820278)
        program = "".join(f"x{i} = {i}  # a line of the program\n" for i in range(400))
        program += "import sys\nsys.exit('the reason it failed')"
        with pytest.raises(TransportError) as failed:
            transport.run([sys.executable, "-c", program])
        message = str(failed.value)
        assert message.endswith("the reason it failed") and "exited 1" in message, message[-300:]
        assert len(message) < 400 and "x399" not in message, len(message)

    def test_large_output_on_both_streams_does_not_block(self, transport: Transport) -> None:
        # 2 MiB on each stream: a transport reading one stream after the other would deadlock
        script = (
            "import sys\nfor _ in range(2048):\n    print('o' * 1024)\n    print('e' * 1024, file=sys.stderr)"
        )
        result = transport.run([sys.executable, "-c", script], timeout=60)
        assert len(result.stdout) == len(result.stderr) == 2048 * 1025

    def test_timeout_is_an_error_within_the_limit(self, transport: Transport) -> None:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not finish within"):
            transport.run_shell("sleep 5", timeout=0.5)
        assert time.monotonic() - t0 < 3.0

    def test_stdin_is_empty(self, transport: Transport) -> None:
        t0 = time.monotonic()
        assert transport.run_shell("cat; echo done", timeout=10).stdout == "done\n"
        assert time.monotonic() - t0 < 5

    def test_hostile_env_values_arrive_literally(self, transport: Transport, tmp_path: Path) -> None:
        pwned = tmp_path / "pwned"
        env = {k: v.format(pwned=pwned) for k, v in HOSTILE.items()}
        got = json.loads(transport.run([sys.executable, "-c", DUMP_ENV, *env], env=env).stdout)
        assert got == env
        # the same through a detached start, the path servers are launched by
        out = tmp_path / "detached.json"
        pid = transport.start_detached(
            [sys.executable, "-c", DUMP_ENV_TO_FILE, str(out), *env],
            env,
            str(tmp_path / "d.log"),
            str(tmp_path / "d.pid"),
        )
        deadline = time.monotonic() + 10
        while transport.is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(out.read_text()) == env
        assert not pwned.exists()

    def test_env_names_are_validated(self, transport: Transport) -> None:
        with pytest.raises(ValueError, match="invalid environment variable name"):
            transport.run(["true"], env={"X; touch /tmp/x": "1"})

    def test_start_detached_writes_pid_and_log_then_stop_by_group(
        self, transport: Transport, tmp_path: Path
    ) -> None:
        log, pidfile = tmp_path / "w" / "srv.log", tmp_path / "w" / "srv.pid"
        # a parent with a child: stopping must take the whole group
        script = "import subprocess, time; subprocess.Popen(['sleep', '300']); print('up', flush=True); " + (
            "time.sleep(300)"
        )
        pid = transport.start_detached(
            [sys.executable, "-c", script], {}, str(log), str(pidfile), cwd=str(tmp_path)
        )
        try:
            pid_line, started = pidfile.read_text().splitlines()
            assert int(pid_line) == pid and started == transport.start_time(pid)
            assert os.getpgid(pid) == pid == os.getsid(pid)  # its own session and group
            deadline = time.monotonic() + 10
            while len(_pgid_members(pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(_pgid_members(pid)) == 2
            assert transport.read_text_tail(str(log)).startswith("up")
            assert transport.is_alive(pid) and transport.group_alive(pid)
            # the look reads the leader's start as the pid file has it
            look = parse_group_look(transport.run_shell(liveness_command(pid)).stdout)
            assert (look.leader_started, look.live, look.zombies) == (started, None, None)  # its leader runs
            assert transport.group_liveness(pid, started) is Liveness.ALIVE
            assert transport.stop_group(pid, grace_s=10) is False  # TERM was enough
            assert _pgid_members(pid) == []
            assert not transport.is_alive(pid) and not transport.group_alive(pid)
        finally:
            for p in _pgid_members(pid):
                os.kill(p, 9)

    def test_stop_kills_a_group_that_ignores_term(self, transport: Transport, tmp_path: Path) -> None:
        pid = _start_term_ignoring_group(transport, tmp_path)
        try:
            t0 = time.monotonic()
            assert transport.stop_group(pid, grace_s=0.5) is True  # had to KILL
            assert time.monotonic() - t0 < 5
            assert _pgid_members(pid) == []
        finally:
            for p in _pgid_members(pid):
                os.kill(p, 9)

    def test_a_ps_that_misses_the_group_cannot_skip_the_kill(
        self, transport: Transport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Issue 32: one `ps` was seen to miss a live router; `stop_group` then took it for gone after
        the TERM and returned without the KILL. Here `ps` misses every process, always (a shim first on
        the PATH the host's shell uses, an honest fake of that miss): the kernel still knows the group,
        so the stop waits out its grace and KILLs."""
        pid = _start_term_ignoring_group(transport, tmp_path)
        try:
            started = transport.start_time(pid)
            shim = tmp_path / "bin"
            shim.mkdir()
            (shim / "ps").write_text("#!/bin/sh\nexit 0\n")
            (shim / "ps").chmod(0o755)
            monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
            if transport.run_shell("command -v ps").stdout.strip() != str(shim / "ps"):
                pytest.skip("this transport's shell does not take the test's PATH")
            assert transport.group_alive(pid, started)
            assert transport.stop_group(pid, grace_s=0.5, started_at=started) is True
            assert _pgid_members(pid) == []
            assert not transport.group_alive(pid)
        finally:
            for p in _pgid_members(pid):
                os.kill(p, 9)

    def test_a_server_whose_pid_file_cannot_be_written_is_not_left_running(
        self, transport: Transport, tmp_path: Path
    ) -> None:
        """Found by the fault campaign (bench/fault_campaign.py, a full disk at start-up): the server
        started, its pid file could not be written, and nothing could ever find it to stop it; its port
        stayed taken for every later arm. Here the pid file's path is a directory, so the write fails."""
        marker = f"hh-unwritable-{os.getpid()}-{time.monotonic_ns()}"
        (tmp_path / "pid-is-a-dir").mkdir()
        with pytest.raises(TransportError, match="cannot write"):
            transport.start_detached(
                ["sh", "-c", f"sleep 300; : {marker}"],
                {},
                str(tmp_path / "l"),
                str(tmp_path / "pid-is-a-dir"),
            )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _running_with(marker):
            time.sleep(0.05)
        assert not _running_with(marker)

    def test_a_process_before_its_setsid_is_alive_and_stoppable(self, transport: Transport) -> None:
        """Just after a detached start, the server may not have run `setsid` yet: its pid names no group.
        The look must call it alive and the stop must reach it (found by the fault campaign over SSH, seed
        2072488418). Here a process that never makes its own group stands for that moment."""
        started = transport.run_shell("sleep 300 >/dev/null 2>&1 </dev/null & echo $!")
        pid = int(started.stdout.strip())
        try:
            assert os.getpgid(pid) != pid  # no group of its own
            assert transport.group_alive(pid, transport.start_time(pid))
            assert transport.stop_group(pid, grace_s=5) is False
            assert not transport.is_alive(pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    def test_a_recycled_leader_is_not_ours(self, transport: Transport, tmp_path: Path) -> None:
        """A pid file's start time that is not the running leader's: the group it named is gone (Linux
        never reuses a pid while its group has members), and the process now under that pid is left alone."""
        pid = transport.start_detached(["sleep", "300"], {}, str(tmp_path / "l"), str(tmp_path / "p"))
        try:
            assert transport.group_alive(pid, transport.start_time(pid))
            assert not transport.group_alive(pid, "Mon Jan  1 00:00:00 2001")
            assert transport.stop_group(pid, grace_s=5, started_at="Mon Jan  1 00:00:00 2001") is False
            assert _pgid_members(pid) == [pid]  # not signalled
        finally:
            for p in _pgid_members(pid):
                os.kill(p, 9)

    def test_refuses_to_signal_group_one(self, transport: Transport) -> None:
        with pytest.raises(ValueError):
            transport.stop_group(1)

    def test_write_then_read_binary_creating_parents(self, transport: Transport, tmp_path: Path) -> None:
        path = tmp_path / "a" / "b" / "data.bin"
        data = bytes(range(256)) * 300
        transport.write_file(str(path), data)
        assert path.read_bytes() == data
        assert transport.read_file(str(path)) == data
        transport.write_file(str(path), b"shorter")  # overwrite replaces, not patches
        assert transport.read_file(str(path)) == b"shorter"

    def test_read_missing_file_is_file_not_found(self, transport: Transport, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError):
            transport.read_file(str(tmp_path / "nope"))
        assert transport.read_text_tail(str(tmp_path / "nope")) == ""
