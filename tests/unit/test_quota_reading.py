"""Quota's tick as the part (qosagent/quota/reading.py), from reads that hold only the slots whose generation moved:
idle tenants are not rebuilt, rates over the last second drain without a read, and every tenant is rebuilt when the
limits in force may have changed."""

from __future__ import annotations

from qosagent.config import parse
from qosagent.quota.datapath import Reading
from qosagent.quota.layout import QuotaLimit
from qosagent.quota.model import QuotaPart
from qosagent.quota.reading import Tenants, part
from qosagent.rowmap import RowMap
from qosagent.tenants import UNMATCHED_ID, TenantLimit, baseline, tenant_id, tenant_table

CFG = parse({"tenants": [{"name": f"t{i}", "tier": "silver", "match": {"ports": [18000 + i]},
                          "quota": {"rps": 100, "burst": 10}} for i in range(100)]}, "test")
TABLE = {tid: info for tid, info in tenant_table(CFG).items() if tid}
SPECS = baseline(CFG)
BUSY = tenant_id("t3")


def read(t: float, counts: dict[int, tuple[int, int, int, int]]) -> Reading:
    ns = int(t * 1e9)
    limits = {tid: QuotaLimit() for tid in TABLE}
    return Reading(ns, counts, {}, limits, {tid: (0, 0) for tid in counts}, ns, len(counts))


def test_only_tenants_that_moved_are_rebuilt_and_rates_drain_unread() -> None:
    view = Tenants()
    view.update(read(0.0, {tid: (0, 0, 0, 0) for tid in TABLE}), TABLE, SPECS, {}, {}, 1.0)  # the first read: all
    first = dict(view.tenants)
    assert len(first) == 100
    for i in range(1, 11):  # t3 admits 5 a tick for a second
        view.update(read(i / 10, {BUSY: (5 * i, 0, 0, 0)}), TABLE, SPECS, {}, {}, 1.0)
    assert view.tenants["t3"].admitted == 50 and view.tenants["t3"].admitted_rps == 50.0
    assert all(view.tenants[n] is first[n] for n in first if n != "t3")  # the idle ones: the same objects
    # t3 stops: nothing is read, its rate drains to 0 within a second and a step.
    for i in range(11, 24):
        view.update(read(i / 10, {}), TABLE, SPECS, {}, {}, 1.0)
    assert view.tenants["t3"].admitted == 50 and view.tenants["t3"].admitted_rps == 0.0
    # An override of one tenant may change what is in force: every tenant is worked out again, once; those that came
    # out the same are handed on as they were.
    before, version = dict(view.tenants), view.version
    view.update(read(2.4, {}), TABLE, SPECS, {"t7": TenantLimit(10, 1)}, {}, 1.0)
    assert view.tenants["t7"].limit == TenantLimit(10, 1) and view.version == version + 1
    assert view.tenants["t8"] is before["t8"]
    again = dict(view.tenants)
    view.update(read(2.5, {}), TABLE, SPECS, {"t7": TenantLimit(10, 1)}, {}, 1.0)
    assert view.tenants["t8"] is again["t8"]


