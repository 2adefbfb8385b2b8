"""Many tenants on a node, the scrape: bytes and time of one /metrics scrape (text and protobuf) for 10, 100, 1,000
and 4,000 configured tenants with 1 % and 100 % of them active, beside the 10-tenant baseline taken in the same run.

The node is quota on, admission in dry-run, latency on, with the default export config (metrics.retention,
latency.tier_histograms, the classic layout), built synthetically without BPF (testkit/scale.py): the exports read
only the Snapshot, so what a scrape costs depends on its parts, not on how the tick filled them. An active tenant has
1,000 requests since start; "every tenant shown" is the same snapshot with metrics.retention ignored, what every
scrape wrote before issue 26 (with the tenants' finer classic layout of then, latency.classic_buckets.fine_per_octave
8, no per-tier sums, and without the deprecated copies, which doubled the latency part again: --before).

A scrape here is AgentCollector.body(): building the exposition from the snapshot and encoding it, what the first
scrape of a tick pays (a second scrape of the same tick is the bytes already encoded: its time is printed too). The
time is the median of --rounds, each on a new snapshot, interleaved over the cases.

Run from the checkout: python bench/scale_scrape.py [--tenants 10,100,1000,4000] [--rounds 5]. Prints Markdown for
docs/PERFORMANCE.md ("Many tenants: the scrape")."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qosagent.metrics import AgentCollector  # noqa: E402
from qosagent.retention import EVERYONE  # noqa: E402
from testkit import scale  # noqa: E402

REQUESTS = 1000


def everyone(_now: float, _traffic: Any) -> Any:
    """What a scrape was before: every configured tenant's series (the retention set ignored)."""
    return EVERYONE


def case(tenants: int, share: float, before: bool) -> dict[str, Any]:
    active = max(1, round(tenants * share))
    config = {"latency": {"classic_buckets": {"fine_per_octave": 8}, "tier_histograms": False}} if before else None
    agent = scale.agent(Path(tempfile.mkdtemp(prefix="scale-scrape-")), config)
    collector = AgentCollector(agent)
    if before:
        collector.retention.shown = everyone  # type: ignore[method-assign]
    return {"tenants": tenants, "active": active, "before": before, "agent": agent, "collector": collector,
            "requests": {i: REQUESTS for i in range(active)}, "times": {False: [], True: []}, "again": [],
            "bytes": {}}


def scrape(c: dict[str, Any], at: float) -> None:
    scale.publish(c["agent"], at, c["tenants"], c["requests"])
    for proto in (False, True):
        t0 = time.perf_counter()
        body = c["collector"].body(proto)
        c["times"][proto].append(time.perf_counter() - t0)
        c["bytes"][proto] = len(body)
    t0 = time.perf_counter()
    c["collector"].body(False)
    c["again"].append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="10,100,1000,4000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", action="store_true", help="also every tenant shown (slow: minutes at 4,000)")
    args = ap.parse_args()
    sizes = [int(n) for n in args.tenants.split(",")]
    cases = [case(n, share, False) for n in sizes for share in (0.01, 1.0)]
    if args.before:
        cases += [case(n, share, True) for n in sizes for share in (0.01, 1.0)]
    for c in cases:  # a first scrape of each, untimed: imports, caches of the bucket layouts
        scrape(c, 0.0)
        c["times"], c["again"] = {False: [], True: []}, []
    for r in range(args.rounds):
        for c in cases:
            scrape(c, 1.0 + r)
    base = statistics.median(cases[0]["times"][False])
    print(f"{args.rounds} rounds, medians; the baseline is {cases[0]['tenants']} tenants, "
          f"{cases[0]['active']} active, text: {base * 1e3:.1f} ms\n")
    print("| tenants | active | shown | text | text time | × baseline | protobuf | protobuf time | same tick again |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        text, proto = (statistics.median(c["times"][p]) for p in (False, True))
        shown = "every tenant (before)" if c["before"] else "with traffic"
        print(f"| {c['tenants']:,} | {c['active']:,} | {shown} | {c['bytes'][False] / 1e3:,.0f} KB | "
              f"{text * 1e3:,.1f} ms | {text / base:.1f} | {c['bytes'][True] / 1e3:,.0f} KB | {proto * 1e3:,.1f} ms | "
              f"{statistics.median(c['again']) * 1e6:.0f} µs |")


if __name__ == "__main__":
    main()
