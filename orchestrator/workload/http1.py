"""The lean HTTP/1.1 client of a session from `client.open_session`, used for plain `http://` URLs.

`Pool` keeps the keep-alive connections of one session (one `asyncio.Protocol` per connection) and
at most `limit` requests in flight; `stream` sends one request through it. Each read goes, right in
`data_received`, to llhttp (`httptools`, the parser uvicorn uses), which reads the response head and
de-frames the chunked (or length- or close-delimited) body; its body callback feeds the SSE parser
(sse.py), and the waiting task wakes once per turn, not once per network read. That is where aiohttp
spent most of the client's CPU (a request object, a StreamReader, a future and a task step for every
read). It keeps aiohttp's semantics: the same error kinds for the same failures (a refused connection,
a connection that closes before the response ends, a timeout, a non-200 status with the start of its
body), keep-alive connections reused up to `keepalive_timeout`, at most `concurrency` requests at once,
no retry of a POST.

A connection closed or reset mid-request, or a response that is not HTTP, is `server_gone` only if the
server no longer answers HTTP (probed once, right then: `closed_error`, also used by client.py's aiohttp
path); a server that is up and cut the stream is `stream_cut`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import socket
import time
from functools import lru_cache

import httptools
import yarl

from orchestrator.workload.results import StreamedTurn
from orchestrator.workload.sse import SSEParser, complete_turn
from orchestrator.workload.wire import RequestError


class _Cut(Exception):
    """The connection closed (or the response could not be read as HTTP) before the response ended:
    `stream_chat` probes the server to tell `stream_cut` from `server_gone`."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@lru_cache(maxsize=256)
def target(endpoint: str) -> tuple[str, int, bytes] | None:
    """(host, port, the request head up to the Content-Length value) for a plain http URL; None for
    any other (https, credentials in the URL: aiohttp's business)."""
    url = yarl.URL(endpoint)
    if url.scheme != "http" or not url.raw_host or url.user is not None or url.password is not None:
        return None
    host, port = url.raw_host, url.port or 80
    netloc = f"[{host}]" if ":" in host else host
    if port != 80:
        netloc += f":{port}"
    target = url.raw_path + (f"?{url.raw_query_string}" if url.raw_query_string else "")
    head = (
        f"POST {target} HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nUser-Agent: heisenhunt\r\nContent-Length: "
    )
    return host, port, head.encode("ascii")


async def stream(
    pool: Pool, endpoint: str, target: tuple[str, int, bytes], data: bytes, timeout: float
) -> StreamedTurn:
    """One turn through `pool`: a slot, a connection (an idle one, or new), the request and its parsed
    turn, all within `timeout`; failures raise RequestError of the kinds client.py's aiohttp path gives."""
    host, port, head = target
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout  # the whole turn: waiting for a slot, connecting, the response
    parser = SSEParser(StreamedTurn(started=time.monotonic()))
    conn: _Connection | None = None
    slot = False
    try:
        if not pool.take_slot():
            async with asyncio.timeout_at(deadline):
                await pool.wait_slot()
        slot = True
        conn = pool.idle_connection(host, port)
        if conn is None:
            async with asyncio.timeout_at(deadline):
                conn = await pool.new_connection(host, port)
        turn = await conn.request(b"%s%d\r\n\r\n%s" % (head, len(data), data), parser, deadline)
    except RequestError:
        raise
    except TimeoutError as e:
        raise RequestError("timeout", f"no complete answer within {timeout:g}s") from e
    except _Cut as e:
        raise await closed_error(endpoint, e.message) from None
    except OSError as e:  # connecting failed (the request itself reports through _Cut)
        kind = "connection_refused" if errno_of(e) == errno.ECONNREFUSED else "server_gone"
        raise RequestError(kind, f"Cannot connect to host {host}:{port} [{e}]") from e
    finally:
        if conn is not None:
            pool.release(conn)
        if slot:
            pool.give_slot()
    return complete_turn(turn)


