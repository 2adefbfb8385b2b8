"""Real clients for the latency tests, each recording what its caller would have seen, per request.

Times are `time.perf_counter()` values, comparable across the requests of one process. httpx and aiohttp are the
clients an OpenAI SDK user or a load generator has: a pool of keep-alive connections, requests in parallel. The
raw-socket clients (h11 for the framing, the writes our own) make the shapes those libraries never make: a body
in its own segment, `Expect: 100-continue`, two pipelined requests, a client gone before the first token.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp
import anyio
import h11
import httpx

from testkit.sse_server import CHAT, PEER_PORT

# httpx's transport imports anyio's asyncio backend at its first connection (~30 ms here): not in a request's time.
anyio.run(anyio.sleep, 0)


@dataclass
class Timing:
    start: float  # just before the request's first byte was handed to the socket
    issued: float = -1.0  # when the caller asked (default: start); start - issued: waiting for the pool, connecting
    new_connection: bool = False  # the request opened its connection (else it reused a kept-alive one)
    status: int = 0
    headers: float | None = None  # the response's headers parsed
    # Each non-empty piece of body as the client got it: a read for httpx and aiohttp, an HTTP chunk for raw ones.
    chunks: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # each SSE `data:` event but [DONE], when it was complete
    done: bool = False  # `data: [DONE]` seen
    end: float | None = None  # the body complete (or, for a client that hangs up, the close)
    body: bytes = b""
    local_port: int = 0  # the client's port: requests with the same one went on the same connection
    interim: list[tuple[int, float]] = field(default_factory=list)  # (status, time) of each 1xx response

    def __post_init__(self) -> None:
        if self.issued < 0:
            self.issued = self.start

    @property
    def ttfb(self) -> float:
        """Request start to the response headers."""
        assert self.headers is not None
        return self.headers - self.start

    @property
    def ttft(self) -> float:
        """Request start to the first body bytes: for a stream, the first token."""
        assert self.chunks
        return self.chunks[0] - self.start

    @property
    def total(self) -> float:
        assert self.end is not None
        return self.end - self.start

    @property
    def gaps(self) -> list[float]:
        """Between consecutive tokens (SSE events, so two events that came in one read give a gap of ~0)."""
        return [b - a for a, b in zip(self.tokens, self.tokens[1:])]

    def got(self, data: bytes, now: float) -> None:
        if not data:
            return
        self.chunks.append(now)
        self.body += data
        # Events end with a blank line; only the ones completed by this piece are new.
        before = self.body[:-len(data)].count(b"\n\n")
        for event in self.body.split(b"\n\n")[before:-1]:
            if event == b"data: [DONE]":
                self.done = True
            elif event.startswith(b"data:"):
                self.tokens.append(now)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least a fraction q (0 < q <= 1) of the values at or below it."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def httpx_requests(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int = 4,
                   path: str = CHAT) -> list[Timing]:
    """POST each body, all at once, through one httpx.AsyncClient whose pool keeps at most `concurrency`
    connections alive and reuses them; a Timing per body, in the bodies' order.

    On the wire (tcpdump): httpx writes the request head and the JSON body separately, two segments (215 + 56 B)
    0.1-1.3 ms apart, so the server may get the request in two arrivals and read it in one or two reads."""
    async def run() -> list[Timing]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30) as client:
            async def one(body: dict[str, Any]) -> Timing:
                t = Timing(time.perf_counter())

                async def trace(name: str, _: Any) -> None:
                    # httpx's hook (its "trace" extension): the request's time starts at its first write.
                    if name == "connection.connect_tcp.complete":
                        t.new_connection = True
                    elif name == "http11.send_request_headers.started":
                        t.start = time.perf_counter()

                req = client.build_request("POST", path, json=body, extensions={"trace": trace})
                resp = await client.send(req, stream=True)  # returns once the headers are in
                t.headers, t.status = time.perf_counter(), resp.status_code
                t.local_port = int(resp.headers.get(PEER_PORT, 0))
                async for data in resp.aiter_raw():
                    t.got(data, time.perf_counter())
                t.end = time.perf_counter()
                await resp.aclose()
                return t

            return list(await asyncio.gather(*(one(b) for b in bodies)))

    return asyncio.run(run())


def aiohttp_requests(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int = 4,
                     path: str = CHAT) -> list[Timing]:
    """As httpx_requests, through one aiohttp.ClientSession whose connector keeps `concurrency` connections.

    On the wire (tcpdump): aiohttp writes head and body together, one segment (261 B)."""
    # aiohttp's hooks: the request's time starts when it has its connection, just before its one write.
    async def connected(_: Any, ctx: Any, __: Any) -> None:
        ctx.trace_request_ctx.start = time.perf_counter()

    async def created(session: Any, ctx: Any, params: Any) -> None:
        ctx.trace_request_ctx.new_connection = True
        await connected(session, ctx, params)

    async def run() -> list[Timing]:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(created)
        trace.on_connection_reuseconn.append(connected)
        async with aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=concurrency),
                                         trace_configs=[trace], timeout=aiohttp.ClientTimeout(total=30)) as session:
            async def one(body: dict[str, Any]) -> Timing:
                t = Timing(time.perf_counter())
                async with session.post(path, data=json.dumps(body).encode(), trace_request_ctx=t,
                                        headers={"content-type": "application/json"}) as resp:
                    t.headers, t.status = time.perf_counter(), resp.status
                    t.local_port = int(resp.headers.get(PEER_PORT, 0))
                    async for piece in resp.content.iter_any():
                        t.got(piece, time.perf_counter())
                    t.end = time.perf_counter()
                return t

            return list(await asyncio.gather(*(one(b) for b in bodies)))

    return asyncio.run(run())


class RawClient:
    """One TCP connection with TCP_NODELAY, each sendall() one write and so (nodelay, loopback) one segment; h11
    frames the requests and parses the responses. `source`: the client's address (127.0.0.2, ... on loopback);
    `host`: the server's."""

    def __init__(self, port: int, timeout: float = 30.0, source: str | None = None, host: str = "127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.h11 = h11.Connection(h11.CLIENT)
        self.arrived = 0.0  # when the bytes h11 is parsing were received

    def close(self) -> None:
        self.sock.close()

    def request(self, body: dict[str, Any], path: str = CHAT) -> Timing:
        """One request on this connection, its head and body in one write; its Timing once the response is in."""
        head, rest = request_bytes(self.h11, body, path)
        t = Timing(time.perf_counter())
        self.sock.sendall(head + rest)
        self.read(t)
        self.h11.start_next_cycle()
        return t

    def read(self, t: Timing, until: type = h11.EndOfMessage) -> Timing:
        """Fill t from the response up to the first event of type `until` (the headers: h11.Response)."""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(65536)
                self.arrived = time.perf_counter()
                self.h11.receive_data(data)
            elif isinstance(event, h11.Data):
                t.got(event.data, self.arrived)
            elif isinstance(event, h11.InformationalResponse):
                t.interim.append((event.status_code, self.arrived))
            elif isinstance(event, h11.Response):
                t.status, t.headers = event.status_code, self.arrived
                t.local_port = self.sock.getsockname()[1]
            elif isinstance(event, h11.EndOfMessage):
                t.end = self.arrived
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection mid-response")
            if isinstance(event, until):
                return t


def request_bytes(conn: h11.Connection, body: dict[str, Any], path: str = CHAT,
                  expect: bool = False) -> tuple[bytes, bytes]:
    """(request line and headers, body) of a JSON POST, framed by `conn`."""
    data = json.dumps(body).encode()
    headers = [("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", str(len(data)))]
    headers += [("expect", "100-continue")] if expect else []
    head = conn.send(h11.Request(method="POST", target=path, headers=headers))
    return head, conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())


