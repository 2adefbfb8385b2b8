"""Time to first token and inter-token gaps against a real engine: llama.cpp's llama-server on CPU, generating real
tokens from the tiny model (testkit/tiny_llama.py), streamed to the official OpenAI SDK (tenant `chat`, from
127.0.0.2) and to httpx (tenant `batch`, from 127.0.0.3) at once, in every latency mode this kernel offers.

Prompts run from a few to ~1,700 tokens, so prefill, and the time to first token with it, really varies (10 to
~400 ms); both tenants' requests share the engine's slots, so decode competes for the CPU. What the agent measures
in the kernel is compared per tenant with what each client saw. Runs as root with BPF; CI=true makes a missing
capability or engine a failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterator, Sequence

import httpx
import pytest
from openai import AsyncOpenAI

from qosagent.latency.capability import Latency
from qosagent.latency.model import TenantLatency
from tests.integration import llamacpp_helpers
from tests.integration.latency_helpers import close_to, latency_capability
from tests.kernel_modes import latency_modes
from testkit import llamacpp
from testkit.sse_client import Timing, percentile

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

N = 32  # streamed requests per tenant
TOKENS = 12  # generated per request
CHAT, BATCH = "127.0.0.2", "127.0.0.3"
SLOTS, CONCURRENCY = 4, 2  # two streams of each tenant at a time, on four slots
# llama-server closes the connection after each streamed response (its stream's last step returns false to
# cpp-httplib, which then drops the connection), a little after the stream's end: the pool sees that close and
# reconnects, unless the next request goes out in the instant before it arrives ("Server disconnected without
# sending a response"). A user's pause between two requests; the SDK's retries stay off, so none is hidden.
AFTER = 0.02


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[llamacpp.LlamaServer]:
    with llamacpp_helpers.engine(tmp_path_factory.mktemp("llamacpp"), slots=SLOTS) as srv:
        yield srv


@pytest.fixture(params=latency_modes())
def agent(request: pytest.FixtureRequest, bpf: None, engine: llamacpp.LlamaServer) -> Iterator[Latency]:
    port = engine.port
    with latency_capability(request.param, port, [
            {"name": "chat", "tier": "gold", "match": {"cidrs": [f"{CHAT}/32"], "ports": [port]}},
            {"name": "batch", "tier": "bronze", "match": {"cidrs": [f"{BATCH}/32"], "ports": [port]}}]) as cap:
        yield cap


def lengths(seed: int) -> list[int]:
    """Prompt lengths in words (about 2.7 tokens each): short to long, shuffled by the seed."""
    words = [5 + (i * 613 + seed * 97) % 640 for i in range(N)]
    return words


KEY = "x-test-request"  # which request a write belongs to, by a header of the test's


class Reads(httpx.AsyncByteStream):
    """A response body, noting when each SSE event of it was read off the socket: the server writes each event on
    its own, so events that came in one read were written back to back (their gaps, for the client, are 0)."""

    def __init__(self, inner: Any, at: list[float]):
        self.inner, self.at = inner, at

    async def __aiter__(self) -> Any:
        async for piece in self.inner:
            now = time.perf_counter()
            self.at.extend([now] * piece.count(b"\n\n"))
            yield piece

    async def aclose(self) -> None:
        await self.inner.aclose()


class Traced(httpx.AsyncHTTPTransport):
    """httpx's transport from a source address, marking when each request's first byte is written and when each
    piece of its body is read: the clients' times start and stop where the kernel's do (the OpenAI SDK builds its
    requests itself, so its trace goes in here)."""

    def __init__(self, source: str, starts: dict[str, float], reads: dict[str, list[float]]):
        super().__init__(local_address=source, limits=httpx.Limits(max_connections=CONCURRENCY,
                                                                   max_keepalive_connections=CONCURRENCY))
        self.starts, self.reads = starts, reads

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = request.headers[KEY]

        async def trace(name: str, _: Any) -> None:
            if name == "http11.send_request_headers.started":
                self.starts[key] = time.perf_counter()

        request.extensions = {**request.extensions, "trace": trace}
        resp = await super().handle_async_request(request)
        resp.stream = Reads(resp.stream, self.reads.setdefault(key, []))
        return resp


async def openai_streams(url: str, prompts: Sequence[str], done_at: list[float]) -> list[Timing]:
    """Each prompt as a streamed chat completion through the OpenAI SDK: a Timing whose tokens are the chunks
    with content (the first arrives with the role's chunk, in one body read)."""
    starts: dict[str, float] = {}
    reads: dict[str, list[float]] = {}
    async with httpx.AsyncClient(transport=Traced(CHAT, starts, reads), timeout=60) as http, \
            AsyncOpenAI(base_url=url + "/v1", api_key="none", http_client=http, max_retries=0) as client:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int, content: str) -> Timing:
            async with sem:
                t = Timing(time.perf_counter())
                stream = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": content}], max_tokens=TOKENS, stream=True,
                    extra_headers={KEY: str(i)})
                t.headers = time.perf_counter()
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        t.tokens.append(time.perf_counter())
                t.end, t.done, t.start, t.chunks = time.perf_counter(), True, starts[str(i)], reads[str(i)]
                await asyncio.sleep(AFTER)
                return t

        out = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        done_at.append(time.monotonic())
        await until_counted(done_at)
    return out


