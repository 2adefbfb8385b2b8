"""The pure admission decision on synthetic traces with a fake clock (one tick = 100 ms)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from qosagent.admission import policy as P
from qosagent import slo
from qosagent.admission.config import AdmissionConfig
from qosagent.tenants import TenantLimit

TICK = 0.1
SLO = {"gold": 0.120, "silver": 0.350, "bronze": 1.2}
WEIGHT = {"gold": 10, "silver": 5, "bronze": 1}
TENANT_TIER = {"acme": "gold", "mid": "silver", "hobby": "bronze"}


def cfg(**kw: Any) -> AdmissionConfig:
    return AdmissionConfig.model_validate({"enabled": True, "mode": "enforce", "cooldown": "1s", **kw})


class Loop:
    """Drives decide() tick by tick, keeping state, the clock and every change."""

    def __init__(self, policy: AdmissionConfig, baseline: dict[str, TenantLimit | None] | None = None,
                 floors: dict[str, float] | None = None, sheddable: frozenset[str] = frozenset({"bronze", "silver"})):
        self.policy = policy
        self.state = P.LoopState()
        self.now = 1000.0
        self.baseline = baseline if baseline is not None else {
            "acme": TenantLimit(200, 20), "mid": TenantLimit(200, 20), "hobby": TenantLimit(200, 20)}
        self.floors = floors or {}
        self.sheddable = sheddable
        self.ports: dict[str, frozenset[int]] = {}
        self.rates = {n: 150.0 for n in TENANT_TIER}  # each tenant presses against its limit unless told
        self.changes: list[tuple[int, P.Change]] = []
        self.ticks = 0
        self.last: P.Outcome | None = None
        self.window_s = 0.0
        self.cpu_held: frozenset[str] = frozenset()

    def tick(self, observed: dict[str, float | None] | None = None, gpu: P.GpuInput | None = None,
             servers: tuple[P.ServerInput, ...] = ()) -> P.Outcome:
        observed = observed or {}
        pol = self.policy
        tiers = {t: P.TierInput(t, WEIGHT[t], slo.tier(observed.get(t, SLO[t] * 0.5), SLO[t], pol.near_slo,
                                                       pol.healthy_below), t in self.sheddable) for t in SLO}
        tenants = {}
        for name, tier in TENANT_TIER.items():
            lim = self.limit(name)
            rate = self.rates[name] if lim is None else min(self.rates[name], lim.rps)
            tenants[name] = P.TenantInput(name, tier, self.baseline.get(name), self.floors.get(tier, 0.0), 0,
                                          admitted_rps=rate, sheddable=tier in self.sheddable,
                                          ports=self.ports.get(name, frozenset()))
        inp = P.TickInput(self.now, tiers, tenants, gpu or P.GpuInput.unknown("no GPU"), servers=servers,
                          window_s=self.window_s, cpu_held=self.cpu_held)
        out = P.decide(inp, self.policy, self.state)
        self.state = out.state
        self.last = out
        self.changes += [(self.ticks, c) for c in out.changes]
        self.ticks += 1
        self.now += TICK
        return out

    def limit(self, name: str) -> TenantLimit | None:
        s = self.state.tenants.get(name)
        return P.effective(P.TenantInput(name, TENANT_TIER[name], self.baseline.get(name)), s or P.TenantState())

    def rps(self, name: str) -> float:
        lim = self.limit(name)
        assert lim is not None
        return lim.rps


def gold_over(x: float = 1.5) -> dict[str, float]:
    return {"gold": SLO["gold"] * x}


def test_breach_cuts_the_lower_tier_first_within_three_ticks() -> None:
    loop = Loop(cfg())
    for _ in range(3):
        out = loop.tick(gold_over())
    assert [(c.tenant, c.action, c.reason) for c in out.changes] == [("hobby", "cut", "slo_breach")]
    assert loop.changes[0][0] == 2  # the third tick of the breach
    # Cut from the admitted rate (150 of 200), by 0.7; burst scaled with it.
    assert loop.limit("hobby") == TenantLimit(105.0, 10)
    assert loop.limit("acme") == TenantLimit(200, 20) and loop.limit("mid") == TenantLimit(200, 20)
    c = out.changes[0]
    assert c.inputs["breach_tier"] == "gold" and c.inputs["observed_s"] == pytest.approx(0.18)
    assert c.inputs["slo_s"] == 0.12 and c.inputs["tier"] == "bronze"
    assert out.part.in_breach == {"gold"} and "gold" in out.part.near_slo
    assert out.overrides == {"hobby": TenantLimit(105.0, 10)}


def test_latency_cuts_wait_while_resources_can_still_take_cpu_from_the_tiers_below() -> None:
    loop = Loop(cfg())
    loop.cpu_held = frozenset({"bronze"})  # resources has not brought bronze's CPU to its floor yet
    for _ in range(6):
        out = loop.tick(gold_over())
    assert loop.changes == [] and out.part.in_breach == {"gold"} and out.part.held_for_cpu == {"bronze"}
    loop.cpu_held = frozenset()  # bronze at its CPU floor: now its requests are cut
    out = loop.tick(gold_over())
    assert [(c.tenant, c.action) for c in out.changes] == [("hobby", "cut")] and out.part.held_for_cpu == set()


def test_persistent_breach_escalates_up_the_tiers() -> None:
    loop = Loop(cfg(), floors={"bronze": 100.0, "silver": 100.0})
    per_tick: dict[int, list[str]] = {}
    for i in range(15):
        out = loop.tick(gold_over())
        # The tier stays reported in breach between cuts (DVFS reads this), though cuts are paced.
        assert out.part.in_breach == ({"gold"} if i >= 2 else set())
    for tick, c in loop.changes:
        per_tick.setdefault(tick, []).append(f"{c.tenant}={c.new.rps:g}")
    # One cut per breach_ticks ticks; the next tier up only once the one below sits on its floor.
    assert per_tick == {2: ["hobby=105"], 5: ["hobby=100"], 8: ["mid=105"], 11: ["mid=100"], 14: ["acme=105"]}
    assert loop.state.escalation == 5


def test_cuts_wait_for_the_latency_window_to_turn_over() -> None:
    loop = Loop(cfg())
    loop.window_s = 1.0  # ten ticks: until then the quantile still holds requests from before the cut
    for _ in range(25):
        loop.tick(gold_over())
    assert sorted({t for t, _ in loop.changes}) == [2, 12, 22]


def test_a_breach_of_a_low_tier_never_cuts_a_higher_one() -> None:
    loop = Loop(cfg())
    for _ in range(100):
        loop.tick({"silver": SLO["silver"] * 2})
    assert {c.tenant for _, c in loop.changes} == {"hobby", "mid"}
    assert loop.limit("acme") == TenantLimit(200, 20)


def test_floors_hold_under_a_persistent_breach() -> None:
    loop = Loop(cfg(), floors={"bronze": 40.0})
    for _ in range(200):
        loop.tick(gold_over(3))
    assert loop.rps("hobby") == 40.0
    assert loop.rps("mid") == 1.0  # no floor configured: min_rps, never 0
    assert loop.rps("acme") == 1.0
    assert all(c.new is not None and c.new.rps >= 1.0 for _, c in loop.changes)
    # Once every tier sits on its floor nothing more changes, though the breach goes on.
    n = len(loop.changes)
    for _ in range(30):
        loop.tick(gold_over(3))
    assert len(loop.changes) == n


def test_gradient_mode_cuts_by_slo_over_observed_clamped() -> None:
    loop = Loop(cfg(cut="gradient"))
    for _ in range(3):
        loop.tick(gold_over(1.25))
    assert loop.rps("hobby") == pytest.approx(150 / 1.25)
    for _ in range(3):
        loop.tick(gold_over(4.0))  # slo/observed = 0.25, clamped to 0.5
    assert loop.rps("hobby") == pytest.approx(150 / 1.25 * 0.5)


def test_a_signal_oscillating_around_the_slo_does_not_flap() -> None:
    rng = random.Random(7)
    loop = Loop(cfg())
    for _ in range(1000):
        loop.tick({"gold": SLO["gold"] * rng.uniform(0.93, 1.07)})
    actions = [c.action for _, c in loop.changes]
    # Runs of 3 over-SLO ticks happen and cut, but the signal never gets healthy (< 0.9 SLO) long enough to
    # raise: limits only move one way, so there is no cut/raise alternation.
    assert "raise" not in actions and "restore" not in actions
    reversals = sum(1 for a, b in zip(actions, actions[1:]) if a != b)
    assert reversals == 0

    alternating = Loop(cfg())
    for i in range(1000):
        alternating.tick(gold_over(1.2) if i % 3 != 2 else gold_over(0.8))
    assert alternating.changes == []  # never breach_ticks consecutive ticks over


def test_recovery_waits_for_healthy_ticks_and_cooldown_then_steps_ten_percent() -> None:
    loop = Loop(cfg(cooldown="3s", healthy_ticks=5))
    for _ in range(3):
        loop.tick(gold_over())
    cut_tick = loop.changes[-1][0]
    assert loop.rps("hobby") == pytest.approx(105.0)
    for _ in range(200):
        loop.tick()
    raises = [(t, c) for t, c in loop.changes if c.action in ("raise", "restore")]
    # Cooldown 3 s = 30 ticks after the cut; then one step per 5 healthy ticks.
    assert raises[0][0] - cut_tick >= 30
    gaps = [b[0] - a[0] for a, b in zip(raises, raises[1:])]
    assert gaps and all(g == 5 for g in gaps)
    for _, c in raises:
        if c.action == "raise":
            assert c.new.rps <= c.old.rps * 1.10 + 1e-9
            assert c.reason == "slo_recovered"
    assert raises[-1][1].action == "restore" and raises[-1][1].new == TenantLimit(200, 20)
    assert loop.state.tenants["hobby"].limit is None and loop.last is not None and loop.last.overrides == {}


def test_raises_also_wait_for_the_latency_window() -> None:
    loop = Loop(cfg(cooldown="100ms", healthy_ticks=2))
    loop.window_s = 1.0
    for _ in range(3):
        loop.tick(gold_over())
    for _ in range(60):
        loop.tick()
    ticks = [t for t, c in loop.changes]
    assert len(ticks) >= 4 and all(b - a >= 10 for a, b in zip(ticks, ticks[1:]))


def test_no_growth_for_a_tenant_using_less_than_half_its_limit() -> None:
    loop = Loop(cfg(cooldown="100ms", healthy_ticks=2))
    for _ in range(3):
        loop.tick(gold_over())
    loop.rates["hobby"] = 50.0  # under half of 105
    for _ in range(100):
        loop.tick()
    assert loop.rps("hobby") == pytest.approx(105.0)
    loop.rates["hobby"] = 90.0
    loop.tick()
    loop.tick()
    assert loop.rps("hobby") == pytest.approx(115.5)


def test_unlimited_baseline_is_cut_from_the_admitted_rate_and_restored_to_unlimited() -> None:
    loop = Loop(cfg(cooldown="100ms", healthy_ticks=1), baseline={})
    loop.rates["hobby"] = 300.0
    for _ in range(3):
        loop.tick(gold_over())
    assert loop.rps("hobby") == pytest.approx(210.0)
    for _ in range(20):
        loop.tick()
    assert loop.limit("hobby") is None
    restore = [c for _, c in loop.changes if c.action == "restore"]
    assert restore and restore[0].new is None


def gpu(ratio: float, evidence: str = P.MEMORY_EVIDENCE, kv: float | None = None) -> P.GpuInput:
    return P.GpuInput((P.GpuReading(0, ratio, evidence, "the server reports KV" if kv is not None else "", kv),))


LEVEL = {"trigger": "level"}  # GPU memory over enter counts whatever it started at: the operator says it is load


def test_gpu_pressure_sheds_the_lowest_tier_first_with_hysteresis() -> None:
    loop = Loop(cfg(gpu_pressure={"escalate_after": "1s", **LEVEL}))
    out = loop.tick(gpu=gpu(0.95))
    assert out.run_pre_cleanup
    assert [(c.tenant, c.action, c.reason) for c in out.changes] == [("hobby", "shed", "gpu_memory_pressure")]
    assert out.overrides["hobby"] == TenantLimit(0.0, 0) and "acme" not in out.overrides
    out = loop.tick(gpu=gpu(0.95))
    assert not out.run_pre_cleanup and out.changes == ()  # the pre-cleanup runs once per entry
    for _ in range(9):
        loop.tick(gpu=gpu(0.95))
    assert loop.state.shed_tiers == 2 and loop.limit("mid") == TenantLimit(0.0, 0)
    assert loop.limit("acme") == TenantLimit(200, 20)
    for _ in range(50):
        out = loop.tick(gpu=gpu(0.87))  # between exit and enter: stays shed, no escalation either
        assert not out.changes
    out = loop.tick(gpu=gpu(0.84))
    assert {(c.tenant, c.action, c.reason) for c in out.changes} == {
        ("hobby", "unshed", "gpu_memory_relieved"), ("mid", "unshed", "gpu_memory_relieved")}
    assert loop.limit("hobby") == TenantLimit(200, 20) and out.overrides == {}
    out = loop.tick(gpu=gpu(0.95))
    assert out.run_pre_cleanup  # a new entry runs it again


def test_shedding_keeps_a_tiers_floor() -> None:
    loop = Loop(cfg(gpu_pressure=LEVEL), floors={"bronze": 7.0})
    out = loop.tick(gpu=gpu(0.95))
    # The floor is a guarantee the quota writer also holds the kernel to: the audit says what is really in force.
    assert out.overrides == {"hobby": TenantLimit(7.0, 1)} and out.changes[0].new == TenantLimit(7.0, 1)


def test_unknown_gpu_sheds_nothing_and_releases_a_shed() -> None:
    loop = Loop(cfg(gpu_pressure=LEVEL))
    for _ in range(5):
        out = loop.tick(gpu=P.GpuInput.unknown("NVML not available"))
        assert out.changes == () and not out.part.gpu_pressure
    loop.tick(gpu=gpu(0.97))
    assert loop.limit("hobby") == TenantLimit(0.0, 0)
    out = loop.tick(gpu=P.GpuInput.unknown("GPU 0 lost"))
    assert [(c.tenant, c.action, c.reason) for c in out.changes] == [("hobby", "unshed", "gpu_state_unknown")]


def test_shed_keeps_the_adaptive_limit_underneath() -> None:
    loop = Loop(cfg(gpu_pressure=LEVEL))
    for _ in range(3):
        loop.tick(gold_over())
    loop.tick(gpu=gpu(0.95))
    assert loop.limit("hobby") == TenantLimit(0.0, 0)
    out = loop.tick(gpu=gpu(0.5))
    assert out.changes[0].new == TenantLimit(105.0, 10)


# ---- server pressure (KV cache, queue) and floors ----

def vllm(kv: float | None, waiting: float | None = 0, port: int = 8000, known: bool = True) -> tuple[P.ServerInput]:
    return (P.ServerInput(port, "vllm", known, kv, waiting),)


def test_a_server_with_room_in_its_kv_cache_sheds_nobody() -> None:
    loop = Loop(cfg(), sheddable=frozenset())
    for _ in range(300):
        out = loop.tick(servers=vllm(0.30, 3))
    assert loop.changes == [] and out.overrides == {} and out.part.server_pressure == frozenset()


def test_a_full_kv_cache_cuts_bronze_first_then_silver_and_never_gold_below_its_floor() -> None:
    loop = Loop(cfg(server_pressure={"cut_every": "1s"}), floors={"gold": 50.0}, sheddable=frozenset())
    for _ in range(600):
        out = loop.tick(servers=vllm(0.99, 20))
    cuts = [(t, c.tenant, c.new.rps) for t, c in loop.changes]
    assert all(c.action == "cut" and c.reason == "server_pressure" for _, c in loop.changes)
    assert cuts[0] == (0, "hobby", 105.0)  # the tick the pressure is seen: 150 admitted x 0.7
    first_mid = next(t for t, n, _ in cuts if n == "mid")
    # Silver only once bronze sits on its floor (min_rps here), and one cut per cut_every (10 ticks).
    assert [r for t, n, r in cuts if n == "hobby"][-1] == 1.0
    assert all(t < first_mid for t, n, _ in cuts if n == "hobby")
    assert all(b - a >= 10 for a, b in zip([t for t, _, _ in cuts], [t for t, _, _ in cuts][1:]))
    assert loop.rps("acme") == 50.0 and min(r for _, n, r in cuts if n == "acme") == 50.0
    assert out.part.server_pressure == {8000}
    c = loop.changes[0][1]
    assert c.inputs["server"] == 8000 and c.inputs["rule"] == "kv_cache_usage 0.99 > 0.95"
    assert out.set_by["hobby"] == P.SetBy("server", "cut, held at min_rps", "server 8000: kv_cache_usage 0.99 > 0.95")
    assert out.set_by["acme"].rule == "cut, held at the tier floor"


def test_recovery_when_the_kv_cache_drops_below_exit_paced_and_with_hysteresis() -> None:
    loop = Loop(cfg(cooldown="1s", healthy_ticks=5), sheddable=frozenset())
    for _ in range(3):
        loop.tick(servers=vllm(0.99, 0))
    assert loop.rps("hobby") == 105.0
    for _ in range(100):  # between exit and enter: still pressed, nothing raised
        out = loop.tick(servers=vllm(0.90, 0))
        assert out.part.server_pressure == {8000}
    assert [c.action for _, c in loop.changes] == ["cut"] * len(loop.changes)
    n = len(loop.changes)
    for _ in range(300):
        loop.tick(servers=vllm(0.50, 0))
    raises = [(t, c) for t, c in loop.changes[n:]]
    assert raises and {c.reason for _, c in raises} == {"server_relieved"}
    assert all(b[0] - a[0] >= 5 for a, b in zip(raises, raises[1:]))
    assert raises[-1][1].action == "restore" and loop.limit("hobby") == TenantLimit(200, 20)


def test_a_queue_presses_only_after_queue_ticks_ticks_over_queue_enter() -> None:
    loop = Loop(cfg(server_pressure={"queue_enter": 16, "queue_ticks": 10}), sheddable=frozenset())
    for _ in range(9):
        loop.tick(servers=vllm(0.5, 20))
    loop.tick(servers=vllm(0.5, 3))  # the run is broken: the count starts again
    for _ in range(9):
        loop.tick(servers=vllm(0.5, 20))
    assert loop.changes == []
    out = loop.tick(servers=vllm(0.5, 20))
    assert [(c.tenant, c.action) for c in out.changes] == [("hobby", "cut")]
    assert "requests_waiting 20 > 16 for 10 ticks" in out.changes[0].inputs["rule"]


def test_an_unknown_server_reading_presses_nothing_and_ends_the_pressure() -> None:
    loop = Loop(cfg(), sheddable=frozenset())
    for _ in range(50):
        loop.tick(servers=vllm(None, None, known=False))
        loop.tick(servers=vllm(None, 40))  # KV not exported (TGI): only the queue can press
    assert loop.changes == []
    loop.tick(servers=vllm(0.99, 0))
    assert loop.state.servers[8000].pressed
    out = loop.tick(servers=vllm(0.99, 0, known=False))
    assert out.part.server_pressure == frozenset() and not loop.state.servers[8000].pressed


def test_only_the_tenants_a_pressed_server_serves_are_cut() -> None:
    loop = Loop(cfg(), sheddable=frozenset())
    loop.ports = {"hobby": frozenset({9000}), "mid": frozenset({8000})}
    out = loop.tick(servers=vllm(0.99, 0, port=8000))
    assert [(c.tenant, c.action) for c in out.changes] == [("mid", "cut")]


def test_gpu_shedding_never_touches_a_tier_that_is_not_sheddable() -> None:
    loop = Loop(cfg(gpu_pressure={"escalate_after": "100ms", **LEVEL}), floors={"silver": 20.0},
                sheddable=frozenset({"bronze"}))
    for _ in range(20):
        out = loop.tick(gpu=gpu(0.97))
    assert out.part.gpu_pressure and loop.state.shed_tiers == 1  # no escalation past the sheddable tiers
    assert loop.limit("hobby") == TenantLimit(0.0, 0)
    assert loop.limit("mid") == TenantLimit(200, 20) and loop.limit("acme") == TenantLimit(200, 20)
    assert {c.tenant for _, c in loop.changes} == {"hobby"}
    assert out.set_by["acme"] == P.SetBy("config", "baseline")
    assert out.set_by["hobby"] == P.SetBy("gpu_memory", "shed, shed to 0 (sheddable tier)", "GPU 0 memory 97% > 0.9")
    none = Loop(cfg(gpu_pressure=LEVEL), sheddable=frozenset())
    for _ in range(20):
        out = none.tick(gpu=gpu(0.97))
    assert none.changes == [] and out.overrides == {} and none.state.shed_tiers == 0


def test_gpu_memory_counts_by_growth_not_by_a_level_held_from_the_first_reading() -> None:
    loop = Loop(cfg(gpu_pressure={"escalate_after": "100ms"}))
    for _ in range(50):  # a pre-allocating server's 92 %, there since the first reading
        out = loop.tick(gpu=gpu(0.92))
    assert loop.changes == [] and not out.part.gpu_pressure
    assert out.gpus[0].ignored == P.NO_GROWTH and not out.gpus[0].counts and "no growth" in out.gpus[0].why
    grown = Loop(cfg(gpu_pressure={"escalate_after": "100ms"}), sheddable=frozenset({"bronze"}))
    for ratio in (0.30, 0.60, 0.80, 0.95, 0.95, 0.95):
        out = grown.tick(gpu=gpu(ratio))
    assert [(c.tenant, c.action) for _, c in grown.changes] == [("hobby", "shed")]
    assert grown.changes[0][1].inputs["trigger"] == "growth"
    assert out.set_by["hobby"].detail == "GPU 0 memory 95% > 0.9, grown from 30%"
    assert grown.limit("acme") == TenantLimit(200, 20) and grown.limit("mid") == TenantLimit(200, 20)


def test_a_server_reading_overrides_gpu_memory_and_a_change_of_evidence_starts_growth_again() -> None:
    loop = Loop(cfg(gpu_pressure={"escalate_after": "100ms"}))
    loop.tick(gpu=gpu(0.30))
    for _ in range(30):  # grown past enter, but a server that may use the GPU says its KV cache has room
        out = loop.tick(gpu=gpu(0.95, P.SERVER_EVIDENCE, kv=0.30), servers=vllm(0.30))
    assert loop.changes == [] and not out.part.gpu_pressure
    v = out.gpus[0]
    assert (v.counts, v.ignored, v.conflict) == (False, P.SERVER_EVIDENCE, False)  # growth began under memory
    for _ in range(30):  # the server's reading goes: no evidence either way, nothing shed
        out = loop.tick(gpu=gpu(0.95, P.MISSING_EVIDENCE))
    assert loop.changes == [] and out.gpus[0].ignored == P.MISSING_EVIDENCE
    for _ in range(30):  # memory alone again, but at 95 % since that began: no growth seen
        out = loop.tick(gpu=gpu(0.95))
    assert loop.changes == [] and out.gpus[0].ignored == P.NO_GROWTH


def test_memory_grown_while_every_server_reports_its_kv_low_is_a_conflict_not_an_action() -> None:
    loop = Loop(cfg())
    for ratio in (0.50, 0.80, 0.95, 0.96):
        out = loop.tick(gpu=gpu(ratio, P.SERVER_EVIDENCE, kv=0.20), servers=vllm(0.20))
    assert out.gpus[0].conflict and loop.changes == [] and out.overrides == {}
    out = loop.tick(gpu=gpu(0.96, P.SERVER_EVIDENCE, kv=0.97), servers=vllm(0.97))
    assert not out.gpus[0].conflict  # the server agrees it is full: its own path cuts
    assert [c.reason for _, c in loop.changes] == ["server_pressure"]


def test_a_shed_in_force_is_released_when_a_server_reading_starts_to_speak_for_the_gpu() -> None:
    loop = Loop(cfg(gpu_pressure=LEVEL))
    loop.tick(gpu=gpu(0.95))
    assert loop.limit("hobby") == TenantLimit(0.0, 0)
    out = loop.tick(gpu=gpu(0.95, P.SERVER_EVIDENCE, kv=0.3), servers=vllm(0.3))
    assert [(c.tenant, c.action, c.reason) for c in out.changes] == [("hobby", "unshed", "gpu_memory_not_evidence")]


def test_kv_full_and_a_queue_on_a_gpu_at_92_percent_cut_bronze_first_gold_only_to_its_floor_then_recover() -> None:
    loop = Loop(cfg(cooldown="1s", healthy_ticks=5, server_pressure={"cut_every": "300ms"}), floors={"gold": 50.0},
                sheddable=frozenset({"bronze"}))
    for _ in range(400):
        loop.tick(gpu=gpu(0.92, P.SERVER_EVIDENCE, kv=0.99), servers=vllm(0.99, 20))
    cuts = [(t, c.tenant, c.new.rps) for t, c in loop.changes]
    assert {c.reason for _, c in loop.changes} == {"server_pressure"}  # never the GPU path
    assert cuts[0][1] == "hobby" and loop.rps("acme") == 50.0 and min(r for _, n, r in cuts if n == "acme") == 50.0
    assert loop.rps("hobby") == 1.0  # bronze has no floor: its cuts stop at min_rps
    n = len(loop.changes)
    for _ in range(600):
        loop.tick(gpu=gpu(0.92, P.SERVER_EVIDENCE, kv=0.40), servers=vllm(0.40, 0))
    ups = loop.changes[n:]
    assert ups and {c.action for _, c in ups} <= {"raise", "restore"}
    ticks = sorted({t for t, _ in ups})
    assert all(b - a >= 5 for a, b in zip(ticks, ticks[1:]))  # one step per healthy_ticks, never faster
    assert loop.limit("acme") == TenantLimit(200, 20) and loop.limit("hobby") == TenantLimit(200, 20)


def test_a_cut_stops_at_the_tiers_floor_where_one_is_set_else_at_min_rps() -> None:
    loop = Loop(cfg(server_pressure={"cut_every": "100ms"}), floors={"bronze": 0.5}, sheddable=frozenset())
    for _ in range(300):
        loop.tick(servers=vllm(0.99, 0))
    assert loop.rps("hobby") == 0.5 and loop.rps("mid") == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_no_path_ever_takes_a_tenant_below_its_floor(seed: int) -> None:
    """Random mixes of SLO breaches, server pressure and GPU pressure: every limit ever decided respects the floor
    of its tier and min_rps, except sheds of sheddable tiers (to their floor)."""
    rng = random.Random(seed)
    floors = {"gold": 30.0, "silver": 0.0, "bronze": 0.0}
    loop = Loop(cfg(cooldown="300ms", healthy_ticks=2, gpu_pressure={"escalate_after": "200ms", **LEVEL},
                    server_pressure={"cut_every": "100ms"}), floors=floors, sheddable=frozenset({"bronze"}))
    for _ in range(3000):
        loop.tick({"gold": SLO["gold"] * rng.choice([0.5, 1.5, 3.0])},
                  gpu=gpu(rng.choice([0.5, 0.87, 0.97])) if rng.random() < 0.9 else P.GpuInput.unknown("x"),
                  servers=vllm(rng.choice([0.3, 0.9, 0.99, float("nan")]), rng.choice([0, 30]),
                               known=rng.random() < 0.9))
        for name, tier in TENANT_TIER.items():
            lim = loop.limit(name)
            low = floors[tier] if tier == "bronze" and loop.state.tenants[name].shed else max(floors[tier], 1.0)
            assert lim is None or lim.rps >= low, (name, lim)
    assert {c.reason for _, c in loop.changes} >= {"slo_breach", "server_pressure", "gpu_memory_pressure"}


def test_a_latency_breach_and_server_pressure_on_one_tick_cut_once() -> None:
    loop = Loop(cfg(server_pressure={"cut_every": "100ms"}), sheddable=frozenset())
    loop.tick(gold_over())
    loop.tick(gold_over())
    out = loop.tick(gold_over(), servers=vllm(0.99, 0))  # the breach's third tick, and the cache full
    assert [(c.tenant, c.reason) for c in out.changes] == [("hobby", "slo_breach")]
    out = loop.tick(gold_over(), servers=vllm(0.99, 0))
    assert [(c.tenant, c.reason) for c in out.changes] == [("hobby", "server_pressure")]
    # The server's cut answered gold's breach too, and says so: the breach rule waits a window after any cut.
    assert out.changes[0].inputs["breaching"] == ["gold"]


class Counted(dict):  # type: ignore[type-arg]
    """Tenant inputs that count which tenants decide() asked for (as qosagent.admission.inputs.TenantInputs builds
    them: on first access)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.asked: set[str] = set()

    def __getitem__(self, name: str) -> P.TenantInput:
        self.asked.add(name)
        return super().__getitem__(name)

    def items(self):  # type: ignore[no-untyped-def]
        self.asked.update(self)
        return super().items()

    def values(self):  # type: ignore[no-untyped-def]
        self.asked.update(self)
        return super().values()