def split_body_request(port: int, body: dict[str, Any], gap_s: float = 0.005, path: str = CHAT) -> Timing:
    """Request line and headers in one write, the JSON body `gap_s` later in a second, so the server gets the
    request in two arrivals. Seen: segments of 107 and 63 B 5 ms apart, and uvicorn read them in two reads."""
    raw = RawClient(port)
    try:
        head, rest = request_bytes(raw.h11, body, path)
        t = Timing(time.perf_counter(), new_connection=True)
        raw.sock.sendall(head)
        time.sleep(gap_s)
        raw.sock.sendall(rest)
        return raw.read(t)
    finally:
        raw.close()


def expect_continue_request(port: int, body: dict[str, Any], path: str = CHAT) -> Timing:
    """Headers with `Expect: 100-continue`, then the body only once the server's `100 Continue` came (in
    t.interim), as curl does for large uploads; httpx and aiohttp cannot send Expect. Seen: head (129 B), the
    server's 25 B interim response, the body (63 B), then the final response: four segments in that order."""
    raw = RawClient(port)
    try:
        head, rest = request_bytes(raw.h11, body, path, expect=True)
        t = Timing(time.perf_counter(), new_connection=True)
        raw.sock.sendall(head)
        raw.read(t, until=h11.InformationalResponse)
        raw.sock.sendall(rest)
        return raw.read(t)
    finally:
        raw.close()


def pipelined_requests(port: int, first: dict[str, Any], second: dict[str, Any], path: str = CHAT) -> list[Timing]:
    """Both requests in one write on one connection, before any response (HTTP/1.1 pipelining); both Timings
    start at that write. Seen: one 340 B segment, one read by uvicorn, the responses in order."""
    raw = RawClient(port)
    try:
        # h11 frames a client's next request only once this response is complete: the second request's bytes
        # come from a connection object of their own, and go through raw.h11 afterwards only to move its state.
        wire = b"".join(request_bytes(raw.h11, first, path) + request_bytes(h11.Connection(h11.CLIENT), second, path))
        t1 = Timing(time.perf_counter(), new_connection=True)
        t2 = Timing(t1.start)
        raw.sock.sendall(wire)
        raw.read(t1)
        raw.h11.start_next_cycle()
        request_bytes(raw.h11, second, path)
        return [t1, raw.read(t2)]
    finally:
        raw.close()


def disconnect_before_first_token(port: int, body: dict[str, Any], path: str = CHAT) -> Timing:
    """A streaming request abandoned once the headers are in, before the first event (give it a prefill delay):
    the client closes, as a user pressing stop does. t.end is the close; t.chunks stays empty. Seen: request,
    headers, the client's FIN ~0.3 ms after them and the server's right back; no event written."""
    raw = RawClient(port)
    try:
        t = Timing(time.perf_counter(), new_connection=True)
        raw.sock.sendall(b"".join(request_bytes(raw.h11, {**body, "stream": True}, path)))
        raw.read(t, until=h11.Response)
        assert not raw.h11.trailing_data[0], "body bytes came with the headers: give the request a prefill delay"
    finally:
        raw.close()
    t.end = time.perf_counter()
    return t
