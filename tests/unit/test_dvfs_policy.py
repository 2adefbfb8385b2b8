"""The operating-point decision with a fake clock: hysteresis, dwell, write cap, emergency, latency awareness."""

from __future__ import annotations

import pytest

from qosagent import config as config_mod
from qosagent.dvfs.config import DvfsConfig, OperatingPoint, parse_freq, parse_power
from qosagent.dvfs.policy import Inputs, Params, State, first_match, step

TICK = 0.1
KHZ = {"hot": 400000, "cool-idle": 800000, "warm": 1600000, "full": 3700000}


def params(**kw: object) -> Params:
    base = dict(points=tuple(DvfsConfig().points), khz=KHZ, temp_hysteresis_c=2.0, load_hysteresis=0.05,
                dwell_s=10.0, max_writes_per_minute=6, emergency_readings=3)
    base.update(kw)
    return Params(**base)  # type: ignore[arg-type]


def run(p: Params, state: State, inputs: list[Inputs], t0: float = 0.0) -> tuple[State, list[tuple[float, str]]]:
    moves = []
    for i, inp in enumerate(inputs):
        now = t0 + i * TICK
        s = step(p, state, inp, now)
        state = s.state
        if s.changed:
            moves.append((now, state.point))
    return state, moves


def test_default_table_is_the_design() -> None:
    pts = tuple(DvfsConfig().points)
    assert first_match(pts, 50, 0.10).name == "cool-idle"
    assert first_match(pts, 70, 0.50).name == "warm"
    assert first_match(pts, 86, 0.10).name == "hot" and first_match(pts, 86, 0.99).name == "hot"
    # What the design leaves open is not limited.
    assert first_match(pts, 50, 0.90).name == "full" and first_match(pts, 70, 0.90).name == "full"


@pytest.mark.parametrize("edge,load", [(85.0, 0.5), (60.0, 0.1), (60.0, 0.5)])
def test_one_degree_oscillation_at_a_band_edge_moves_at_most_once(edge: float, load: float) -> None:
    p = params(dwell_s=0.0)  # no dwell: only the hysteresis may hold the line
    state = step(p, State(), Inputs(edge - 1, load), 0.0).state
    temps = [edge + (1 if i % 2 else -1) for i in range(600)]  # 60 s at 10 Hz
    _, moves = run(p, state, [Inputs(t, load) for t in temps], t0=TICK)
    assert len(moves) <= 1, moves


def test_load_oscillation_at_a_band_edge_moves_at_most_once() -> None:
    p = params(dwell_s=0.0)
    state = step(p, State(), Inputs(70, 0.74), 0.0).state
    loads = [0.75 + (0.02 if i % 2 else -0.02) for i in range(600)]
    _, moves = run(p, state, [Inputs(70, x) for x in loads], t0=TICK)
    assert len(moves) <= 1, moves


def test_step_escalates_at_once_and_releases_only_after_dwell() -> None:
    p = params(dwell_s=10.0)
    state = step(p, State(), Inputs(70, 0.5), 0.0).state
    assert state.point == "warm"
    # Past the dwell of the first point, temperature steps to 90 C.
    state, moves = run(p, state, [Inputs(90, 0.5)] * 5, t0=20.0)
    assert moves and moves[0] == (20.0, "hot")  # within 1 tick
    # It drops back at once, but the hot point is held for the dwell.
    state, moves = run(p, state, [Inputs(70, 0.5)] * 150, t0=20.0 + TICK)
    assert [m[1] for m in moves] == ["warm"]
    assert moves[0][0] >= 20.0 + p.dwell_s
    assert moves[0][0] < 20.0 + p.dwell_s + 2 * TICK
    assert state.transitions == 2


def test_emergency_bypasses_dwell_and_write_cap_after_k_readings() -> None:
    p = params(dwell_s=60.0, max_writes_per_minute=1, emergency_readings=3)
    state = step(p, State(), Inputs(70, 0.5, critical_c=95), 0.0).state
    assert state.point == "warm" and len(state.writes) == 1
    state, moves = run(p, state, [Inputs(96, 0.5, critical_c=95)] * 2, t0=1.0)
    assert moves == []  # K-1 readings are not an emergency (and dwell/cap hold the table's hot)
    state, moves = run(p, state, [Inputs(96, 0.5, critical_c=95)], t0=1.2)
    assert moves == [(1.2, "hot")] and state.emergency and state.kind == "emergency"
    # Stays at the lowest point while near critical, even though the table would pick warm at 94 C... no: hot.
    state, moves = run(p, state, [Inputs(94, 0.5, critical_c=95)] * 10, t0=1.3)
    assert moves == [] and state.emergency
    # Clearly below critical: the emergency ends; leaving the point still obeys the dwell.
    state, moves = run(p, state, [Inputs(70, 0.5, critical_c=95)] * 10, t0=2.5)
    assert not state.emergency and moves == []
    state, moves = run(p, state, [Inputs(70, 0.5, critical_c=95)], t0=61.3)
    assert moves == [(61.3, "warm")]