def test_a_tick_at_rest_hands_on_the_last_part_and_copies_no_tenant() -> None:
    """Counted: with no slot read, no rate draining and the same stats, the part is the one made the tick before (no
    copy of the 100 tenants' rows); a tenant that moves, a count passed unchecked or the unmatched tenant's count
    each make a new one."""
    view = Tenants()
    view.update(read(0.0, {tid: (0, 0, 0, 0) for tid in TABLE}), TABLE, SPECS, {}, {}, 1.0)
    stats = {"unmatched": 0}

    def tick(t: float, counts: dict[int, tuple[int, int, int, int]], st: dict[str, int] = stats) -> QuotaPart:
        r = read(t, counts)
        r = Reading(r.ktime_ns, r.counts, st, r.limits, r.buckets, r.heartbeat_ns, r.rows_read)
        view.update(r, TABLE, SPECS, {}, {}, 1.0)
        return part(r, view, ("lo",), "/pins", (), ())

    first = tick(0.1, {})
    version = view.version
    for i in range(2, 30):
        assert tick(i / 10, {}) is first
    assert view.version == version
    busy = tick(3.0, {BUSY: (1, 0, 0, 0)})
    assert busy is not first and busy.tenants["t3"].admitted == 1 and busy.rows_read == 1
    # Its rate over the last second moves with time alone, until its window is empty: a part is handed on exactly
    # when it would be made equal.
    parts = [busy] + [tick(3.1 + i / 10, {}) for i in range(14)]
    assert all((b is a) == (b == a) for a, b in zip(parts, parts[1:]))
    assert any(b is not a for a, b in zip(parts[1:], parts[2:]))
    assert parts[-1].tenants["t3"].admitted_rps == 0.0 and parts[-1] is parts[-2]
    unchecked = tick(4.5, {}, {"unmatched": 2})
    assert unchecked is not parts[-1] and unchecked.unmatched_packets == 2
    assert tick(4.6, {}, {"unmatched": 2}) is unchecked
    unmatched = tick(4.7, {UNMATCHED_ID: (4, 0, 0, 0)}, {"unmatched": 2})
    assert unmatched is not unchecked and unmatched.unmatched_counts == (4, 0, 0, 0)


def test_a_tick_that_changes_one_tenant_copies_no_other_tenants_row() -> None:
    """Counted: the part holds the view's RowMap, not a copy of it: a tick that moves t3 puts t3's row alone into a
    new mapping (before, each such tick copied all 100 rows into the part), and the parts made before keep theirs. It
    is t3 every tick: with different tenants tick to tick the rows changed since the base add up (test_rowmap.py)."""
    view = Tenants()
    view.update(read(0.0, {tid: (0, 0, 0, 0) for tid in TABLE}), TABLE, SPECS, {}, {}, 1.0)
    parts = []
    for i in range(1, 6):
        before = RowMap.copied
        r = read(i / 10, {BUSY: (i, 0, 0, 0)})
        view.update(r, TABLE, SPECS, {}, {}, 1.0)
        parts.append(part(r, view, ("lo",), "/pins", (), ()))
        assert RowMap.copied - before == 1  # t3's row, nothing of the 99 others
    assert [p.tenants["t3"].admitted for p in parts] == [1, 2, 3, 4, 5]
    assert all(p.tenants["t7"] is parts[0].tenants["t7"] for p in parts) and len(parts[-1].tenants) == 100


def test_the_heartbeat_is_written_five_times_per_timeout_not_every_tick() -> None:
    from qosagent.capability import AgentContext
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.quota.capability import Quota, heartbeat_every

    now = [0.0]
    beats: list[float] = []

    class Datapath:
        def heartbeat(self) -> None:
            beats.append(now[0])

    cfg = parse({"quota": {"enabled": True, "heartbeat_timeout": "2500ms"}}, "test")
    q = Quota(AgentContext(config=cfg, hostfs=HostFS("/"), gpu=NoGpu("test"), clock=lambda: now[0]))
    q.datapath = Datapath()  # type: ignore[assignment]
    q._follow = lambda: None  # type: ignore[method-assign]  # the follow is test_quota_follow's
    for i in range(32):  # 4 s of ticks 125 ms apart
        now[0] = i / 8
        q.maintain()
    assert beats == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert heartbeat_every(5.0) == 1.0  # the default timeout: once a second


def test_the_same_overrides_again_work_out_no_limit() -> None:
    """Counted: admission in enforce mode hands quota its overrides every tick; the same ones again walk no slot
    (at 1,000 tenants that walk was every tenant's limit built and compared each tick), a change does."""
    from qosagent.quota.datapath import Datapath
    from qosagent.quota.rules import Bucket

    class Maps:
        overrides: dict[int, Bucket] = {}
        walks = 0
        _limits_whole = True

        def _write_limits(self) -> None:
            self.walks += 1

    d = Maps()
    cut = {BUSY: Bucket(20_000_000, 200_000_000)}
    for _ in range(5):
        Datapath.set_overrides(d, dict(cut))  # type: ignore[arg-type]
    assert d.walks == 1 and d.overrides == cut
    Datapath.set_overrides(d, {})  # type: ignore[arg-type]
    Datapath.set_overrides(d, {})  # type: ignore[arg-type]
    assert d.walks == 2 and d.overrides == {}