class Pool:
    """The keep-alive HTTP/1.1 connections of one `open_session`, per (host, port); at most `limit`
    requests at once (further ones wait in order, as aiohttp's connector limit makes them)."""

    def __init__(self, limit: int, connect_timeout_s: float, keepalive_s: float):
        self.limit = limit
        self.active = 0  # requests holding a slot
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.idle: dict[tuple[str, int], list[_Connection]] = {}
        self.open: set[_Connection] = set()
        self.closed = False

    def take_slot(self) -> bool:
        """A slot at once if one is free (and nobody waits for one)."""
        if self.active < self.limit and not self.waiting:
            self.active += 1
            return True
        return False

    async def wait_slot(self) -> None:
        """Wait for a slot in order; a slot handed over to a waiter that is cancelled goes on."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_slot()  # handed over just as we were cancelled
            raise

    def give_slot(self) -> None:
        while self.waiting:  # hand it over to the first waiter still waiting
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def idle_connection(self, host: str, port: int) -> _Connection | None:
        """An idle connection to (host, port) that is still open and not idle too long, if any."""
        idle = self.idle.get((host, port))
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if not conn.lost and now - conn.idle_since < self.keepalive_s:
                    return conn
                conn.close()
        return None

    async def new_connection(self, host: str, port: int) -> _Connection:
        if self.closed:
            raise RuntimeError("Session is closed")
        async with asyncio.timeout(self.connect_timeout_s):
            conn = await _connect(host, port)
        conn.key, conn.pool = (host, port), self
        self.open.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        """Back to the idle list if its response ended cleanly and it may be reused; else closed."""
        response = conn.response
        conn.response = None
        if response is not None and response.ended_cleanly() and not conn.lost and not self.closed:
            conn.idle_since = time.monotonic()
            self.idle.setdefault(conn.key, []).append(conn)
            return
        if response is not None:
            response.abandon()
        conn.close()

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)

    def close(self) -> None:
        self.closed = True
        for conn in list(self.open):
            conn.close()
        self.idle.clear()


async def _connect(host: str, port: int) -> _Connection:
    """A TCP connection to the first address of (host, port) that accepts (TCP_NODELAY on)."""
    loop = asyncio.get_running_loop()
    try:
        _literal_family(host)
    except ValueError:
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        infos = [(family, address) for family, _, _, _, address in found]
    else:  # one address: the loop connects it (TCP_NODELAY on, as asyncio and uvloop set it for TCP)
        _, conn = await loop.create_connection(_Connection, host, port)
        return conn
    errors: list[OSError] = []
    for family, address in infos:
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            errors.append(e)
            continue
        except BaseException:
            sock.close()
            raise
        _, conn = await loop.create_connection(_Connection, sock=sock)
        return conn
    if len(errors) == 1:
        raise errors[0]
    numbers = {e.errno for e in errors}
    raise OSError(numbers.pop() if len(numbers) == 1 else None, f"Multiple exceptions: {errors}")


def _literal_family(host: str) -> int:
    """The address family of an IP literal; ValueError for a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    raise ValueError(host)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the response being read gets every byte as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None
        self.lost = False
        self.idle_since = 0.0
        self.key: tuple[str, int] = ("", 0)
        self.pool: Pool | None = None

    async def request(self, data: bytes, parser: SSEParser, deadline: float) -> StreamedTurn:
        """Send one request and wait for its turn, at most until `deadline` (loop time): then the
        turn fails with TimeoutError (one timer per turn, no cancellation scope)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.response = response = _Response(parser, loop.create_future())
        timer = loop.call_at(deadline, response.expire)
        try:
            self.transport.write(data)
            return await response.future
        finally:
            timer.cancel()
            response.http = None  # the turn is over (its future done): no cycle left for the collector

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes on an idle connection: not a response to anything; never reuse it
            self.close()
            return
        response.feed(data)

    def eof_received(self) -> bool:
        self.lost = True
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.pool is not None:
            self.pool.forget(self)
        if self.response is not None:
            self.response.lost(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


#: a response head longer than this is not HTTP we read (llhttp sets no limit of its own)
_MAX_HEAD = 65536


class _Response:
    """One HTTP/1.1 response, read incrementally by llhttp (`httptools.HttpResponseParser`, which calls
    the `on_*` methods): the head (1xx interim responses skipped), then the body (chunked,
    Content-Length or until the connection closes), each de-framed piece fed to the SSE parser with the
    arrival time of its read. Its future gets the turn, or the exception the turn ended with; once it is
    done nothing more is read."""

    __slots__ = ("framed", "future", "head_bytes", "http", "now", "parser", "reusable", "status")

    def __init__(self, parser: SSEParser, future: asyncio.Future[StreamedTurn]):
        self.parser = parser
        self.future = future
        self.http: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.status = 0  # of the final response, once its head is read
        self.framed = False  # Content-Length or chunked: a body that is not read until the close
        self.reusable = False  # ended, and the connection may carry the next request
        self.head_bytes = 0
        self.now = 0.0  # arrival time of the read being parsed

    def feed(self, data: bytes) -> None:
        if self.future.done():
            self.reusable = False  # bytes after the end: the connection is out of step
            return
        self.now = time.monotonic()
        try:
            self.http.feed_data(data)  # type: ignore[union-attr]
        except httptools.HttpParserCallbackError as e:  # RequestError or a malformed event: the caller's
            self._fail(e.__context__ or e)
        except httptools.HttpParserError as e:
            if self.future.done():
                self.reusable = False  # bytes after the end
            elif self.status and self.status != 200:
                self._http_error(b"")  # e.g. 101, which llhttp stops at
            else:
                self._fail(_Cut(f"malformed HTTP response: {e}"))
        if not self.status and not self.future.done():
            self.head_bytes += len(data)
            if self.head_bytes > _MAX_HEAD:
                self._fail(_Cut(f"malformed HTTP response: no end of the head in {self.head_bytes} bytes"))

    # --- llhttp's callbacks

    def on_message_begin(self) -> None:
        if self.status:  # a second response after the final one: the connection is out of step
            raise _Cut("bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.http.get_status_code()  # type: ignore[union-attr]
        if not 100 <= status < 200 or status == 101:  # 100 Continue, 103 Early Hints: the real one follows
            self.status = status

    def on_body(self, body: bytes) -> None:
        if self.status == 200:
            self.parser.feed_slice(body, 0, len(body), self.now)
        elif not self.future.done():
            self._http_error(body)

    def on_message_complete(self) -> None:
        if not self.status:
            self.framed = False  # an interim response: its headers were not the final one's
            return
        if self.status != 200:
            self._http_error(b"")
            return
        self.reusable = self.http.should_keep_alive()  # type: ignore[union-attr]
        self.future.set_result(self.parser.finish(self.now))

    # --- the turn's end

    def _http_error(self, body: bytes) -> None:
        """A non-200 answer: the status and the start of its body, as soon as some of it is here."""
        text = body[:2000].decode("utf-8", "replace")
        self._fail(RequestError("http_status", f"HTTP {self.status}: {text.strip()[:300]}", self.status))

    def _fail(self, error: BaseException) -> None:
        self.reusable = False
        if not self.future.done():
            self.future.set_exception(error)

    def lost(self, exc: Exception | None) -> None:
        """The connection closed: the end of a body read until close, otherwise a cut."""
        self.reusable = False
        if self.future.done():
            return
        if not self.status:
            message = "server disconnected before the response head"
        elif self.status != 200:
            self._http_error(b"")
            return
        elif exc is None and not self.framed:  # the end of a body read until the close
            try:
                self.future.set_result(self.parser.finish(time.monotonic()))
            except Exception as e:
                self._fail(e)
            return
        else:
            message = "response body cut off: the connection closed before the response ended"
        if exc is not None:
            message += f" ({type(exc).__name__}: {exc})"
        self._fail(_Cut(message))

    def expire(self) -> None:
        """The turn's deadline passed before the response ended."""
        self._fail(TimeoutError())

    def ended_cleanly(self) -> bool:
        """The whole response was read, it ended the turn without an error, and the connection may
        carry the next request."""
        future = self.future
        return self.reusable and future.done() and not future.cancelled() and future.exception() is None

    def abandon(self) -> None:
        """The caller stopped waiting (a timeout, a cancellation, an error): nothing more is reported,
        and an exception already set counts as retrieved."""
        self.reusable = False
        future = self.future
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()