def test_a_tick_at_rest_asks_for_no_idle_tenant() -> None:
    """1,000 tenants: a healthy tick asks for none of them; a breach cuts the lowest tier (and asks for every tenant,
    once); recovery then asks only for the tenants it cut."""
    pol = cfg(cooldown="0s", healthy_ticks=1)
    tiers_of = {f"t{i}": ("gold", "silver", "bronze")[i % 3] for i in range(1000)}
    state, now = P.LoopState(), 1000.0

    def tick(over: bool) -> tuple[P.Outcome, set[str]]:
        nonlocal state, now
        tiers = {t: P.TierInput(t, WEIGHT[t], slo.tier(SLO[t] * (1.5 if over and t == "gold" else 0.5), SLO[t],
                                                       pol.near_slo, pol.healthy_below), False) for t in SLO}
        tenants = Counted({n: P.TenantInput(n, t, TenantLimit(100, 10), admitted_rps=90.0)
                           for n, t in tiers_of.items()})
        out = P.decide(P.TickInput(now, tiers, tenants, P.GpuInput.unknown("no GPU")), pol, state)
        state, now = out.state, now + TICK
        return out, tenants.asked

    for _ in range(3):
        out, asked = tick(False)
        assert asked == set() and out.overrides == {} and out.set_by["t5"] == P.SetBy("config", "baseline")
    for _ in range(pol.breach_ticks):
        out, asked = tick(True)
    cut = {c.tenant for c in out.changes}
    assert cut == {n for n, t in tiers_of.items() if t == "bronze"} and set(out.overrides) == cut
    assert state.tenants["t1"].limit is None  # a tenant never cut is at rest
    raised: set[str] = set()
    for _ in range(5):
        out, asked = tick(False)
        assert asked <= cut
        raised |= {c.tenant for c in out.changes}
    assert raised == cut


def test_the_loop_state_is_quiet_only_with_nothing_held_or_building_and_stays_so_however_late_it_ticks() -> None:
    """LoopState.quiet lets the daemon tick slower (rest_interval): it must be false from a breach's first tick
    until its last held limit is restored and the episode over, and from true unchanged inputs change nothing."""
    loop = Loop(cfg(), baseline={"acme": TenantLimit(200, 20), "mid": TenantLimit(200, 20),
                                 "hobby": TenantLimit(200, 20)})
    assert loop.tick().state.quiet
    states = [loop.tick(gold_over()).state for _ in range(3)]
    assert [s.quiet for s in states] == [False, False, False] and loop.changes  # a streak, then hobby's cut
    rested = None
    for i in range(300):
        out = loop.tick()
        if out.state.quiet:
            rested = i
            break
    assert rested is not None and loop.limit("hobby") == TenantLimit(200, 20)
    assert loop.changes[-1][1].action == P.RESTORE
    for gap in (0.1, 0.5, 5.0, 60.0):
        loop.now += gap
        out = loop.tick()
        assert not out.changes and out.state.quiet
