"""How close Prometheus' histogram_quantile gets to the true quantiles of a clustered latency distribution (45 ms
lognormal, sigma 0.2: the case of issue 13), from what the agent exports.

1. Native histograms, by schema and by how internal buckets are shared out (overlap or midpoint), through a
   re-implementation of Prometheus 2.42's histogram_quantile (linear inside a native bucket), over three seeds, for
   that distribution and a slower, wider one (300 ms, sigma 0.3).
2. The real thing: Debian's prometheus scraping the agent's metrics server, native histograms on (protobuf) and off
   (text, the old layout and the new one side by side).

Run from the checkout: python bench/export_precision.py. Prints Markdown for docs/latency.md ("Export precision")."""

from __future__ import annotations

import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qosagent import config as config_mod  # noqa: E402
from qosagent.daemon import Agent  # noqa: E402
from qosagent.gpu.backend import NoGpu  # noqa: E402
from qosagent.hist import Histogram  # noqa: E402
from qosagent.hostfs import HostFS  # noqa: E402
from qosagent.latency import export  # noqa: E402
from qosagent.latency.config import ClassicBucketsConfig  # noqa: E402
from qosagent.latency.model import LatencyPart, TenantLatency  # noqa: E402
from qosagent.metrics import MetricsServer  # noqa: E402
from qosagent.nativehist import native_counts  # noqa: E402
from testkit.prometheus import query, run_prometheus, wait_for  # noqa: E402

N = 100_000
QS = (0.5, 0.95, 0.99)
OFF = {c: {"enabled": False} for c in ("latency", "quota", "admission", "dvfs", "placement")}


def values(seed: int, median_s: float = 0.045, sigma: float = 0.2) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.lognormvariate(math.log(median_s * 1e9), sigma)) for _ in range(N)]


def truth(vals: list[int], q: float) -> float:
    return sorted(vals)[math.ceil(q * len(vals)) - 1] / 1e9


def native_quantile(q: float, zero: int, counts: dict[int, int], schema: int, total: int) -> float:
    """Prometheus 2.42's histogram_quantile on a native histogram: linear interpolation inside the bucket."""
    rank, seen = q * total, zero
    for k in sorted(counts):
        lo, hi = 2 ** ((k - 1) / 2**schema), 2 ** (k / 2**schema)
        if seen + counts[k] >= rank:
            return lo + (hi - lo) * (rank - seen) / counts[k]
        seen += counts[k]
    return hi


def pct(got: float, want: float) -> str:
    return f"{100 * (got - want) / want:+.1f} %"


def emulated(median_s: float, sigma: float) -> None:
    print(f"lognormal, median {median_s * 1000:g} ms, sigma {sigma}: error of the worst of 3 seeds")
    print()
    print("| schema | split | native buckets | p50 | p95 | p99 |")
    print("|---|---|---|---|---|---|")
    data = [(vals, Histogram.of(vals)) for vals in (values(s, median_s, sigma) for s in (1, 2, 3))]
    for schema in (2, 3, 4, 5):
        for split in ("overlap", "midpoint"):
            worst = {q: 0.0 for q in QS}
            nb = 0
            for vals, h in data:
                zero, counts = native_counts(h, schema, split)
                nb = max(nb, len(counts))
                for q in QS:
                    t = truth(vals, q)
                    err = (native_quantile(q, zero, counts, schema, h.count) - t) / t
                    worst[q] = max(worst[q], err, key=abs)
            print(f"| {schema} | {split} | {nb} | " + " | ".join(f"{100 * worst[q]:+.1f} %" for q in QS) + " |")


class Known:
    name = "latency"

    def __init__(self, h: Histogram, buckets: ClassicBucketsConfig):
        self.h, self.buckets = h, buckets

    def traffic(self, _snapshot: Any) -> dict[str, tuple[int, ...]]:
        return {}

    def metrics(self, _snapshot: Any, _shown: Any) -> Iterable[Any]:
        h = self.h
        t = TenantLatency(tenant="chat", tier="gold", requests=h.count, headers=h, ttft=h, response=h, inter_token=h,
                          headers_window=h, ttft_window=h, response_window=h, inter_token_window=h, rate_rps=0.0)
        return export.families(LatencyPart(10.0, {"chat": t}), 1, "ttft", 0.95, self.buckets)


def serve(h: Histogram, buckets: ClassicBucketsConfig) -> MetricsServer:
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0"}, **OFF}, "bench")
    agent = Agent(cfg, HostFS("/"), gpu=NoGpu("bench"))
    agent.capabilities.append(Known(h, buckets))  # type: ignore[arg-type]
    srv = MetricsServer(agent, cfg.metrics.listen)
    srv.start()
    return srv


def real() -> None:
    vals = values(1)
    h = Histogram.of(vals)
    old, new = serve(h, ClassicBucketsConfig(fine_per_octave=2)), serve(h, ClassicBucketsConfig(fine_per_octave=8))
    jobs = [{"job_name": name, "static_configs": [{"targets": [f"127.0.0.1:{srv.address[1]}"]}]}
            for name, srv in (("old", old), ("new", new))]
    rows = {"agent's own quantile": [h.quantile(q) for q in QS]}
    try:
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
            with run_prometheus(Path(d1), jobs) as classic, run_prometheus(Path(d2), jobs[1:], native=True) as nat:
                deadline = time.monotonic() + 90
                wait_for("scrapes", lambda: query(classic, "count(qosagent_latency_response_seconds_count) == 2")
                         and query(nat, "qosagent_latency_response_seconds"), deadline)
                for label, url, sel in (
                        ("classic, 2 per power of two (before)", classic,
                         'qosagent_latency_response_seconds_bucket{job="old"}'),
                        ("classic, 8 per power of two from 8.4 ms to 4.3 s (a tier's)", classic,
                         'qosagent_latency_response_seconds_bucket{job="new"}'),
                        ("native, schema 3 (protobuf)", nat, "qosagent_latency_response_seconds")):
                    rows[label] = [float(query(url, f"histogram_quantile({q}, {sel})")[0]["value"][1]) for q in QS]
    finally:
        old.close()
        new.close()
    t = [truth(vals, q) for q in QS]
    print(f"truth ({N} values, seed 1): " + ", ".join(f"p{round(q * 100)} {v * 1000:.2f} ms" for q, v in zip(QS, t)))
    print()
    print("| quantiles from | p50 | p95 | p99 |")
    print("|---|---|---|---|")
    for label, got in rows.items():
        print(f"| {label} | " + " | ".join(f"{g * 1000:.2f} ms ({pct(g, w)})" for g, w in zip(got, t)) + " |")


if __name__ == "__main__":
    emulated(0.045, 0.2)
    print()
    emulated(0.300, 0.3)
    print()
    real()
