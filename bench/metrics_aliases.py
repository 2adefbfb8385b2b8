"""What the latency families' deprecated names (metrics.deprecated_names, off by default) cost a scrape: the agent's
latency families for 100 tenants rendered as text and as protobuf, with and without the old names, in interleaved
rounds; the ratio is the median of the per-round ratios, so a busy neighbour slows both sides alike.

Run from the checkout: python bench/metrics_aliases.py [--tenants N] [--rounds N]. Prints Markdown for
docs/PERFORMANCE.md ("Metrics endpoint")."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402

from qosagent import exposition  # noqa: E402
from qosagent.hist import Histogram  # noqa: E402
from qosagent.latency import export  # noqa: E402
from qosagent.latency.model import LatencyPart, TenantLatency  # noqa: E402


def part(tenants: int) -> LatencyPart:
    rng = random.Random(1)
    h = Histogram.of([int(rng.lognormvariate(math.log(0.045e9), 0.5)) for _ in range(20_000)])
    rows = {f"t{i}": TenantLatency(f"t{i}", "gold", h.count, h, h, h, h, h, h, h, h, rate_rps=1.0)
            for i in range(tenants)}
    return LatencyPart(10.0, rows)


class Fams:
    def __init__(self, make: Callable[[], Iterable[Any]]):
        self.make = make

    def collect(self) -> Iterable[Any]:
        return self.make()


def scrapes(p: LatencyPart, deprecated: bool) -> dict[str, Callable[[], bytes]]:
    def fams() -> Iterable[Any]:
        f = export.families(p, 10, "ttft", 0.95)
        return export.with_deprecated(f) if deprecated else f

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Fams(fams))  # type: ignore[arg-type]
    return {"text": lambda: generate_latest(reg), "protobuf": lambda: exposition.encode(reg.collect())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    p = part(args.tenants)
    without, with_ = scrapes(p, False), scrapes(p, True)
    print(f"{args.tenants} tenants, {args.rounds} interleaved rounds (median):\n")
    print("| format | without old names (default) | with old names | ratio | bytes without / with |")
    print("|---|---|---|---|---|")
    for fmt in ("text", "protobuf"):
        times: dict[bool, list[float]] = {False: [], True: []}
        size = {}
        for _ in range(args.rounds):
            for on, fn in ((False, without[fmt]), (True, with_[fmt])):
                t0 = time.perf_counter()
                body = fn()
                times[on].append(time.perf_counter() - t0)
                size[on] = len(body)
        ratio = statistics.median(b / a for a, b in zip(times[False], times[True]))
        off, on = (statistics.median(times[k]) * 1e3 for k in (False, True))
        mb = f"{size[False] / 1e6:.2f} / {size[True] / 1e6:.2f} MB"
        print(f"| {fmt} | {off:.0f} ms | {on:.0f} ms | {ratio:.2f} | {mb} |")


if __name__ == "__main__":
    main()
