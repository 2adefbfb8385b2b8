"""The latency program's map layouts (bpf/latency_*.c, bpf/include/lat_*.h and qos_*.h) and what the agent writes
into them.

Pure where it can be: the entries the tenant maps should hold are computed from config here and tested without BPF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from qosagent.hist import NBUCKETS, Histogram

# Histogram kinds and counters, as numbered in bpf/include/lat_state.h. A slot's rows are KINDS * slot + kind.
KIND_HEADERS = 0
KIND_RESPONSE = 1
KIND_TTFT = 2
KIND_ITL = 3
KINDS = 4  # LAT_KINDS

# Completed and answered requests are the response and headers histogram counts (no counters in the kernel).
C_STARTED = 1
C_EGRESS_UNREAD = 2  # sockops mode, slot 0 only: packets the egress learner's tail call could not hand on
C_UNPAIRED_SEND = 3
C_UNPAIRED_CLOSE = 4
C_PIPELINED = 5
C_CONNS = 6
C_MUX_CONNS = 7
C_OVERLAPPED = 8
C_LOST = 9
C_UNTRACKED = 10
C_NOTTFT_NOT_HTTP = 11
C_NOTTFT_LONG = 12
C_NOTTFT_NO_BODY = 13
C_NOTTFT_UNSEEN = 14
C_INTERIM = 15
C_FRAMED = 16
C_ADOPTED = 17  # of C_CONNS, connections open before their port was watched (qosagent/latency/adopt.py)

# Responses without a time to first token, by reason (the names status and the metrics' `reason` label use).
NO_TTFT_REASONS = {
    "not_http": C_NOTTFT_NOT_HTTP,
    "header_too_long": C_NOTTFT_LONG,
    "no_body": C_NOTTFT_NO_BODY,
    "unseen": C_NOTTFT_UNSEEN,
}

NCOUNTERS = 18  # LAT_NCOUNTERS
ROW_SIZE = 8 * (1 + NBUCKETS)  # struct lat_row: sum_ns, then a count per bucket
MIN_SLOTS = 64
# The run-queue rows past the slots' (LAT_RUNQ_ROW): the shared one (processes serving several tiers), then the tiers'.
RUNQ_SHARED = 0  # LAT_RUNQ_SHARED
NO_SLOT = 0xFFFF  # LAT_NO_SLOT: a connection whose tenant had no slot (tierless, as unmatched traffic's slot 0)
MIN_RUNQ_ROWS = 8


def slots_for(tenants: int) -> int:
    """LAT_SLOTS for a config with this many tenants: unmatched traffic's slot, the tenants', and as many again for
    tenants later reloads add (a removed tenant keeps its slot: its counts since start stay reported)."""
    need = 2 * (tenants + 1)
    n = MIN_SLOTS
    while n < need:
        n *= 2
    return n


def runq_rows_for(tiers: int) -> int:
    """LAT_RUNQ_ROWS for a config with this many tiers: the shared row, unmatched traffic's tier ("none"), the tiers',
    and as many again for tiers later reloads add (a tier keeps its row, and its waits since start stay reported)."""
    return max(MIN_RUNQ_ROWS, 2 * (tiers + 2))


@dataclass(frozen=True)
class Cumulative:
    """One slot's state since start, as the kernel holds it: a histogram per kind (KIND_*) and its counters (C_*, the
    CPUs summed; zeros left out)."""

    hist: tuple[Histogram, ...]
    counters: Mapping[int, int]

    def counter(self, what: int) -> int:
        return self.counters.get(what, 0)


ZERO = Cumulative((Histogram(),) * KINDS, {})


@dataclass(frozen=True)
class Changes:
    """One tick's read: the slots whose generation (lat_gen) moved, and only those."""

    tenants: Mapping[int, Cumulative]  # tenant id -> its state since start
    runq: Mapping[int, Histogram] | None  # run-queue row -> its waits since start, when the rows were read
    rows_read: int  # slots whose rows were read, the run-queue rows counted as one
def counters(data: bytes) -> dict[int, int]:
    """A slot's lat_counters value (struct lat_counts for each possible CPU, back to back), summed; zeros left out."""
    q = memoryview(data).cast("Q")
    return {what: v for what in range(NCOUNTERS) if (v := sum(q[what::NCOUNTERS]))}


class RowParser:
    """lat_hist rows (struct lat_row) into ({bucket: count}, sum), parsing only rows whose bytes changed since the
    last read: a row is 4.8 KB, and most rows of most ticks (idle tenants) are unchanged. A row read again is parsed
    over the span of buckets it used before when the bytes either side of that span are still zero (compared, not
    scanned): the kernel only adds, so a tenant's latencies mostly land in buckets it has used."""

    def __init__(self) -> None:
        # row -> (its bytes, counts, sum, the span of buckets first..end-1 outside which every count was zero)
        self._last: dict[int, tuple[bytes, dict[int, int], int, int, int]] = {}
        self.scanned = 0  # rows whose used span was looked for byte by byte (a first read, or a new bucket used)

    def parse(self, row: int, data: bytes) -> tuple[dict[int, int], int]:
        last = self._last.get(row)
        if last is not None:
            if last[0] == data:
                return last[1], last[2]
            lo, hi = 8 + 8 * last[3], 8 + 8 * last[4]
            if data[8:lo] == _ZERO_ROW[8:lo] and data[hi:] == _ZERO_ROW[hi:]:
                return self._keep(row, data, last[3], last[4])
        # Only the span between the first and last non-zero count (a tenant's latencies cluster in a few dozen of
        # the 608 buckets); stripping zero bytes finds it in C.
        body = data[8:]
        self.scanned += 1
        return self._keep(row, data, (len(body) - len(body.lstrip(b"\0"))) // 8, (len(body.rstrip(b"\0")) + 7) // 8)

    def _keep(self, row: int, data: bytes, first: int, end: int) -> tuple[dict[int, int], int]:
        q = memoryview(data).cast("Q")
        counts = {b: c for b, c in enumerate(q[1 + first:1 + end], first) if c}
        self._last[row] = (data, counts, q[0], first, end)
        return counts, q[0]


_ZERO_ROW = bytes(ROW_SIZE)


def histogram(row: int, data: bytes, parser: RowParser) -> Histogram:
    if data == _ZERO_ROW:
        return ZERO.hist[0]
    return Histogram(*parser.parse(row, data))
