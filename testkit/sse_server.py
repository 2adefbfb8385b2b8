"""An OpenAI-style chat-completions server in a process of its own, for the latency tests.

`sse_server()` starts it (`python sse_server.py ...`), waits until it answers, and kills it on exit. Its own
process, not a thread of the test: the agent sees the server's socket writes come from another process than the
client's, as on an inference host, and the test's own threads cannot delay them.

Two kinds:
- "uvicorn": FastAPI on uvicorn (httptools and uvloop), what vLLM serves with.
- "single-write": a small asyncio server that writes the response headers and the first SSE event in one write,
  which uvicorn cannot do (it writes the headers as soon as the app sends http.response.start).

Routes of "uvicorn" ("single-write" answers every request as a streamed completion):
- GET /health: 200 with an empty body (Content-Length: 0), as vLLM's.
- POST /v1/empty: 204, no body.
- POST /v1/chat/completions: {"stream": true} answers text/event-stream (chunked): the first `data: {...}` event
  after `prefill_ms`, each of the other `tokens - 1` events `token_ms` after the one before, then `data: [DONE]`.
  {"stream": false} answers one JSON body (Content-Length) after prefill_ms + (tokens - 1) * token_ms.
  prefill_ms, token_ms and tokens come from the request's JSON, else from the server's launch arguments.

What each does on the wire was checked with strace -f on the server and tcpdump on lo (uvicorn 0.54, httptools
0.9 and h11 0.16 alike; byte counts for 2-token requests; every write went out as one segment, uvloop and the
single-write server both set TCP_NODELAY):
- stream: write(headers, 169 B) when the handler returns; after the prefill write(first event, 170 B); one write
  per event after each token delay; then write(`data: [DONE]`, 19 B) and write(`0\r\n\r\n`, 5 B) back to back.
- stream, single-write: write(headers + first event, 270 B) after the prefill; then as above.
- JSON: write(headers, 146 B) and write(body, 197 B) back to back (0.1-2 ms apart), after the whole generation.
- 204: one write(headers, 101 B), no body.
- `Expect: 100-continue`: write(`HTTP/1.1 100 Continue\r\n\r\n`, 25 B) when the route reads the body, before the
  client has sent it; the final response after.
- pipelined: both requests in one read; the second response's headers only after the first's last write.
- client gone after the headers: uvicorn reads EOF and closes at once; the stream writes nothing more (uvicorn
  announces ASGI 2.3, so Starlette cancels the response when it receives http.disconnect).
"""

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence

import h11

CHAT = "/v1/chat/completions"
# The client's port as the server saw it, on every response but /health's: which requests shared a connection,
# found the same way for every client library.
PEER_PORT = "x-peer-port"
KINDS = ("uvicorn", "single-write")


@dataclass(frozen=True)
class Server:
    kind: str
    port: int
    pid: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def sse_server(kind: str = "uvicorn", *, port: int = 0, http: str = "httptools", prefill_ms: float = 45.0,
               token_ms: float = 20.0, tokens: int = 8, timeout: float = 15.0,
               keep_alive_s: float = 5.0, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> Iterator[Server]:
    """The server on `host`:`port` (0: a free port, chosen by the server's own bind), ready to answer. `prefix` runs
    it through another command that execs it (`nsenter --net=...`: a server in a pod's network namespace).

    The process is killed on exit, even when the test fails, and dies with the test process if that is killed
    (PR_SET_PDEATHSIG). `http` is uvicorn's HTTP implementation ("httptools" or "h11"); `keep_alive_s` how long it keeps
    an idle kept-alive connection open (uvicorn's default, 5 s)."""
    assert kind in KINDS, kind
    argv = [*prefix, sys.executable, os.path.abspath(__file__), "--kind", kind, "--host", host, "--port", str(port),
            "--http", http,
            "--prefill-ms", str(prefill_ms), "--token-ms", str(token_ms), "--tokens", str(tokens),
            "--keep-alive-s", str(keep_alive_s)]
    log = tempfile.TemporaryFile()
    parent = os.getpid()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, preexec_fn=lambda: _die_with(parent))
    try:
        # The server binds and listens itself (as a real one does: the agent learns serving cgroups from listen()),
        # so no other process can take the port between a pick and a bind. It prints the port once it serves, and
        # is not probed over the network: an agent watching the port counts only the test's requests.
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            raise RuntimeError(f"sse_server {kind} did not start: {_tail(proc, log)}")
        srv = Server(kind, int(line), proc.pid, host)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


