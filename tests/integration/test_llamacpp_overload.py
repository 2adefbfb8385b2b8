"""The loop under real overload: llama.cpp's llama-server on CPU (the tiny model) with two parallel slots, gold
sending a steady stream of short prompts, bronze flooding with long ones from many connections; the agent's latency
probes, its reading of the engine's queue and the quota classifier in the kernel, all real, in a network namespace of
the test's own (admission_harness.py).

Both halves in one run, on one engine: first the baseline, without the agent, where gold's requests wait in the
engine's queue behind bronze's (llama-server defers a request that finds every slot busy and serves its queue in
order) and gold's TTFT P95 is far over its SLO; then the agent starts with admission in enforce, cuts bronze first,
in the kernel, on the engine's queue and on gold's TTFT, while they press (down to bronze's floor at most), and gold's
TTFT P95 is back under its SLO within the reaction time docs/admission.md documents, while bronze is still served at
no less than its floor.

The SLO fits this engine on 2 shared CPUs, eight sessions' tests beside it: gold's short prompt takes 10-60 ms to
its first token alone, and up to a few hundred ms beside one bronze prefill (the engine computes 128 tokens a step,
gold's and bronze's together); behind the flood's queue of ~20 long prompts it waits for all of them, seconds. 1 s
sits between the two with a margin of several times each way (the numbers of a run: the assertion messages).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from tests.integration.admission_harness import BRONZE, GOLD, Procs, kernel_limits, p95, results, scenario, wait_for
from tests.integration.llamacpp_helpers import built
from testkit import llamacpp

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

SLOTS = 2
SLO_MS = 1000.0
GOLD_PROMPT = (8, 8)  # words (~25 tokens), tokens generated
# ~1,100 tokens of prefill: a slot for 0.3 s on an idle CPU, 0.9 s here beside eight sessions' tests (measured: a
# prompt of 600 words held it 1.4 s, and 24 connections of them kept gold 12-15 s from its first token).
BRONZE_PROMPT = (400, 16)
BRONZE_CONNECTIONS = 16
# rps. Bronze's floor is a fraction of what the engine serves (2 slots / 0.9 s), so that the queue the flood left
# drains under it; gold's is ten times its demand: a cut of gold changes nothing it sends.
BRONZE_FLOOR, GOLD_FLOOR = 0.5, 50.0
BASELINE_S, TREATMENT_S = 30.0, 20.0
# docs/admission.md, "Reaction time", with this config: the engine's queue (~14 deferred) presses on the third tick
# after the agent's first read of it; from bronze's admitted 2-6/s to its floor takes at most 7 cuts, one a second:
# 7 s. The queue the flood left drains at what the engine serves less the floor's 0.5/s: 1.7/s here, 8 s for 14. Then
# one latency window (1 s): 16 s; 20 s holds it (measured with a heavier bronze: 31 s, where its floor took 70 % of
# the engine and the queue drained at 0.5/s).
REACTION_S = 20.0
QUOTA = "{enabled: true, interfaces: [lo], heartbeat_timeout: 2s}"
# llama-server's KV field is its slots busy, 1.0 whenever both run, as they do under any load: here the engine's
# queue is the server signal, so KV pressure is out of reach (pressed only above 1.0). A long cooldown: bronze stays
# where its cuts left it for the whole treatment (recovery is test_admission_e2e's).
ADMISSION = ("{enabled: true, mode: enforce, cooldown: 60s, min_rps: 0.25, server_pressure: {kv_enter: 1.0, "
             "kv_exit: 0.9, queue_enter: 4, queue_exit: 1, queue_ticks: 3, cut_every: 1s}}")


def test_gold_ttft_under_a_bronze_flood_without_and_with_the_agent(bpf: None, tmp_path: Path) -> None:
    where = built()
    model = llamacpp.model(where, tmp_path)

    def serve(procs: Procs, port: int) -> None:
        srv = llamacpp.LlamaServer(where, model, port, tmp_path / "engine.log", slots=SLOTS,
                                   prefix=["ip", "netns", "exec", procs.ns]).start()
        assert srv.proc is not None
        procs.procs.append(srv.proc)  # stopped with the namespace's other processes

    with scenario(tmp_path, QUOTA, ADMISSION, server=serve, start=False, slo_ms=SLO_MS,
                  gold=f"floor: {{rps: {GOLD_FLOOR:g}, burst: {GOLD_FLOOR:g}}}",
                  bronze=f"floor: {{rps: {BRONZE_FLOOR:g}}}",
                  extra="servers: [{port: $PORT, kind: llamacpp}]") as (procs, agent, port):
        # The clients run until stopped (SIGTERM: each writes what has finished); the agent's start, BPF compiled on
        # busy CPUs, lasts as long as it lasts.
        flood = procs.client(port, BRONZE, BRONZE_CONNECTIONS, 0, 600, tmp_path / "flood.json", timeout=30.0,
                             chat=BRONZE_PROMPT)
        gold = procs.client(port, GOLD, 2, 200, 600, tmp_path / "gold.json", timeout=30.0, chat=GOLD_PROMPT)
        t_flood = time.monotonic()
        time.sleep(BASELINE_S)

        # ---- treatment: the agent, enforcing ----
        t_agent = time.monotonic()
        caps = agent.start()["capabilities"]
        t_ready = time.monotonic()
        assert {n: caps[n]["state"] for n in ("latency", "quota", "servers", "admission")} == dict.fromkeys(
            ("latency", "quota", "servers", "admission"), "active"), caps
        # The loop cuts bronze while the queue or gold's breach lasts, down to its floor at most: on a quicker engine
        # the queue drains above the floor (a run here stopped at 0.88/s, the engine serving ~2/s) and the cuts stop.
        wait_for("bronze cut", lambda: agent.decisions("bronze-app", "cut"), 30, agent)
        t_cut = time.monotonic()
        t_end = t_ready + REACTION_S + TREATMENT_S
        time.sleep(max(0.0, t_end - time.monotonic()))
        limits = kernel_limits(agent, "gold-app", "bronze-app")
        cuts = sorted((d for d in agent.status(decisions=True)["decisions"] if d["capability"] == "admission" and
                       d["action"] == "cut"), key=lambda d: d["inputs"]["tick"])
        reading = agent.status()["servers"]["servers"][0]
        for p in (flood, gold):
            p.terminate()
        gold_reqs, flood_reqs = results(gold, tmp_path / "gold.json"), results(flood, tmp_path / "flood.json")

    # Gold's requests whose first token came once the flood had filled the engine's queue, before the agent was
    # started; and those that started after the reaction time.
    base = [ms for t, ms, ok in gold_reqs if t_flood + 5 < t + ms / 1000 < t_agent and ok]
    treated = [ms for t, ms, ok in gold_reqs if t > t_ready + REACTION_S and ok]
    print(f"gold TTFT P95 {p95(base):.0f} ms without the agent ({len(base)}), {p95(treated):.0f} ms with it "
          f"({len(treated)}); ready after {t_ready - t_agent:.1f} s, bronze first cut {t_cut - t_ready:.1f} s "
          f"later")
    assert len(base) >= 4 and p95(base) > SLO_MS, ("the flood did not push gold over its SLO: the test proves "
                                                    "nothing", sorted(base))
    assert len(treated) >= 40 and p95(treated) < SLO_MS, (p95(base), sorted(treated)[-10:], len(treated),
                                                          t_ready - t_agent, t_cut - t_ready)
    assert all(ok for t, _, ok in gold_reqs if t > t_ready), [r for r in gold_reqs if r[0] > t_ready and not r[2]]
    # Bronze first, in the kernel: its override where the last cut left it, never below its floor; gold's none or at
    # its floor.
    assert cuts and cuts[0]["target"] == "bronze-app", cuts
    bronze_now = [d["new"] for d in cuts if d["target"] == "bronze-app"][-1]
    assert limits["bronze-app"]["override"][0] == bronze_now >= BRONZE_FLOOR, (limits, cuts)
    assert limits["gold-app"]["override"] is None or limits["gold-app"]["override"][0] >= GOLD_FLOOR, limits
    # On the engine's queue and on gold's TTFT (once bronze is on its floor, a breach cuts gold, down to its floor).
    assert any(d["reason"] == "server_pressure" and d["target"] == "bronze-app" and
               d["inputs"]["rule"].startswith("requests_waiting") for d in cuts), cuts
    # Gold's breach, measured in the kernel, drives a cut: by the breach rule, or by a queue cut taken while gold was in
    # breach (the breach rule waits a whole window after any cut, and the queue cuts once a second: which of the two
    # takes the cut is a race the decision records, not a property of the loop).
    assert any((d["reason"] == "slo_breach" and d["inputs"]["breach_tier"] == "gold") or
               "gold" in d["inputs"].get("breaching", ()) for d in cuts), cuts
    assert all(d["new"] >= GOLD_FLOOR for d in cuts if d["target"] == "gold-app"), cuts
    assert reading["kind"] == "llamacpp" and reading["known"], reading
    # Bronze keeps at least its floor: the kernel holds its limit at or above it (above), and it is served at least
    # at about the floor's rate. A dropped
    # SYN is retried after 1 s, 3 s, 7 s, ..., so a token of the bucket (burst 1) can go unused while every
    # connection waits out its backoff, and a request served now may have started 30 s ago: counted by the time its
    # first token came (started after the cut, a run counted 7 in 33 s, 0.21/s).
    span = t_end - (t_cut + 2)
    served = [t for t, ms, ok in flood_reqs if ok and t_cut + 2 < t + ms / 1000 < t_end]
    assert len(served) >= math.floor(0.5 * BRONZE_FLOOR * span), (len(served), span)
