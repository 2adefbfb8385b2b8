"""The admission capability in the agent's loop: inputs from a Snapshot, enforcement, dry-run, NVML failures,
the pre-cleanup action, metrics and status."""

from __future__ import annotations

import http.server
import json
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from qosagent.features import Features
from qosagent.admission import export
from qosagent.admission.capability import LIMITS_SERVICE, Admission
from qosagent.admission.inputs import gpu_input, tick_input
from qosagent.admission.precleanup import PreCleanup
from qosagent.capability import AgentContext, State, Verdict
from qosagent.config import ConfigError, parse_text
from qosagent.daemon import Agent
from qosagent.gpu.backend import (
    GPU_LOST,
    NO_PERMISSION,
    NOT_SUPPORTED,
    GpuProcess,
    GpuSample,
    GpuState,
)
from qosagent.gpu.fake import FakeBackend
from qosagent.hist import Histogram
from qosagent.hostfs import HostFS
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.metrics import make_registry
from qosagent.quota.capability import Quota
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.servers.model import ServerReading, ServersPart
from qosagent.snapshot import Snapshot
from qosagent.status import render
from qosagent.tenants import TenantLimit

CONFIG = """
    interval: 100ms
    tiers:
      gold:   {slo_p99: 120ms, weight: 10}
      bronze: {slo_p99: 1200ms, weight: 1, quota: {rps: 100, burst: 10}, floor: {rps: 5}, sheddable: true}
    tenants:
      - {name: acme, tier: gold, match: {cidrs: [127.0.0.2/32]}}
      - {name: hobby, tier: bronze, match: {cidrs: [127.0.0.3/32]}}
    latency: {enabled: false}
    admission:
      enabled: true
      mode: %s
"""


def config(mode: str = "enforce", extra: str = "gpu_pressure: {gpus: [0]}\n") -> Any:
    return parse_text(textwrap.dedent(CONFIG % mode) + textwrap.indent(textwrap.dedent(extra), "  "), "test.yaml")


class FakeLimits:
    """The quota capability's LimitsWriter, recording what it was told."""

    def __init__(self) -> None:
        self.calls: list[dict[str, TenantLimit]] = []

    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        self.calls.append(dict(limits))


def hist_ms(ms: float, n: int = 100) -> Histogram:
    return Histogram.of([int(ms * 1e6)] * n)


def snapshot(seq: int, gold_ms: float, gpu: GpuState | None = None, hobby_rps: float = 80.0,
             servers: ServersPart | None = None) -> Snapshot:
    def lat(name: str, tier: str, ms: float) -> TenantLatency:
        h = hist_ms(ms)
        return TenantLatency(name, tier, 100, h, h, h, h, h, h, h, h, rate_rps=10.0, in_flight=3)

    latency = LatencyPart(1.0, {"acme": lat("acme", "gold", gold_ms), "hobby": lat("hobby", "bronze", 50)})
    quota = QuotaPart({"hobby": TenantQuota("hobby", "bronze", TenantLimit(100, 10), None, 0, 0,
                                            admitted_rps=hobby_rps)})
    parts: dict[str, Any] = {"latency": latency, "quota": quota, "gpu": gpu or GpuState(False, "no GPU")}
    if servers is not None:
        parts["servers"] = servers
    return Snapshot.build(seq, 100.0 + seq * 0.1, 1.7e9 + seq * 0.1, parts)


def capability(mode: str = "enforce", writer: FakeLimits | None = None,
               extra: str = "gpu_pressure: {gpus: [0]}\n") -> Admission:
    ctx = AgentContext(config=config(mode, extra), hostfs=HostFS("/"), gpu=FakeBackend.preset("single"))
    if writer is not None:
        ctx.services[LIMITS_SERVICE] = writer
        ctx.record(Quota, Verdict(State.ACTIVE))
    return Admission(ctx)


def run(cap: Admission, ticks: int, gold_ms: float, gpu: GpuState | None = None,
        servers: ServersPart | None = None, start: int = 0) -> list[Any]:
    out = []
    for i in range(start, start + ticks):
        d = cap.decide(snapshot(i, gold_ms, gpu, servers=servers))
        cap.apply(d)
        out += d
    return out


HOST = Features(cgroup2="/sys/fs/cgroup")  # what the latency egress program needs for TTFT


