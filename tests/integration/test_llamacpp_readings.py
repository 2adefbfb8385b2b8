"""The servers capability's readings of a real engine, llama.cpp's llama-server on CPU with the tiny model, against
the engine's own /metrics read by the test around each of the agent's reads: slots busy (requests running, and over
total_slots the KV field), requests deferred (waiting), and generated tokens per second over the window the reading
says it spans. Then what goes wrong with a real engine: started without --metrics, and killed mid-stream.

No root needed (loopback HTTP; the server is found on its port through this host's /proc, by its command line). The
read rounds are driven by the test (Scraper.round, what the servers thread runs), so that each of the agent's reads
lies between two of the test's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from qosagent.hostfs import HostFS
from qosagent.servers import kinds
from qosagent.servers.model import ServerReading
from qosagent.servers.scraper import DOWN, HTTP_ERROR, REFUSED, Scraper
from tests.integration.llamacpp_helpers import engine
from testkit import llamacpp

pytestmark = [pytest.mark.slow]

SLOTS = 2
PROCESSING, DEFERRED, TOKENS = "llamacpp:requests_processing", "llamacpp:requests_deferred", \
    "llamacpp:tokens_predicted_total"


class Load:
    """Client threads, each sending streamed chat completions one after another until stopped; a failed one (the
    engine killed under it) ends its thread."""

    def __init__(self, srv: llamacpp.LlamaServer, clients: int, words: int, max_tokens: int):
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0

        def loop(i: int) -> None:
            n = 0
            while not self.stop.is_set():
                try:
                    llamacpp.stream_chat(srv.host, srv.port, llamacpp.chat(llamacpp.prompt(words, i * 1000 + n),
                                                                          max_tokens))
                    self.done += 1
                except Exception as e:  # noqa: BLE001 - what the client saw, for the test to judge
                    self.errors.append(f"{type(e).__name__}: {e}")
                    return
                n += 1

        self.threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


@contextlib.contextmanager
def load(srv: llamacpp.LlamaServer, clients: int, words: int, max_tokens: int) -> Iterator[Load]:
    lo = Load(srv, clients, words, max_tokens)
    try:
        yield lo
    finally:
        lo.close()


def scraper(srv: llamacpp.LlamaServer) -> Scraper:
    """Servers found on the engine's port, as the embedded default finds them (no servers: list)."""
    sc = Scraper(HostFS("/"), None, [srv.port])
    sc.rediscover()
    return sc


def read(sc: Scraper) -> ServerReading:
    """One read of every server now (the round the servers thread runs once `interval` has passed)."""
    for t in sc.targets.values():
        t.next_at = 0.0
    sc.round()
    return sc.part().servers[0]


def bracketed(srv: llamacpp.LlamaServer, sc: Scraper) -> tuple[dict[str, float], ServerReading, dict[str, float]]:
    """The engine's metrics just before and just after one read of the agent's."""
    before = srv.metrics()
    r = read(sc)
    return before, r, srv.metrics()


def test_slots_and_queue_are_the_engines_own(tmp_path: Path) -> None:
    with engine(tmp_path, slots=SLOTS) as srv:
        sc = scraper(srv)
        r = read(sc)
        assert (r.kind, r.pid, r.configured, r.known) == ("llamacpp", srv.proc.pid, False, True), r
        assert (r.kv_cache_usage, r.requests_waiting, r.requests_running) == (0.0, 0.0, 0.0), r
        assert r.missing["preemptions"] == "not exported by llamacpp"
        # Six long completions on two slots: two run, four wait, for several seconds at a time.
        with load(srv, 6, 20, 1500) as lo:
            stable: list[tuple[float, float, ServerReading]] = []
            deadline = time.monotonic() + 60
            while len(stable) < 3 and time.monotonic() < deadline:
                before, r, after = bracketed(srv, sc)
                # Only reads where the engine stood still between the test's two reads say what the agent must
                # have seen (a request ending in between moves both numbers).
                if (before[PROCESSING], before[DEFERRED]) == (after[PROCESSING], after[DEFERRED]) and \
                        before[PROCESSING] == SLOTS:
                    stable.append((before[PROCESSING], before[DEFERRED], r))
                time.sleep(0.2)
            assert len(stable) == 3 and not lo.errors, (stable, lo.errors)
            for processing, deferred, r in stable:
                assert r.known and (r.requests_running, r.requests_waiting) == (processing, deferred), r
                assert r.kv_cache_usage == processing / SLOTS == 1.0  # every slot busy: the next one queues
            assert any(deferred == 4 for _, deferred, _ in stable), stable