def test_overrides_whose_write_failed_partway_are_written_again_on_the_next_tick() -> None:
    """A quota_limits update that raises ends the walk with later slots unwritten: the same overrides on the next
    tick are not taken as written and every slot gets its override (before, slot 2 kept none for good)."""
    from qosagent.quota.datapath import Datapath
    from qosagent.quota.rules import Bucket

    class Limits:
        def __init__(self) -> None:
            self.kern = {1: bytes(QuotaLimit()), 2: bytes(QuotaLimit())}
            self.fail = True
            self.updates = 0

        def lookup(self, slot: int) -> QuotaLimit:
            return QuotaLimit.from_buffer_copy(self.kern[slot])

        def update(self, slot: int, value: bytes) -> None:
            if self.fail and slot == 2:
                self.fail = False
                raise OSError(12, "ENOMEM")
            self.updates += 1
            self.kern[slot] = value

    class Maps:
        _write_limits = Datapath._write_limits

        def __init__(self) -> None:
            self.maps = {"quota_limits": Limits()}
            self.slots = {101: 1, 102: 2}
            self.baseline: dict[int, tuple[None, None]] = {}
            self.overrides: dict[int, Bucket] = {}
            self.fleet: dict[int, tuple[Bucket, int]] = {}
            self._limits: dict[int, bytes] = {}
            self._written: dict[int, QuotaLimit] = {}
            self._limits_whole = True

    d = Maps()
    cut = {101: Bucket(10_000_000, 100_000_000), 102: Bucket(10_000_000, 100_000_000)}
    failed = 0
    for _ in range(3):
        try:
            Datapath.set_overrides(d, dict(cut))  # type: ignore[arg-type]
        except OSError:
            failed += 1
    kern = d.maps["quota_limits"]
    assert failed == 1 and kern.updates == 2  # slot 1 on the failing tick, slot 2 on the next; none on the third
    assert all(kern.lookup(s).override.interval_ns == 10_000_000 for s in (1, 2))
    assert set(d._written) == {101, 102}


def test_a_lease_ending_or_the_heartbeat_ageing_makes_a_new_part_on_that_tick() -> None:
    """What a tick at rest hands on must still change when time alone changes the limit in force: the fleet share's
    lease ends (t5 back to its baseline) and the heartbeat grows older than its timeout (t7's override no longer
    holds). Each makes a new part on the very tick it happens, not the one handed on."""
    view = Tenants()
    share = {"t5": (TenantLimit(50, 5), int(2.0e9))}  # t5's share until 2 s by the kernel's clock
    cut = {"t7": TenantLimit(10, 1)}

    def tick(t: float, heartbeat: float) -> QuotaPart:
        r = read(t, {})
        r = Reading(r.ktime_ns, {}, {}, r.limits, {}, int(heartbeat * 1e9), 0)
        view.update(r, TABLE, SPECS, cut, share, 1.0)
        return part(r, view, ("lo",), "/pins", (), ())

    view.update(read(0.0, {tid: (0, 0, 0, 0) for tid in TABLE}), TABLE, SPECS, cut, share, 1.0)
    first = tick(0.1, 0.1)
    assert first.tenants["t5"].limit == TenantLimit(50, 5) and first.tenants["t7"].limit == TenantLimit(10, 1)
    at_rest = [tick(0.1 + i / 10, 0.1 + i / 10) for i in range(1, 19)]  # the heartbeat kept fresh, to 1.9 s
    assert all(p is first for p in at_rest)
    ended = tick(2.0, 2.0)
    assert ended is not first and ended.tenants["t5"].limit == SPECS["t5"].requests
    assert ended.tenants["t7"].limit == TenantLimit(10, 1)
    assert tick(2.5, 2.0) is ended and tick(3.0, 2.0) is ended  # 1 s old: still fresh
    stale = tick(3.1, 2.0)
    assert stale is not ended and stale.tenants["t7"].limit == SPECS["t7"].requests
    assert tick(3.2, 2.0) is stale


