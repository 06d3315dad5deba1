"""The PD hand-off of the simulated deployment: the prefill's bootstrap server and the decode's client.

Modelled on SGLang's disaggregation (mooncake backend), reduced to what the experiment needs:

- The prefill runs a bootstrap HTTP server on `--disaggregation-bootstrap-port`. A decode registers
  once per prefill (`PUT /route`, with its address `host:port` and a session id fresh at every
  decode start) and gets the prefill's identity back. The prefill keeps **the first session it saw
  for each decode address** (its KV buffers); it does not rebind when a decode at that address
  registers again. That is the stale bootstrap state of the co-restart rule.
- For each request the router sends the same body, with `bootstrap_room`, to both servers. The
  decode polls `GET /kv/<room>` on the prefill named by `bootstrap_host`/`bootstrap_port` (its own
  bootstrap port when the router sent none). The room's handshake completes when the prefill has the
  request and the decode's session is the one the prefill holds for that address; after the prefill
  batch ran, the prefill transfers the hand-off (prompt size and the prefill's **effective config**:
  parsed `SGLANG_*` env and flags) to the session it holds. Decode feeds that config to the fault
  model, so corruption can depend on both roles, as in production.
- Failures: the decode gives up after `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` in Bootstrapping (prefill
  unreachable, or holding another session for this address: a decode restarted alone) or after
  `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` waiting for KV after the handshake; it then forgets its
  registration with that prefill (so a restarted *prefill* recovers on the next request). The prefill
  fails a request whose decode never showed up within the bootstrap timeout. Timeouts are modelled
  seconds, multiplied by the time scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("sglang.sim.disaggregation")

BOOTSTRAPPING, WAITING, DONE = "Bootstrapping", "WaitingForInput", "Success"


class BootstrapFailed(RuntimeError):
    def __init__(self, phase: str, message: str):
        self.phase = phase
        super().__init__(message)


@dataclass(eq=False)
class Room:
    created: float = field(default_factory=time.monotonic)
    prefill_seen: bool = False
    decode_addr: str | None = None
    session: str | None = None
    delivered_to: str | None = None
    handoff: dict[str, Any] | None = None
    polled: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def touch(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class BootstrapState:
    """The prefill side: decode registrations and per-room rendezvous."""

    def __init__(self, instance: str, info: dict[str, Any], ttl_s: float):
        self.instance = instance
        self.info = info  # sent to a registering decode
        self.ttl_s = ttl_s
        self.peers: dict[str, str] = {}  # decode address -> session (first registration wins)
        self.rooms: dict[int, Room] = {}

    def room(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = Room()
        return room

    def register(self, decode_addr: str, session: str) -> None:
        first = self.peers.setdefault(decode_addr, session)
        if first != session:
            # SGLang keeps the first registration's KV args for this peer: the new session is ignored
            log.debug("decode %s registered again with session %s; keeping %s", decode_addr, session, first)

    def state_for(self, room: Room, decode_addr: str, session: str) -> str:
        if room.delivered_to == session:
            return DONE
        if room.delivered_to is None and room.prefill_seen and self.peers.get(decode_addr) == session:
            return WAITING
        return BOOTSTRAPPING

    def note_prefill(self, room_id: int) -> None:
        room = self.room(room_id)
        room.prefill_seen = True
        room.touch()

    async def transfer(self, room_id: int, handoff: dict[str, Any], timeout_s: float) -> None:
        """After the prefill batch: wait for the decode of this room, then send to the session this
        prefill holds for the decode's address. Raises BootstrapFailed if no decode shows up."""
        room = self.room(room_id)
        try:
            await asyncio.wait_for(room.polled.wait(), timeout_s)
        except TimeoutError as e:
            self.rooms.pop(room_id, None)
            raise BootstrapFailed(BOOTSTRAPPING, f"no decode connected within {timeout_s:.1f}s") from e
        target = self.peers.get(room.decode_addr or "")
        if target is None:
            self.rooms.pop(room_id, None)
            raise BootstrapFailed(
                BOOTSTRAPPING, f"decode {room.decode_addr} is not registered with this prefill"
            )
        room.delivered_to, room.handoff = target, handoff
        room.touch()

    def sweep(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for room_id in [r for r, room in self.rooms.items() if room.created < cutoff]:
            del self.rooms[room_id]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/route", self._route_get)
        app.router.add_put("/route", self._route_put)
        app.router.add_get("/kv/{room}", self._kv)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route_get(self, request: web.Request) -> web.Response:
        return web.json_response(self.info)

    async def _route_put(self, request: web.Request) -> web.Response:
        body = await request.json()
        addr, session = body.get("decode_addr"), body.get("session")
        if not isinstance(addr, str) or not isinstance(session, str):
            return web.json_response({"error": "decode_addr and session are required"}, status=400)
        self.register(addr, session)
        return web.json_response(self.info)

    async def _kv(self, request: web.Request) -> web.Response:
        try:
            room_id = int(request.match_info["room"])
            addr, session = request.query["decode_addr"], request.query["session"]
            wait = min(float(request.query.get("wait", "1")), 30.0)
        except (KeyError, ValueError):
            return web.json_response({"error": "need room, decode_addr, session, wait"}, status=400)
        since = request.query.get("since", "")
        room = self.room(room_id)
        if room.decode_addr is None:
            room.decode_addr, room.session = addr, session
            room.polled.set()
        deadline = time.monotonic() + wait
        while True:
            state = self.state_for(room, addr, session)
            remaining = deadline - time.monotonic()
            if state != since or remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):  # timed out: answer the current state
                await asyncio.wait_for(room.changed.wait(), remaining)
        if state == DONE:
            self.rooms.pop(room_id, None)
            return web.json_response({"state": state, "handoff": room.handoff})
        return web.json_response({"state": state})


