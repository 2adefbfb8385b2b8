"""One SLO verdict per tick: each tenant's and each tier's latency quantile against its SLO, judged once (latency's
collect puts it in its part) and read by whoever shows or acts on it: latency's metrics and status, admission's
decision and status, DVFS's near-SLO hold. Judged twice, the verdicts could disagree; read from here, they cannot.

The rule (docs/admission.md, "The policy, tick by tick"): `admission.quantile` of `admission.signal` over the latency
window, against the tier's `slo_p99`; a tier's quantile is taken over its configured tenants' windows merged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Collection, Mapping

from qosagent.hist import Histogram

if TYPE_CHECKING:
    from qosagent.config import Config


def tier_slos(cfg: "Config") -> dict[str, float]:
    """The SLO of each tier that has tenants (SloVerdict's tier_slo): its readers keep it per config, not per tick."""
    return {t.tier: cfg.tiers[t.tier].slo_p99 for t in cfg.tenants}


# A tenant's state, as latency's status shows it.
OK, BREACH, NO_DATA, NO_SLO = "ok", "breach", "no data", "-"


@dataclass(frozen=True)
class TenantSlo:
    tier: str
    latency: float | None  # the quantile over the window, seconds; None: no request in it
    slo: float  # seconds; 0: the tenant has no configured SLO (a tenant a reload removed)

    @property
    def state(self) -> str:
        if self.slo <= 0:
            return NO_SLO
        if self.latency is None:
            return NO_DATA
        return OK if self.latency <= self.slo else BREACH


@dataclass(frozen=True)
class TierSlo:
    observed: float | None  # the quantile over the tier's tenants' windows merged; None: no requests
    slo: float
    over: bool  # above its SLO (a breach once admission.breach_ticks ticks in a row)
    near: bool  # at or above admission.near_slo x SLO: DVFS must not lower frequency
    healthy: bool  # at or below admission.healthy_below x SLO, or no requests


class SloVerdict:
    """The verdict of one tick's windows. Each half is judged on first read and kept (the tick's snapshot is read by
    the tick and by scrapes): the tiers when admission or DVFS decide, the tenants when latency's metrics or status
    are asked for, so a tick pays for no half nobody reads."""

    def __init__(self, windows: Mapping[str, tuple[str, Histogram]], configured: Mapping[str, float],
                 tier_slo: Mapping[str, float], signal: str, quantile: float, near_slo: float, healthy_below: float,
                 busy: Collection[str] | None = None):
        """windows: name -> (tier, its window of `signal`), every tenant measured; configured: the configured
        tenants' SLOs (only they make up a tier); tier_slo: each configured tier's SLO; busy: the tenants whose
        window may hold requests, where the caller knows them (the others' are empty: a tier is merged from these)."""
        self.signal, self.quantile = signal, quantile
        self._windows, self._configured, self._tier_slo = windows, configured, tier_slo
        self._busy = busy
        self._near, self._healthy = near_slo, healthy_below

    @cached_property
    def tenants(self) -> Mapping[str, TenantSlo]:
        q = self.quantile
        return MappingProxyType({name: TenantSlo(of, window.quantile(q), self._configured.get(name, 0.0))
                                 for name, (of, window) in self._windows.items()})

    @cached_property
    def tiers(self) -> Mapping[str, TierSlo]:
        # Summed in place: chaining Histogram.__add__ copies the growing tier total once per tenant.
        merged: dict[str, dict[int, int]] = {}
        busy = self._windows.items() if self._busy is None else ((n, self._windows[n]) for n in self._busy)
        for name, (of, window) in busy:
            # An empty window adds nothing (its count is cheap; its counts are a subtraction): idle tenants cost none.
            if name in self._configured and window.count:
                acc = merged.setdefault(of, {})
                for i, c in window.counts.items():
                    acc[i] = acc.get(i, 0) + c
        return MappingProxyType({
            name: tier(Histogram(merged[name]).quantile(self.quantile) if name in merged else None, slo, self._near,
                       self._healthy) for name, slo in sorted(self._tier_slo.items())})

    @property
    def near_slo(self) -> frozenset[str]:
        return frozenset(n for n, t in self.tiers.items() if t.near)


def tier(observed: float | None, slo: float, near_slo: float, healthy_below: float) -> TierSlo:
    """A tier's verdict from its quantile: the one place over, near and healthy are told."""
    return TierSlo(observed, slo, observed is not None and observed > slo,
                   observed is not None and observed >= slo * near_slo,
                   observed is None or observed <= slo * healthy_below)
