"""Ctrl-C and SIGTERM reach a run on either event loop (client.run_sync).

A Python signal handler raises in whatever code runs when the signal lands. Under uvloop, an exception
raised inside a protocol callback ends that one connection and the loop carries on, so an interrupt
that landed while a stream was being read ended one session and the stress run went on (seen as a
Ctrl-C that did not stop a sweep). These tests land the signal exactly there: the protocol raises it
itself, inside data_received, so the Python handler runs in that callback every time.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from orchestrator.workload import client
from orchestrator.workload.stress import quiet_on_interrupt

SIGNAL_AT_CHUNK = 5  # a few chunks in: the stream is established and being read


class _SignallingReader(asyncio.Protocol):
    def __init__(self, lost: asyncio.Future):
        self.lost = lost
        self.chunks = 0

    def data_received(self, data: bytes) -> None:
        self.chunks += 1
        if self.chunks == SIGNAL_AT_CHUNK:
            signal.raise_signal(signal.SIGTERM)  # a Python handler would run here, in this callback

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def _stream_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            writer.write(b"x" * 100)
            await writer.drain()
            await asyncio.sleep(0)
    except (ConnectionError, asyncio.CancelledError):
        pass


async def _read_a_stream(cleaned_up: list[str]) -> str:
    """Reads a never-ending local stream until cancelled; says so on the way out. The loop's exception
    handler is the stress run's, which keeps a session's KeyboardInterrupt off the terminal."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_on_interrupt)
    server = await asyncio.start_server(_stream_forever, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lost: asyncio.Future = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _SignallingReader(lost), "127.0.0.1", port)
    try:
        exc = await asyncio.wait_for(lost, 10.0)
        return f"the run went on after its connection was lost to {exc!r}"
    finally:
        cleaned_up.append("yes")
        transport.close()
        server.close()


def _raise_interrupt(signum, frame):  # what the arm's handler does with the first signal
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.mark.parametrize("uvloop", ["1", "0"], ids=["uvloop", "asyncio"])
def test_a_signal_landing_in_a_protocol_callback_interrupts_the_run(monkeypatch, uvloop):
    if uvloop == "1" and client.loop_factory() is None:
        pytest.skip("uvloop is not installed")
    monkeypatch.setenv(client.UVLOOP_ENV, uvloop)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for _ in range(5):
            cleaned_up: list[str] = []
            with pytest.raises(KeyboardInterrupt, match="signal 15"):
                client.run_sync(_read_a_stream(cleaned_up))
            assert cleaned_up == ["yes"]  # the coroutine was cancelled, so it wrote what it had
            # and the handler is the caller's again
            assert signal.getsignal(signal.SIGTERM) is _raise_interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_left_at_its_default_is_not_taken_over():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:

        async def look() -> object:
            return signal.getsignal(signal.SIGTERM)

        assert client.run_sync(look()) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