class BootstrapClient:
    """The decode side: registration cache and the per-request hand-off poll."""

    def __init__(self, decode_addr: str, session: str, bootstrap_timeout_s: float, waiting_timeout_s: float):
        self.decode_addr = decode_addr
        self.session = session
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.waiting_timeout_s = waiting_timeout_s
        self.registered: set[str] = set()
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def fetch(self, host: str, port: int, room_id: int) -> dict[str, Any]:
        """The hand-off of `room_id` from the prefill at host:port, or BootstrapFailed."""
        assert self.http is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.bootstrap_timeout_s
        addr = f"{host}:{port}"
        state, last_error = BOOTSTRAPPING, "the prefill never completed the handshake for this room"
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BootstrapFailed(state, last_error)
                try:
                    if addr not in self.registered:
                        await self._register(addr, remaining)
                    reply = await self._poll(addr, room_id, state, min(remaining, 5.0))
                except (aiohttp.ClientError, TimeoutError) as e:
                    last_error = (
                        f"cannot reach the prefill bootstrap server at {addr}: {e or type(e).__name__}"
                    )
                    self.registered.discard(addr)
                    await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
                    continue
                if reply["state"] == DONE:
                    return reply["handoff"]
                if reply["state"] == WAITING and state == BOOTSTRAPPING:
                    state, deadline = WAITING, loop.time() + self.waiting_timeout_s
                    last_error = "the prefill completed the handshake but its KV never arrived"
        except BootstrapFailed:
            self.registered.discard(addr)  # re-register next time: a restarted prefill recovers
            raise

    async def _register(self, addr: str, remaining: float) -> None:
        timeout = aiohttp.ClientTimeout(total=min(remaining, 10.0))
        async with self.http.put(
            f"http://{addr}/route",
            json={"decode_addr": self.decode_addr, "session": self.session},
            timeout=timeout,
        ) as r:
            r.raise_for_status()
        self.registered.add(addr)

    async def _poll(self, addr: str, room_id: int, since: str, wait: float) -> dict[str, Any]:
        params = {
            "decode_addr": self.decode_addr,
            "session": self.session,
            "since": since,
            "wait": f"{wait:.3f}",
        }
        timeout = aiohttp.ClientTimeout(total=wait + 10.0)
        async with self.http.get(f"http://{addr}/kv/{room_id}", params=params, timeout=timeout) as r:
            r.raise_for_status()
            return await r.json()