#: how long the probe after a closed stream waits for the server's answer
PROBE_TIMEOUT_S = 5.0


async def closed_error(endpoint: str, message: str) -> RequestError:
    """A connection that closed mid-request: `stream_cut` if the server still answers HTTP, else
    `server_gone`. An answer is needed, not just a connection: the kernel completes a TCP handshake on
    a listening socket by itself, so a dying server's port still accepts for a moment."""
    if await _answers_http(yarl.URL(endpoint)):
        return RequestError("stream_cut", f"{message}; the server is still up (it cut the stream)")
    return RequestError("server_gone", f"{message}; the server no longer answers")


async def _answers_http(url: yarl.URL) -> bool:
    """Whether `url`'s server sends an HTTP status line (any status) to a GET within PROBE_TIMEOUT_S."""
    writer = None
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(url.host, url.port)
            writer.write(f"GET / HTTP/1.1\r\nHost: {url.host}\r\nConnection: close\r\n\r\n".encode())
            return (await reader.readline()).startswith(b"HTTP/")
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def errno_of(error: BaseException) -> int | None:
    """The OS errno behind an aiohttp connection error, looking through its causes."""
    seen: BaseException | None = error
    for _ in range(5):
        if seen is None:
            return None
        number = getattr(seen, "errno", None) or getattr(getattr(seen, "os_error", None), "errno", None)
        if number:
            return number
        seen = seen.__cause__ or seen.__context__
    return None