async def httpx_streams(url: str, prompts: Sequence[str], done_at: list[float]) -> list[Timing]:
    """Each prompt as a streamed chat completion through httpx, its SSE events read off the raw body."""
    starts: dict[str, float] = {}
    reads: dict[str, list[float]] = {}
    async with httpx.AsyncClient(transport=Traced(BATCH, starts, reads), base_url=url, timeout=60) as client:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int, content: str) -> Timing:
            async with sem:
                t = Timing(time.perf_counter())
                req = client.build_request("POST", "/v1/chat/completions", json=llamacpp.chat(content, TOKENS),
                                           headers={KEY: str(i)})
                resp = await client.send(req, stream=True)
                t.headers, t.status = time.perf_counter(), resp.status_code
                async for data in resp.aiter_raw():
                    t.got(data, time.perf_counter())
                t.end = time.perf_counter()
                await resp.aclose()
                t.start = starts[str(i)]
                await asyncio.sleep(AFTER)
                t = content_only(t)
                t.chunks = reads[str(i)]
                return t

        out = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        done_at.append(time.monotonic())
        await until_counted(done_at)
    return out


def content_only(t: Timing) -> Timing:
    """The events that carry a token: not the finish chunk (its delta is empty), nor [DONE]."""
    events = [e for e in t.body.split(b"\n\n") if e.startswith(b"data:") and e != b"data: [DONE]"]
    t.tokens = [at for at, e in zip(t.tokens, events) if json.loads(e[5:])["choices"][0]["delta"].get("content")]
    return t


async def until_counted(done_at: list[float]) -> None:
    """Keep the connections open (kept alive, idle) until the test has read the agent's counts."""
    while len(done_at) < 3:
        await asyncio.sleep(0.02)


def test_ttft_and_inter_token_gaps_match_openai_and_httpx_per_tenant(engine: llamacpp.LlamaServer,
                                                                     agent: Latency) -> None:
    chat_prompts = [llamacpp.prompt(n, 1000 + i) for i, n in enumerate(lengths(1))]
    batch_prompts = [llamacpp.prompt(n, 2000 + i) for i, n in enumerate(lengths(2))]
    done_at: list[float] = []
    counted: dict[str, Any] = {}

    async def run() -> tuple[list[Timing], list[Timing]]:
        async def watch() -> None:
            # Both clients done, their connections still open: the counts must be complete within 1 s.
            while len(done_at) < 2:
                await asyncio.sleep(0.01)
            last = max(done_at)
            while time.monotonic() - last < 1.0:
                got = agent.collect().tenants
                if all(got.get(n) is not None and got[n].requests >= N for n in ("chat", "batch")):
                    break
                await asyncio.sleep(0.05)
            counted["after_s"] = time.monotonic() - last
            counted["tenants"] = agent.collect().tenants
            done_at.append(time.monotonic())

        chat, batch, _ = await asyncio.gather(openai_streams(engine.url, chat_prompts, done_at),
                                              httpx_streams(engine.url, batch_prompts, done_at), watch())
        return chat, batch

    chat, batch = asyncio.run(run())
    tenants: dict[str, TenantLatency] = counted["tenants"]
    assert counted["after_s"] <= 1.0, counted
    for name, timings in (("chat", chat), ("batch", batch)):
        t = tenants[name]
        assert all(x.done and len(x.tokens) == TOKENS for x in timings), [len(x.tokens) for x in timings]
        # Counts exact: every request, every first token, nothing left unpaired.
        assert (t.requests, t.ttft.count, t.headers.count, t.unpaired) == (N, N, N, 0), (name, t)
        assert t.no_ttft == {} and t.pipelined == 0, (name, t.no_ttft, t.pipelined)
        ttft = [x.ttft for x in timings]
        # The prompts' lengths do show in the time to first token: long prefill is many times a short one.
        assert percentile(ttft, 0.95) > 4 * percentile(ttft, 0.05), (name, sorted(ttft))
        for q in (0.5, 0.95):
            assert close_to(t.ttft.quantile(q), percentile(ttft, q)), (name, q, t.ttft.quantile(q),
                                                                       percentile(ttft, q))
        # The server writes each event on its own (the role's, then a token each, the finish chunk, [DONE]) and
        # then the chunked end: the agent's gaps are between those writes, the client's between the events it
        # read, plus the end's, which it cannot see apart from [DONE] (written right after it: 0).
        gaps = [b - a for x in timings for a, b in zip(x.chunks, x.chunks[1:])] + [0.0] * N
        assert len(gaps) == t.inter_token.count == N * (TOKENS + 3), (name, len(gaps), t.inter_token.count)
        for q in (0.5, 0.95):
            assert close_to(t.inter_token.quantile(q), percentile(gaps, q)), (name, q, t.inter_token.quantile(q),
                                                                              percentile(gaps, q))