def test_enforce_writes_overrides_every_tick_and_clears_them_on_stop() -> None:
    w = FakeLimits()
    cap = capability("enforce", w)
    assert cap.probe(HOST).state is State.ACTIVE
    decisions = run(cap, 3, gold_ms=200)
    assert [(d.target, d.action, d.reason, d.applied) for d in decisions] == [("hobby", "cut", "slo_breach", True)]
    assert decisions[0].old == 100 and decisions[0].new == pytest.approx(56.0)  # min(100, admitted 80) x 0.7
    assert len(w.calls) == 3 and w.calls[-1] == {"hobby": TenantLimit(56.0, 6)}
    cap.stop()
    assert w.calls[-1] == {}


def test_a_tick_whose_parts_are_the_last_ones_builds_no_new_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted: parts handed on from the tick before (a tick at rest) are the same input at the new time: no input
    is built again, and what the loop does with time (the breach streak, the cut) is as with inputs built anew."""
    from qosagent.admission import capability as module

    built = []
    monkeypatch.setattr(module, "tick_input", lambda *a, **k: built.append(a[0].seq) or tick_input(*a, **k))
    w = FakeLimits()
    cap = capability("enforce", w)
    parts = dict(snapshot(0, gold_ms=200).parts)
    decisions = []
    for i in range(3):
        d = cap.decide(Snapshot.build(i, 100.0 + i * 0.1, 1.7e9 + i * 0.1, parts))
        cap.apply(d)
        decisions += d
    assert built == [0]
    assert [(d.target, d.action, d.reason, d.applied) for d in decisions] == [("hobby", "cut", "slo_breach", True)]
    assert cap.state.healthy_streak == 0 and cap.state.breach_streak["gold"] == 3
    assert w.calls[-1] == {"hobby": TenantLimit(56.0, 6)}
    parts["latency"] = snapshot(3, gold_ms=50).parts["latency"]  # a part that moved: built anew
    cap.decide(Snapshot.build(3, 100.3, 1.7e9 + 0.3, parts))
    assert built == [0, 3] and cap.state.breach_streak["gold"] == 0


def test_dry_run_computes_and_reports_but_writes_nothing() -> None:
    w = FakeLimits()
    cap = capability("dry-run", w)
    assert "dry-run" in cap.probe(HOST).reason
    decisions = run(cap, 3, gold_ms=200)
    assert [(d.target, d.action, d.applied) for d in decisions] == [("hobby", "cut", False)]
    assert w.calls == []
    published = Snapshot.build(3, 0.0, 0.0, {"admission": cap.settled(cap.collect())})
    assert cap.status(published)["tenants"][1]["limit"] == "56/s burst 6"
    cap.stop()
    assert w.calls == []


def test_enforce_without_quota_is_degraded_and_effectively_dry_run() -> None:
    cap = capability("enforce", None)
    v = cap.probe(HOST)
    assert v.state is State.DEGRADED and "quota" in v.reason
    decisions = run(cap, 3, gold_ms=200)
    assert decisions and not any(d.applied for d in decisions)
    # The baseline comes from config when quota does not answer for it.
    assert cap.baseline == {"hobby": TenantLimit(100, 10)}


def test_enforce_is_judged_by_quota_s_verdict_not_its_running_service() -> None:
    # `qosagent check` probes without starting anything: quota's probe verdict is what admission can count on.
    cap = capability("enforce", None)
    cap.ctx.record(Quota, Verdict(State.ACTIVE, "ingress of lo"))
    assert cap.probe(HOST).state is State.ACTIVE
    cap.ctx.record(Quota, Verdict(State.UNAVAILABLE, "needs root"))
    assert cap.probe(HOST).state is State.DEGRADED


def test_serving_gpus_the_backend_does_not_report_degrade_the_capability() -> None:
    v = capability("enforce", FakeLimits(), "gpu_pressure: {gpus: [0, 3]}\n").probe(HOST)
    assert v.state is State.DEGRADED and "[3]" in v.reason


def test_a_ttft_signal_the_host_cannot_measure_degrades_the_capability() -> None:
    cap = capability("enforce", FakeLimits())
    assert cap.probe(Features()).state is State.ACTIVE  # latency off here: its signal is not this host's to judge
    cap.ctx.config = cap.ctx.config.model_copy(update={"latency": cap.ctx.config.latency.model_copy(
        update={"enabled": True})})
    v = cap.probe(Features())
    assert v.state is State.DEGRADED and "admission.signal is ttft" in v.reason and "headers or response" in v.reason


def test_reload_to_dry_run_withdraws_what_was_written() -> None:
    w = FakeLimits()
    cap = capability("enforce", w)
    run(cap, 3, gold_ms=200)
    assert w.calls[-1]
    cap.ctx.config = config("dry-run")
    cap.apply(cap.decide(snapshot(10, 200)))
    assert w.calls[-1] == {}
    n = len(w.calls)
    cap.apply(cap.decide(snapshot(11, 200)))
    assert len(w.calls) == n


def test_tick_input_merges_tier_histograms_and_reads_rates() -> None:
    cfg = config()
    snap = snapshot(1, 200.0)
    inp = tick_input(snap, cfg, {"hobby": TenantLimit(100, 10)})
    assert inp.tiers["gold"].observed == pytest.approx(0.2, rel=0.07)
    assert inp.tiers["gold"].slo == pytest.approx(0.12)
    assert inp.tenants["hobby"].admitted_rps == 80.0  # the classifier's rate, not the completions'
    assert inp.tenants["acme"].admitted_rps == 10.0  # no quota data for acme: completions
    assert inp.tenants["hobby"].floor_rps == 5.0 and inp.tenants["hobby"].in_flight == 3
    assert inp.gpu.gpus == () and inp.gpu.reason == "no GPU"


def test_gpu_input_only_counts_serving_gpus_that_answer() -> None:
    gib = 1 << 30
    gpus = (GpuSample(0, "a", 100 * gib, 95 * gib), GpuSample(1, "b", 100 * gib, 99 * gib),
            GpuSample(2, "c", lost=True, errors=(("sample", GPU_LOST),)))
    state = GpuState(True, gpus=gpus)
    assert [(g.index, g.ratio, g.evidence) for g in gpu_input(state, [0]).gpus] == [(0, 0.95, "memory")]
    assert [g.index for g in gpu_input(state, []).gpus] == [0, 1, 2]
    (lost,) = gpu_input(state, [2]).gpus
    assert lost.ratio is None and lost.evidence == "unknown" and "lost" in lost.why
    none = gpu_input(GpuState(False, "NVML not available"), [0])
    assert none.gpus == () and none.reason == "NVML not available"


def vllm_at(kv: float, pids: frozenset[int] = frozenset({4121, 4122})) -> ServersPart:
    """A vLLM server on port 18008 that the agent found, its processes 4121 (and its engine 4122)."""
    srv = ServerReading(port=18008, kind="vllm", url="http://127.0.0.1:18008/metrics", configured=True, known=True,
                        pid=4121, pids=pids, preallocates=True, kv_cache_usage=kv, requests_waiting=0,
                        requests_running=4)
    return ServersPart((srv,), pids, True, frozenset({1}) | pids)


def gpu_at(ratio: float, pids: tuple[int, ...] = ()) -> GpuState:
    return GpuState(True, gpus=(GpuSample(0, "a", 100, round(ratio * 100),
                                          processes=tuple(GpuProcess(p, 90) for p in pids)),))


@pytest.mark.parametrize("pids", [(), (3_999_999,)], ids=["no process list", "pids of another namespace"])
@pytest.mark.parametrize("mode", ["enforce", "dry-run"])
def test_a_server_reporting_kv_30_percent_overrides_92_percent_gpu_memory(mode: str, pids: tuple[int, ...]) -> None:
    """Issue 23: vLLM's KV at 30 %, GPU memory at 92 % with NVML listing no process of its (an empty list, or PIDs
    the agent cannot see): nobody shed, nobody cut; status says why, and the tick is counted."""
    w = FakeLimits()
    cap = capability(mode, w)
    decided = run(cap, 60, gold_ms=7, gpu=gpu_at(0.92, pids), servers=vllm_at(0.30))
    assert decided == [] and all(c == {} for c in w.calls)
    part = cap.settled(cap.collect())
    verb = "not shedding" if mode == "enforce" else "would not shed"
    assert part.gpu == f"{verb}: the server reports KV 30 % on port 18008 (GPU 0 memory 92%)"
    assert part.shed_tiers == 0 and all(t.signal == "config" for t in part.tenants)
    assert part.gpu_ignored == {(0, "server"): 60}
    st = Admission.render(export.status(part))
    assert "would not shed: the server reports KV 30 %" in st if mode == "dry-run" else "not shedding: " in st
    text = "".join(f"{s.name} {s.labels} {s.value}\n" for m in export.metrics(part) for s in m.samples)
    assert "qosagent_admission_gpu_memory_ignored_total {'gpu': '0', 'evidence': 'server'} 60" in text
    assert "qosagent_admission_evidence_conflict {'gpu': '0'} 0.0" in text


def test_memory_grown_past_enter_while_the_server_reports_kv_low_is_flagged_not_acted_on() -> None:
    w = FakeLimits()
    cap = capability("enforce", w)
    for i, ratio in enumerate((0.50, 0.70, 0.95, 0.96)):
        run(cap, 1, gold_ms=7, gpu=gpu_at(ratio), servers=vllm_at(0.20), start=i)
    part = cap.settled(cap.collect())
    assert [(g.gpu, g.evidence, g.counts, g.conflict) for g in part.gpus] == [(0, "server", False, True)]
    assert all(c == {} for c in w.calls)
    text = "".join(f"{s.name} {s.labels} {s.value}\n" for m in export.metrics(part) for s in m.samples)
    assert "qosagent_admission_evidence_conflict {'gpu': '0'} 1.0" in text


def agent(tmp_path: Path, mode: str = "enforce") -> tuple[Agent, FakeBackend, FakeLimits]:
    fake = FakeBackend.preset("single")
    fake.open()
    a = Agent(config(mode), HostFS(tmp_path), gpu=fake)
    w = FakeLimits()
    a.ctx.services[LIMITS_SERVICE] = w
    a.start()
    return a, fake, w


@pytest.mark.parametrize("kind", [NOT_SUPPORTED, NO_PERMISSION, GPU_LOST])
def test_nvml_errors_mid_run_keep_the_loop_running(tmp_path: Path, kind: str) -> None:
    a, fake, w = agent(tmp_path)
    try:
        assert [c.name for c in a.capabilities] == ["servers", "admission"]
        a.tick()  # memory at 7 %: then it grows past enter
        fake.gpus[0].memory_used = int(fake.gpus[0].memory_total * 0.95)
        a.tick()
        assert w.calls[-1] == {"hobby": TenantLimit(5.0, 5)}
        # The memory reading fails (or the whole GPU is lost) while shedding: the state is unknown, so the shed
        # is released rather than held on a reading the agent no longer has.
        fake.fail("sample" if kind == GPU_LOST else "memory", kind)
        for _ in range(3):
            a.tick()
        assert w.calls[-1] == {}
        assert a.verdicts["admission"].state is State.ACTIVE
        assert not a.stats.apply_errors and not a.stats.collect_errors
        unshed = [d for d in a.decisions if d.action == "unshed"]
        assert len(unshed) == 1 and unshed[0].reason == "gpu_state_unknown"
        assert a.status()["admission"]["gpu"].startswith("unknown (")
        fake.clear("sample" if kind == GPU_LOST else "memory")
        a.tick()
        assert w.calls[-1] == {"hobby": TenantLimit(5.0, 5)}
    finally:
        a.stop()


def test_metrics_and_status_show_decisions_and_limits(tmp_path: Path) -> None:
    a, fake, _ = agent(tmp_path)
    try:
        a.tick()
        fake.gpus[0].memory_used = int(fake.gpus[0].memory_total * 0.95)
        a.tick()
        text = generate_latest(make_registry(a)).decode()
        assert ('qosagent_admission_decisions_total{action="shed",reason="gpu_memory_pressure",tenant="hobby"} 1.0'
                in text)
        assert 'qosagent_admission_limit_rps{tenant="hobby",tier="bronze"} 5.0' in text  # shed to its floor
        assert 'qosagent_admission_limit_rps{tenant="acme",tier="gold"} +Inf' in text
        assert "qosagent_admission_shed_tiers 1.0" in text and "qosagent_admission_enforcing 1.0" in text
        st = a.status(decisions=True)
        assert st["decisions"][-1]["inputs"]["memory_used_ratio"] == pytest.approx(0.95, abs=1e-3)
        human = render(st)
        assert "ADMISSION  mode enforce  P95 ttft  GPU pressure (max 95.0% on GPU 0)  shed tiers 1" in human
        assert ("hobby          bronze     100/s burst 10         5/s burst 5 SHED       gpu_memory: shed, held at the "
                "tier floor (GPU 0 memory 95% > 0.9, grown from 7%)") in human
        assert "acme           gold       unlimited              unlimited              config: baseline" in human
        assert 'qosagent_admission_limited{cause="gpu_memory",tenant="hobby",tier="bronze"} 1.0' in text
        assert "admission  hobby          shed       100/s burst 10 -> 5/s burst 5  gpu_memory_pressure" in human
        assert st["decisions"][-1]["old"] == 100  # numbers for machines, the readable change beside them
        # The reading that drove the shed is on the scrape beside it.
        assert f'qosagent_gpu_memory_used_bytes{{gpu="0"}} {floatToGoString(fake.gpus[0].memory_used)}' in text
        assert 'qosagent_gpu_memory_total_bytes{gpu="0"}' in text
    finally:
        a.stop()


def test_config_rejects_bad_admission_settings() -> None:
    with pytest.raises(ConfigError) as ei:
        config("enforce", "gpu_pressure: {enter: 0.8, exit: 0.85}\n")
    assert "admission.gpu_pressure" in str(ei.value) and "exit must be below enter" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        config("enforce", "gpu_pressure: {pre_cleanup: {command: [x], http_post: 'http://127.0.0.1:1/'}}\n")
    assert "exactly one of command, http_post" in str(ei.value)
    with pytest.raises(ConfigError):
        config("enforce", "cut: additive\n")


# ---- the pre-cleanup action --------------------------------------------------------------------------------

def precleanup_cfg(**kw: Any) -> Any:
    from qosagent.admission.config import PreCleanupConfig

    return PreCleanupConfig.model_validate(kw)


def test_pre_cleanup_command_runs_without_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pc = PreCleanup()
    # ';' would split this in a shell; as argv it is one literal argument to the script.
    pc.trigger(precleanup_cfg(command=[sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                                       str(marker), "a; touch x"]), "test")
    pc.wait(30)
    assert marker.read_text() == "a; touch x"
    assert pc.results == {"ok": 1}


def test_pre_cleanup_failure_and_timeout_are_counted(tmp_path: Path) -> None:
    pc = PreCleanup()
    pc.trigger(precleanup_cfg(command=[sys.executable, "-c", "raise SystemExit(3)"]), "t")
    pc.wait(30)
    assert pc.last["result"] == "failed" and "exited 3" in pc.last["detail"]
    pc.trigger(precleanup_cfg(command=[sys.executable, "-c", "import time; time.sleep(30)"], timeout="300ms"), "t")
    pc.wait(30)
    pc.trigger(precleanup_cfg(command=[str(tmp_path / "missing")]), "t")
    pc.wait(30)
    assert pc.results == {"failed": 2, "timeout": 1}


@pytest.fixture
def post_server() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.path)
            self.send_response(204 if self.path == "/ok" else 500)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def test_pre_cleanup_http_post(post_server: tuple[str, list[str]]) -> None:
    url, seen = post_server
    pc = PreCleanup()
    pc.trigger(precleanup_cfg(http_post=f"{url}/ok"), "t")
    pc.wait(30)
    pc.trigger(precleanup_cfg(http_post=f"{url}/broken"), "t")
    pc.wait(30)
    assert seen == ["/ok", "/broken"]
    assert pc.results == {"ok": 1, "failed": 1}


def test_pre_cleanup_runs_once_per_pressure_entry_and_not_in_dry_run(tmp_path: Path) -> None:
    marker = tmp_path / "count"
    cmd = [sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write('x')", str(marker)]
    extra = f"gpu_pressure: {{gpus: [0], trigger: level, pre_cleanup: {{command: {json.dumps(cmd)}}}}}\n"
    hot = GpuState(True, gpus=(GpuSample(0, "a", 100, 95),))
    for mode, expected in (("enforce", "x"), ("dry-run", None)):
        marker.unlink(missing_ok=True)
        cap = capability(mode, FakeLimits(), extra)
        run(cap, 5, gold_ms=50, gpu=hot)
        cap.pre_cleanup.wait(30)
        assert (marker.read_text() if marker.exists() else None) == expected


def test_render_survives_a_broken_status_part() -> None:
    assert Admission.render({"error": "boom"}) == "ADMISSION  boom"


def test_quiet_while_nothing_is_held_and_the_servers_and_gpus_read_as_the_tick_before() -> None:
    """quiet() (what lets the loop rest): a healthy tick with the same readings is quiet; a GPU's memory or a
    server's KV that moved since the tick before is not, though nothing is decided on it (the growth trigger judges
    memory by its lowest reading, which a slower loop could miss); a breach streak is not."""
    cap = capability("enforce", FakeLimits())
    seen = []
    for i, (ratio, kv, gold_ms) in enumerate([(0.5, 0.1, 7), (0.5, 0.1, 7), (0.6, 0.1, 7), (0.6, 0.1, 7),
                                              (0.6, 0.2, 7), (0.6, 0.2, 7), (0.6, 0.2, 200), (0.6, 0.2, 7)]):
        assert run(cap, 1, gold_ms=gold_ms, gpu=gpu_at(ratio), servers=vllm_at(kv), start=i) == []
        seen.append(cap.quiet())
    assert seen == [False, True, False, True, False, True, False, True]
