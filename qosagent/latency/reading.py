"""The tick's read of the kernel's rows (bpfmaps.Raw) as the part's numbers, pure: since-start histograms as read,
window histograms as the difference to the window's checkpoint, counters per tenant."""

from __future__ import annotations

from typing import Mapping

from qosagent.hist import Histogram, Since
from qosagent.latency import bpfmaps as bm
from qosagent.latency.model import TenantLatency
from qosagent.tenants import UNMATCHED_ID, TenantInfo

_EMPTY: dict[int, int] = {}


def tenants(raw: bm.Raw, base: bm.Raw, elapsed: float, current: Mapping[int, TenantInfo],
            known: Mapping[int, TenantInfo]) -> dict[str, TenantLatency]:
    """Each tenant of the config (current), and any a reload removed that still has counts since start (known names
    it), by name."""
    ids = set(current) | {t for (t, _kind) in raw.hist} | {t for (t, _what) in raw.counters}
    out = {}
    for tid in sorted(ids):
        info = current.get(tid) or known.get(tid) or TenantInfo(tid, f"id-{tid}", "none", 0, 0.0)
        out[info.name] = _tenant(info, raw, base, elapsed)
    return out


def runqueue(raw: bm.Raw, base: bm.Raw) -> tuple[Histogram, Histogram]:
    """The run-queue histogram since start and over the window."""
    h = _hist(raw, UNMATCHED_ID, bm.KIND_RUNQ)
    return h, Since(h, _hist(base, UNMATCHED_ID, bm.KIND_RUNQ))


def _hist(raw: bm.Raw, tid: int, kind: int) -> Histogram:
    # Not copied: RowParser makes a new dict for each changed row and never touches one it has handed out.
    return Histogram(raw.hist.get((tid, kind), _EMPTY), raw.sums.get((tid, kind), 0))


def _tenant(info: TenantInfo, raw: bm.Raw, base: bm.Raw, elapsed: float) -> TenantLatency:
    tid = info.id

    def c(r: bm.Raw, what: int) -> int:
        return r.counters.get((tid, what), 0)

    def since(kind: int) -> tuple[Histogram, Histogram]:
        h = _hist(raw, tid, kind)
        return h, Since(h, _hist(base, tid, kind))

    headers, headers_window = since(bm.KIND_HEADERS)
    ttft, ttft_window = since(bm.KIND_TTFT)
    resp, resp_window = since(bm.KIND_RESPONSE)
    itl, itl_window = since(bm.KIND_ITL)
    return TenantLatency(
        tenant=info.name,
        tier=info.tier,
        requests=resp.count,
        headers=headers,
        ttft=ttft,
        response=resp,
        inter_token=itl,
        headers_window=headers_window,
        ttft_window=ttft_window,
        response_window=resp_window,
        inter_token_window=itl_window,
        rate_rps=resp_window.count / elapsed if elapsed > 0 else 0.0,
        in_flight=max(c(raw, bm.C_STARTED) - resp.count - c(raw, bm.C_UNPAIRED_CLOSE), 0),
        unpaired=c(raw, bm.C_UNPAIRED_SEND) + c(raw, bm.C_UNPAIRED_CLOSE),
        overlapped=c(raw, bm.C_OVERLAPPED),
        unpaired_send=c(raw, bm.C_UNPAIRED_SEND),
        unpaired_close=c(raw, bm.C_UNPAIRED_CLOSE),
        pipelined=c(raw, bm.C_PIPELINED),
        connections=c(raw, bm.C_CONNS),
        multiplexed_connections=c(raw, bm.C_MUX_CONNS),
        lost=c(raw, bm.C_LOST),
        untracked=c(raw, bm.C_UNTRACKED),
        no_ttft={reason: n for reason, what in bm.NO_TTFT_REASONS.items() if (n := c(raw, what))},
        interim=c(raw, bm.C_INTERIM),
        framed=c(raw, bm.C_FRAMED),
        adopted=c(raw, bm.C_ADOPTED),
    )