def test_a_single_spike_is_not_an_emergency() -> None:
    p = params(dwell_s=60.0, emergency_readings=3)
    state = step(p, State(), Inputs(70, 0.5, critical_c=95), 0.0).state
    inputs = [Inputs(t, 0.5, critical_c=95) for t in (96, 70, 96, 96, 70, 96)]
    state, moves = run(p, state, inputs, t0=1.0)
    assert moves == [] and not state.emergency


def test_write_cap_holds_changes() -> None:
    p = params(dwell_s=0.0, temp_hysteresis_c=0.0, max_writes_per_minute=3)
    state = State()
    inputs = [Inputs(90 if i % 2 else 70, 0.5) for i in range(20)]
    state, moves = run(p, state, inputs)
    assert len(moves) == 3 and "write cap" in state.held
    state, moves = run(p, state, [Inputs(90, 0.5), Inputs(70, 0.5)], t0=60.5)
    assert len(moves) == 2


def test_near_slo_only_temperature_lowers_frequency() -> None:
    p = params(dwell_s=0.0)
    slo = frozenset({"gold"})
    # Cool and idle would be 800 MHz; near the SLO it is left unlimited.
    s = step(p, State(), Inputs(50, 0.1, near_slo=slo), 0.0)
    assert s.state.point == "full"
    # Already at cool-idle when gold nears its SLO: frequency goes up, reason near_slo.
    state = step(p, State(), Inputs(50, 0.1), 0.0).state
    s = step(p, state, Inputs(50, 0.1, near_slo=slo), 1.0)
    assert s.changed and s.state.point == "full" and s.state.kind == "near_slo" and "gold" in s.state.reason
    # Temperature still takes it down.
    s = step(p, s.state, Inputs(90, 0.1, near_slo=slo), 2.0)
    assert s.state.point == "hot" and s.state.kind == "temperature"


def test_no_temperature_holds_the_point() -> None:
    p = params(dwell_s=0.0)
    state = step(p, State(), Inputs(70, 0.5), 0.0).state
    s = step(p, state, Inputs(None, 0.1), 1.0)
    assert not s.changed and s.state.point == "warm" and s.state.held == "no valid temperature"


def test_unknown_load_is_read_as_busy() -> None:
    assert step(params(), State(), Inputs(50, None), 0.0).state.point == "full"


def test_units_and_table_validation() -> None:
    assert parse_freq("800MHz") == ("khz", 800000) and parse_freq("1.6GHz") == ("khz", 1600000)
    assert parse_freq("50%") == ("pct", 50.0)
    assert parse_power("80%") == ("pct", 80.0) and parse_power("450W") == ("w", 450.0)
    for bad in ("800", "0%", "150%", "fast"):
        with pytest.raises(ValueError):
            parse_freq(bad)
    with pytest.raises(config_mod.ConfigError) as ei:
        config_mod.parse({"dvfs": {"points": [{"name": "a", "temp_from_c": 50, "freq": "1GHz"}]}}, "t")
    assert "dvfs.points" in str(ei.value) and "no bounds" in str(ei.value)
    with pytest.raises(config_mod.ConfigError) as ei:
        config_mod.parse({"dvfs": {"points": [{"name": "a", "freq": "1 parsec"}]}}, "t")
    assert "dvfs.points[0].freq" in str(ei.value)
    with pytest.raises(config_mod.ConfigError):
        config_mod.parse({"dvfs": {"points": [
            {"name": "a", "temp_from_c": 80, "temp_below_c": 70, "freq": "1GHz"}, {"name": "b", "freq": "100%"}]}}, "t")
    assert OperatingPoint(name="x", freq="100%").bounded is False


def test_embedded_default_observes_only() -> None:
    cfg = config_mod.load(None)
    assert cfg.dvfs.enabled is False and cfg.dvfs.mode == "dry-run"
    assert DvfsConfig().mode == "dry-run"


def test_load_step_through_the_smoother_escalates_within_n_ticks_and_releases_after_dwell() -> None:
    from qosagent.dvfs.sensors import LoadTracker

    p = params(dwell_s=10.0)
    lt = LoadTracker(tau_s=1.0, groups={"policy0": (0,)})
    busy = total = 0
    state = State()
    moves: list[tuple[int, str]] = []
    for i in range(400):
        frac = 0.5 if 100 <= i < 150 else 0.1  # 5 s of 50 % load at 70 C, else 10 %
        busy += int(10 * frac)
        total += 10
        load = lt.update(i * TICK, {0: (busy, total)}).get("policy0")
        s = step(p, state, Inputs(70, load), i * TICK)
        state = s.state
        if s.changed and s.old is not None:
            moves.append((i, state.point))
    (up_tick, up), (down_tick, down) = moves
    assert up == "warm" and 100 < up_tick <= 100 + 15  # N = 15 ticks: the 1 s smoother plus the dead band
    assert down == "full" and down_tick >= up_tick + p.dwell_s / TICK
