"""The operating-point decision, as a pure function of the previous state, this tick's inputs and the time.

No file, clock or logger is touched here, so every property the issue asks for (hysteresis, dwell, write cap,
emergency, latency awareness) is tested with a fake clock and plain values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from qosagent.dvfs.config import OperatingPoint

WINDOW_S = 60.0  # the write cap counts transitions over this window


@dataclass(frozen=True)
class Params:
    points: tuple[OperatingPoint, ...]
    khz: dict[str, int]  # each point's frequency, resolved for one policy (relative points need its cpuinfo_max)
    temp_hysteresis_c: float = 2.0
    load_hysteresis: float = 0.05  # fraction, like load
    dwell_s: float = 10.0
    max_writes_per_minute: int = 6
    emergency_readings: int = 3

    @property
    def lowest(self) -> OperatingPoint:
        return min(self.points, key=lambda p: self.khz[p.name])

    def point(self, name: str) -> OperatingPoint:
        return next(p for p in self.points if p.name == name)


@dataclass(frozen=True)
class Inputs:
    temp_c: float | None  # the hottest valid sensor this tick; None when no sensor gave a valid reading
    load: float | None  # smoothed busy fraction of the policy's CPUs
    critical_c: float | None = None  # the configured limit or the lowest critical trip, whichever is lower
    near_slo: frozenset[str] = frozenset()


@dataclass(frozen=True)
class State:
    point: str | None = None
    since: float = -math.inf
    writes: tuple[float, ...] = ()  # transition times within the last WINDOW_S
    hot_readings: int = 0
    emergency: bool = False
    transitions: int = 0
    kind: str = ""  # start, emergency, temperature, load, temperature+load, near_slo
    reason: str = ""
    held: str = ""  # why the table's choice was not taken this tick (dwell, write cap, ...), for status


@dataclass(frozen=True)
class Step:
    state: State
    changed: bool
    old: str | None = None


def _inside(p: OperatingPoint, temp: float, load: float, dt: float, dl: float) -> bool:
    """Whether (temp, load) is inside p's bounds moved outward by dt/dl (negative: inward)."""
    if p.temp_from_c is not None and temp < p.temp_from_c - dt:
        return False
    if p.temp_below_c is not None and temp >= p.temp_below_c + dt:
        return False
    if p.load_from_pct is not None and load * 100 < p.load_from_pct - dl * 100:
        return False
    if p.load_below_pct is not None and load * 100 >= p.load_below_pct + dl * 100:
        return False
    return True


def first_match(points: tuple[OperatingPoint, ...], temp: float, load: float) -> OperatingPoint:
    for p in points:
        if _inside(p, temp, load, 0.0, 0.0):
            return p
    return points[-1]  # unreachable with a validated table: its last row has no bounds


def sticky_match(points: tuple[OperatingPoint, ...], current: str, temp: float, load: float, dt: float,
                 dl: float) -> OperatingPoint:
    """first_match with a dead band: the current row widened and every other row narrowed by (dt, dl), so an
    input wobbling around an edge must clearly cross it before the point changes, and changes at most once."""
    for p in points:
        grow = 1.0 if p.name == current else -1.0
        if _inside(p, temp, load, grow * dt, grow * dl):
            return p
    return points[-1]


def _kind(old: OperatingPoint | None, new: OperatingPoint) -> str:
    def of(p: OperatingPoint) -> set[str]:
        k = set()
        if p.temp_from_c is not None or p.temp_below_c is not None:
            k.add("temperature")
        if p.load_from_pct is not None or p.load_below_pct is not None:
            k.add("load")
        return k

    kinds = of(new) or (of(old) if old else set()) or {"load"}
    return "+".join(sorted(kinds))


def step(params: Params, state: State, inp: Inputs, now: float) -> Step:
    writes = tuple(t for t in state.writes if now - t < WINDOW_S)
    state = replace(state, writes=writes, held="")
    h = params.temp_hysteresis_c / 2

    # Emergency: counted on raw readings, left only when clearly below the limit again.
    at_crit = inp.temp_c is not None and inp.critical_c is not None and inp.temp_c >= inp.critical_c
    hot = state.hot_readings + 1 if at_crit else 0
    state = replace(state, hot_readings=hot)
    if hot >= params.emergency_readings:
        low = params.lowest
        if state.point == low.name and state.emergency:
            return Step(state, False)
        reason = (f"emergency: {inp.temp_c:.1f} C at or above {inp.critical_c:.1f} C for {hot} readings, "
                  f"-> {low.name} ({params.khz[low.name] // 1000} MHz)")
        return _move(state, low.name, now, "emergency", reason, emergency=True)
    if state.emergency:
        if inp.temp_c is None or inp.critical_c is None or inp.temp_c >= inp.critical_c - 2 * h:
            return Step(replace(state, held="emergency"), False)
        state = replace(state, emergency=False)

    if inp.temp_c is None:
        return Step(replace(state, held="no valid temperature"), False)
    # Near an SLO the table is read as if the CPUs were saturated: only temperature may take frequency away.
    load = 1.0 if inp.near_slo or inp.load is None else inp.load
    raw = first_match(params.points, inp.temp_c, load)
    if state.point is None:
        return _move(state, raw.name, now, "start", _why(None, raw, inp, params), emergency=False)
    cur = params.point(state.point)
    cand = sticky_match(params.points, cur.name, inp.temp_c, load, h, params.load_hysteresis / 2)
    if cand.name == cur.name:
        held = f"hysteresis ({raw.name} at the band edge)" if raw.name != cur.name else ""
        return Step(replace(state, held=held), False)
    if now - state.since < params.dwell_s:
        return Step(replace(state, held=f"dwell ({cand.name} wanted)"), False)
    if len(writes) >= params.max_writes_per_minute:
        return Step(replace(state, held=f"write cap ({cand.name} wanted)"), False)
    unaided = first_match(params.points, inp.temp_c, 1.0 if inp.load is None else inp.load)
    kind = "near_slo" if inp.near_slo and unaided.name != cand.name else _kind(cur, cand)
    return _move(state, cand.name, now, kind, _why(cur, cand, inp, params), emergency=False)


def _why(old: OperatingPoint | None, new: OperatingPoint, inp: Inputs, params: Params) -> str:
    t = f"{inp.temp_c:.1f} C" if inp.temp_c is not None else "no temperature"
    lo = f"load {inp.load:.0%}" if inp.load is not None else "load unknown"
    slo = f", near SLO: {','.join(sorted(inp.near_slo))} (load read as 100%)" if inp.near_slo else ""
    return f"{old.name if old else 'start'} -> {new.name} ({params.khz[new.name] // 1000} MHz): {t}, {lo}{slo}"


def _move(state: State, point: str, now: float, kind: str, reason: str, emergency: bool) -> Step:
    new = replace(state, point=point, since=now, writes=state.writes + (now,), emergency=emergency,
                  transitions=state.transitions + (0 if state.point is None else 1), kind=kind, reason=reason)
    return Step(new, True, state.point)
