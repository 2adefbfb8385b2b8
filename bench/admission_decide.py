"""Cost of the admission decision per tick, as a ratio against an empty agent tick measured in the same run.

For N tenants (split over three tiers), builds one Snapshot with latency and quota parts and times the
capability's decide() + apply() (with a LimitsWriter that records nothing), against Agent.tick() with no
capability enabled (GPU sampling from the fake backend, Snapshot build, publishing). Prints a Markdown table.

    python -m bench.admission_decide [--rounds 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable, Mapping

from qosagent.admission.capability import LIMITS_SERVICE, Admission
from qosagent.capability import AgentContext
from qosagent.config import parse
from qosagent.daemon import Agent
from qosagent.gpu.fake import FakeBackend
from qosagent.hist import Histogram
from qosagent.hostfs import HostFS
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.snapshot import Snapshot
from qosagent.tenants import TenantLimit

TIERS = ("gold", "silver", "bronze")


class NullLimits:
    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        pass


def setup(n: int) -> tuple[Admission, Callable[[int], Snapshot]]:
    tenants = [{"name": f"t{i}", "tier": TIERS[i % 3], "match": {"cidrs": [f"10.0.{i // 250}.{i % 250}/32"]}}
               for i in range(n)]
    cfg = parse({"tenants": tenants, "latency": {"enabled": False},
                 "admission": {"enabled": True, "mode": "enforce"}}, "bench")
    ctx = AgentContext(config=cfg, hostfs=HostFS("/"), gpu=FakeBackend.preset("h200x8"))
    ctx.services[LIMITS_SERVICE] = NullLimits()
    cap = Admission(ctx)
    # Realistic windows: a few hundred requests spread over ~20 buckets per tenant.
    hists = {f"t{i}": Histogram.of([(5 + (j * 37) % 200) * 1_000_000 for j in range(300)]) for i in range(n)}
    lat = LatencyPart(1.0, {name: TenantLatency(name, TIERS[i % 3], 300, h, h, h, h, h, h, h, h, 300.0, 4)
                            for i, (name, h) in enumerate(hists.items())})
    quota = QuotaPart({name: TenantQuota(name, TIERS[i % 3], TenantLimit(100, 10), None, 0, 0, admitted_rps=90.0)
                       for i, name in enumerate(hists)})
    gpu = FakeBackend.preset("h200x8")
    gpu.open()

    def snap(seq: int) -> Snapshot:
        return Snapshot.build(seq, seq * 0.1, seq * 0.1, {"latency": lat, "quota": quota, "gpu": gpu.sample()})

    return cap, snap


def timed(fn: Callable[[int], object], rounds: int) -> float:
    """Median seconds of one call."""
    samples = []
    for i in range(rounds):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fake = FakeBackend.preset("h200x8")
        fake.open()
        agent = Agent(parse({"latency": {"enabled": False}}, "bench"), HostFS(tmp), gpu=fake)
        agent.start()
        base = timed(lambda _i: agent.tick(), args.rounds)
        agent.stop()
    print("| tenants | empty agent tick | admission decide+apply | ratio | share of a 100 ms tick |")
    print("|---:|---:|---:|---:|---:|")
    for n in (3, 30, 300):
        cap, snap = setup(n)
        snaps = [snap(i) for i in range(args.rounds)]
        t = timed(lambda i, cap=cap, snaps=snaps: cap.apply(cap.decide(snaps[i])), args.rounds)
        print(f"| {n} | {base * 1e6:.0f} µs | {t * 1e6:.0f} µs | {t / base:.1f}x | {t / 0.1:.2%} |")


if __name__ == "__main__":
    main()
