"""The pure admission decision on synthetic traces with a fake clock (one tick = 100 ms)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from qosagent.admission import policy as P
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
                 floors: dict[str, float] | None = None):
        self.policy = policy
        self.state = P.LoopState()
        self.now = 1000.0
        self.baseline = baseline if baseline is not None else {
            "acme": TenantLimit(200, 20), "mid": TenantLimit(200, 20), "hobby": TenantLimit(200, 20)}
        self.floors = floors or {}
        self.rates = {n: 150.0 for n in TENANT_TIER}  # each tenant presses against its limit unless told
        self.changes: list[tuple[int, P.Change]] = []
        self.ticks = 0
        self.last: P.Outcome | None = None
        self.window_s = 0.0

    def tick(self, observed: dict[str, float | None] | None = None, gpu: P.GpuInput | None = None) -> P.Outcome:
        observed = observed or {}
        tiers = {t: P.TierInput(t, WEIGHT[t], SLO[t], observed.get(t, SLO[t] * 0.5)) for t in SLO}
        tenants = {}
        for name, tier in TENANT_TIER.items():
            lim = self.limit(name)
            rate = self.rates[name] if lim is None else min(self.rates[name], lim.rps)
            tenants[name] = P.TenantInput(name, tier, self.baseline.get(name), self.floors.get(tier, 0.0), 0,
                                          admitted_rps=rate)
        inp = P.TickInput(self.now, tiers, tenants, gpu or P.GpuInput.unknown("no GPU"), window_s=self.window_s)
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


def gpu(ratio: float) -> P.GpuInput:
    return P.GpuInput(True, ratio, 0)


def test_gpu_pressure_sheds_the_lowest_tier_first_with_hysteresis() -> None:
    loop = Loop(cfg(gpu_pressure={"escalate_after": "1s"}))
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
    loop = Loop(cfg(), floors={"bronze": 7.0})
    out = loop.tick(gpu=gpu(0.95))
    # The floor is a guarantee the quota writer also holds the kernel to: the audit says what is really in force.
    assert out.overrides == {"hobby": TenantLimit(7.0, 1)} and out.changes[0].new == TenantLimit(7.0, 1)


def test_unknown_gpu_sheds_nothing_and_releases_a_shed() -> None:
    loop = Loop(cfg())
    for _ in range(5):
        out = loop.tick(gpu=P.GpuInput.unknown("NVML not available"))
        assert out.changes == () and not out.part.gpu_pressure
    loop.tick(gpu=gpu(0.97))
    assert loop.limit("hobby") == TenantLimit(0.0, 0)
    out = loop.tick(gpu=P.GpuInput.unknown("GPU 0 lost"))
    assert [(c.tenant, c.action, c.reason) for c in out.changes] == [("hobby", "unshed", "gpu_state_unknown")]


def test_shed_keeps_the_adaptive_limit_underneath() -> None:
    loop = Loop(cfg())
    for _ in range(3):
        loop.tick(gold_over())
    loop.tick(gpu=gpu(0.95))
    assert loop.limit("hobby") == TenantLimit(0.0, 0)
    out = loop.tick(gpu=gpu(0.5))
    assert out.changes[0].new == TenantLimit(105.0, 10)