def test_a_tick_at_rest_reads_no_stats_and_a_counted_packet_is_read_at_the_next_tick() -> None:
    """Counted: quota's tick asks the kernel for quota_stats (a BPF_MAP_LOOKUP_BATCH) only when a CPU's stats
    generation moved (quota_gen past the slots', which the classifier bumps after each count by reason), then once
    more; at rest it reads none and hands on the same dict. read(), for status and tests, always reads."""
    import struct

    from qosagent.ebpf.maps import GEN_SIZE, Generations
    from qosagent.quota import layout
    from qosagent.quota.datapath import Datapath

    cpus = 2
    gen_mem = bytearray((layout.SLOTS + layout.GEN_LINE * cpus) * GEN_SIZE)  # quota_gen, as the agent maps it
    per_cpu = {reason: [0] * cpus for reason in layout.STAT_REASONS}  # quota_stats, as the kernel holds it

    class Stats:
        reads = 0

        def data(self) -> bytes:
            self.reads += 1
            return b"".join(struct.pack(f"{cpus}Q", *per_cpu[reason]) for reason in layout.STAT_REASONS)

    def count(reason: str, cpu: int) -> None:  # what stat_inc does on that CPU: the count, then its generation
        per_cpu[reason][cpu] += 1
        at = (layout.SLOTS + layout.GEN_LINE * cpu) * GEN_SIZE
        struct.pack_into("Q", gen_mem, at, struct.unpack_from("Q", gen_mem, at)[0] + 1)

    d = Datapath.__new__(Datapath)
    d._gens = Generations.over(gen_mem, 0, 1)
    d._stat_gens = Generations.over(gen_mem, layout.SLOTS, layout.GEN_LINE * cpus, everything=True)
    d._stats_range = stats = Stats()  # type: ignore[assignment]
    d._stats_raw, d._stats = b"", {}
    d._written, d.heartbeat_ns, d._by_slot = {}, 0, {0: UNMATCHED_ID}
    d._count_words = 4 * cpus  # no slot moves here: no counters are read

    first = [d.read_changed() for _ in range(2)]  # every generation at the first read, and once more
    assert stats.reads == 2 and first[1].stats == dict.fromkeys(layout.STAT_REASONS, 0)
    rest = [d.read_changed() for _ in range(5)]
    assert stats.reads == 2 and all(r.stats is first[1].stats for r in rest)

    count("malformed", 1)
    counted = d.read_changed()
    assert stats.reads == 3 and counted.stats["malformed"] == 1
    d.read_changed()  # the tick after a move reads once more (a count seen after its generation)
    assert stats.reads == 4
    rest = [d.read_changed() for _ in range(5)]
    assert stats.reads == 4 and all(r.stats is counted.stats for r in rest)

    count("unmatched", 0)
    count("unmatched", 1)
    assert d.read_changed().stats["unmatched"] == 2 and stats.reads == 5
    assert d.stats(fresh=True)["unmatched"] == 2 and stats.reads == 6


def test_only_a_configured_tenants_row_moving_is_news_to_a_decision() -> None:
    """rows_moved and still (the capability's quiet): the unmatched tenant's counts and the packets counted by
    reason make a new part for metrics but move no decision's input; a tenant's count does, and its rate draining
    over the next second keeps it moving."""
    view = Tenants()
    stats = {"unmatched": 0}

    def tick(t: float, counts: dict[int, tuple[int, int, int, int]], st: dict[str, int] = stats) -> bool:
        r = read(t, counts)
        view.update(Reading(r.ktime_ns, r.counts, st, r.limits, r.buckets, r.heartbeat_ns, r.rows_read), TABLE,
                    SPECS, {}, {}, 1.0)
        return view.rows_moved or not view.still

    assert tick(0.0, {tid: (0, 0, 0, 0) for tid in TABLE})
    version = view.version
    assert not any(tick(i / 10, {UNMATCHED_ID: (i, 0, 0, 0)}, {"unmatched": i}) for i in range(1, 20))
    assert view.version > version  # a new part each of those ticks, for the unmatched tenant's counts
    assert tick(2.0, {BUSY: (1, 0, 0, 0)})
    moving = [tick(2.0 + i / 10, {}) for i in range(1, 16)]
    assert moving[0] and not moving[-1]