def test_generated_tokens_per_second_is_the_engines_counter_over_the_window_it_states(tmp_path: Path) -> None:
    """llama-server adds a request's tokens to tokens_predicted_total when the request ends: the rate is over the
    kind's 10 s of reads, and the tokens it counts there are the engine's between the reads that bound it."""
    window = kinds.kind("llamacpp").rate_window
    with engine(tmp_path, slots=SLOTS) as srv:
        sc = scraper(srv)
        # Short completions from four clients: requests end every few tens of ms, in steps of 24 tokens.
        with load(srv, 4, 10, 24) as lo:
            reads: list[tuple[float, float, float, float, ServerReading]] = []  # (t, tokens) before, after
            while not reads or reads[-1][4].generated_tokens_window_s is None or \
                    reads[-1][4].generated_tokens_window_s < window:
                t0, before = time.monotonic(), srv.metrics()[TOKENS]
                r = read(sc)
                reads.append((t0, before, time.monotonic(), srv.metrics()[TOKENS], r))
                assert len(reads) < 30, [x[4] for x in reads]
                time.sleep(1.0)
            assert not lo.errors and lo.done > 50, (lo.errors, lo.done)
        last = reads[-1]
        r = last[4]
        assert r.known and r.generated_tokens_per_second is not None, r
        span = r.generated_tokens_window_s
        assert span is not None and window <= span < window + 2.0, span
        # The read the window starts at: the one whose time (between the test's two) is span before the last's.
        first = min(reads[:-1], key=lambda x: abs((last[0] + last[2]) / 2 - (x[0] + x[2]) / 2 - span))
        # The counter only grows: the agent saw, at each end, a value between the test's two reads around it.
        least, most = last[1] - first[3], last[3] - first[1]
        assert least <= r.generated_tokens_per_second * span + 1e-6 and \
            r.generated_tokens_per_second * span <= most + 1e-6, (least, most, r.generated_tokens_per_second, span)
        assert r.generated_tokens_per_second > 0


def test_metrics_off_is_said_as_the_kinds_reason(tmp_path: Path) -> None:
    with engine(tmp_path, slots=SLOTS, metrics=False) as srv:
        sc = scraper(srv)
        r = read(sc)
        assert (r.kind, r.known, r.kv_cache_usage, r.requests_waiting) == ("llamacpp", False, None, None), r
        assert r.reason == ("HTTP 501 Not Implemented: llama-server serves /metrics only when started with "
                            "--metrics"), r.reason
        assert r.scrapes == {HTTP_ERROR: 1}


def test_an_engine_killed_mid_stream_is_unknown_at_once_and_read_again_when_it_is_back(tmp_path: Path) -> None:
    with engine(tmp_path, slots=SLOTS) as srv:
        port, old = srv.port, srv.proc.pid
        sc = scraper(srv)
        with load(srv, 4, 20, 1500) as lo:
            deadline = time.monotonic() + 30
            while (r := read(sc)).requests_running != SLOTS:
                assert time.monotonic() < deadline, r
                time.sleep(0.2)
            srv.kill()  # SIGKILL with every slot streaming and two waiting
            r = read(sc)
        assert len(lo.errors) == 4, lo.errors  # every client saw its stream or its wait cut
        assert (r.known, r.requests_running, r.requests_waiting, r.kv_cache_usage) == (False, None, None, None), r
        assert r.reason == REFUSED and r.scrapes.get(DOWN) == 1, r
    with engine(tmp_path, port=port, slots=SLOTS, name="again") as again:
        sc.rediscover()
        r = read(sc)
        assert (r.pid, r.restarts, r.known, r.requests_running) == (again.proc.pid, 1, True, 0.0), (old, r)