def _die_with(parent: int) -> None:
    """In the child before exec: SIGKILL when the test process dies, whatever kills it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _tail(proc: subprocess.Popen, log: Any) -> str:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    return f"exit {proc.returncode}\n" + log.read().decode(errors="replace")[-3000:]


# --- In the server process. ---

@dataclass(frozen=True)
class Generation:
    prefill_s: float
    token_s: float
    tokens: int

    @classmethod
    def of(cls, req: dict[str, Any], defaults: argparse.Namespace) -> "Generation":
        return cls(float(req.get("prefill_ms", defaults.prefill_ms)) / 1000,
                   float(req.get("token_ms", defaults.token_ms)) / 1000,
                   max(1, int(req.get("tokens", defaults.tokens))))

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE events, each yielded (and so written) as soon as its delay has passed."""
        await asyncio.sleep(self.prefill_s)
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.token_s)
            chunk = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": "test",
                     "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                  "finish_reason": "stop" if i == self.tokens - 1 else None}]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def completion(self) -> dict[str, Any]:
        text = "".join(f"tok{i} " for i in range(self.tokens))
        return {"id": "chatcmpl-test", "object": "chat.completion", "model": "test",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"completion_tokens": self.tokens}}


def fastapi_app(defaults: argparse.Namespace) -> Any:
    # Imported here, not by the tests that only start the server; and no `from __future__ import annotations` in
    # this module: FastAPI reads the route's parameter annotations (`request: Request`) at run time.
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response()

    def peer(request: Request) -> dict[str, str]:
        return {PEER_PORT: str(request.client.port)}

    @app.post("/v1/empty")
    async def empty(request: Request) -> Response:
        return Response(status_code=204, headers=peer(request))

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        # Reading the body is what makes uvicorn answer `Expect: 100-continue` with its interim response.
        req = await request.json()
        gen = Generation.of(req, defaults)
        if req.get("stream"):
            return StreamingResponse(gen.events(), media_type="text/event-stream", headers=peer(request))
        await asyncio.sleep(gen.prefill_s + (gen.tokens - 1) * gen.token_s)
        return JSONResponse(gen.completion(), headers=peer(request))

    return app


async def warm_up(app: Any) -> None:
    """One streamed completion through the app, in this process: a first request imports what the routes need
    (~15 ms here, more on a busy machine), which is no token's latency. No socket, so no agent sees it."""
    body = json.dumps({"stream": True, "prefill_ms": 0, "tokens": 1}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",  # as uvicorn
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    requests = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client never leaves

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["status"] == 200 and sent[-2]["body"] == b"data: [DONE]\n\n", sent


async def single_write_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                  defaults: argparse.Namespace) -> None:
    # asyncio sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP, and accept() inherits the listening
    # socket's 0: without it, Nagle holds a token behind the client's delayed ACK (seen: 40 ms gaps).
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            request, body = None, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            if request is None:
                return
            events = Generation.of(json.loads(body or b"{}"), defaults).events()
            headers = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked"),
                       (PEER_PORT, str(writer.get_extra_info("peername")[1]))]
            head = conn.send(h11.Response(status_code=200, reason=b"OK", headers=headers))
            writer.write(head + conn.send(h11.Data(data=await anext(events))))
            async for data in events:
                writer.write(conn.send(h11.Data(data=data)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            conn.start_next_cycle()
    except (ConnectionError, h11.RemoteProtocolError):
        pass
    finally:
        writer.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=KINDS, default="uvicorn")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--http", choices=("httptools", "h11"), default="httptools")
    p.add_argument("--prefill-ms", type=float, default=45.0)
    p.add_argument("--token-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=8)
    # uvicorn closes a kept-alive connection idle this long (its default, 5 s; vLLM's --timeout-keep-alive).
    p.add_argument("--keep-alive-s", type=float, default=5.0)
    args = p.parse_args()
    sock = socket.create_server((args.host, args.port), backlog=1024)
    port = sock.getsockname()[1]
    if args.kind == "uvicorn":
        import uvicorn

        app = fastapi_app(args)

        class Serving(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await warm_up(app)
                await super().startup(sockets)
                print(port, flush=True)

        config = uvicorn.Config(app, http=args.http, loop="uvloop", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, timeout_keep_alive=args.keep_alive_s)
        Serving(config).run(sockets=[sock])
    else:
        async def serve() -> None:
            server = await asyncio.start_server(lambda r, w: single_write_connection(r, w, args), sock=sock)
            print(port, flush=True)
            await server.serve_forever()

        asyncio.run(serve())

if __name__ == "__main__":
    main()
