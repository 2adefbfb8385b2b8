"""The loaded latency program (bpf/latency_*.c) and its maps: compiled for a probe's plan, its tenant and port maps
written from a MapsPlan, its histogram and counter rows read each tick.

The hooks that need a cgroup (cgroupwatch.py, links.py, adopt.py) are the capability's to wire; this is the program
they are loaded from.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from qosagent.capability import CapabilityError
from qosagent.ebpf import mapsize, pinned
from qosagent.ebpf.loader import BpfError
from qosagent.ebpf.maps import GEN_SIZE, RUN_SLOTS, ArrayRange, Generations, Map, runs, sync
from qosagent.ebpf.pins import tenant_flows
from qosagent.ebpf.tenant_ports import PORTS, TenantPorts, sync_cidrs
from qosagent.latency import bpfmaps as bm
from qosagent.latency import slots
from qosagent.latency.model import Plan
from qosagent.latency.slots import MapsPlan

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.hostfs import HostFS

RUN = "lat_run"  # sockops mode: the agent run that socket storage belongs to (bpf/latency_sockops.c)
# The kprobe fallback (< 6.4): kernel function -> program, at entry only (bpf/latency_trace.c says why no kretprobes).
KPROBES = (("tcp_cleanup_rbuf", "kp_tcp_read"), ("tcp_sendmsg", "kp_tcp_sendmsg"))
# The kprobe fallback's arrival clock, where there is no sock:sk_data_ready tracepoint (< 6.6): the function the
# tracepoint was put in, TCP's data-ready callback.
KPROBE_ARRIVAL = ("sock_def_readable", "kp_data_ready")


class Datapath:
    """One loaded program: what its tenant maps say (`slots`: tenant id -> row) and how a tick reads its rows."""

    def __init__(self, prog: pinned.Program, nslots: int, nrows: int):
        self.prog = prog
        self.nslots = nslots  # LAT_SLOTS of the loaded program
        self.nrows = nrows  # LAT_RUNQ_ROWS of the loaded program; 0 without the run-queue probes
        self.runq = nrows > 0
        self.slots: dict[int, int] = {}  # tenant id -> its slot (row) in the kernel's arrays; 0 is unmatched
        self.runq_rows: dict[str, int] = {}  # tier -> its run-queue row (bpfmaps.RUNQ_SHARED: the shared one)
        self.slot_rows: dict[int, int] = {}  # slot -> the run-queue row of its tenant's tier, as lat_slot_tier says
        self._rows = bm.RowParser()
        self._ports = TenantPorts(prog.map("tenant_ports").fd)  # a fresh map: all zero
        hist, counters = prog.map("lat_hist"), prog.map("lat_counters")
        self._hist_fd, self._counters_fd, self._gen_fd = hist.fd, counters.fd, prog.map("lat_gen").fd
        # A per-CPU value is one copy per possible CPU, as bcc's table type for it has it: the kernel writes that
        # many, so the buffer must hold them.
        self._counters_size = ctypes.sizeof(counters.value)
        self._by_slot: dict[int, int] = {}  # slot -> tenant id, and the generations each tick reads (_plan_reads)
        self._gens: Generations | None = None
        self._runq_gen: Generations | None = None
        self._runq_read: ArrayRange | None = None  # the run-queue rows in use, from the shared one up
        # The buffers each tick's runs of moved slots are read in, up to RUN_SLOTS slots a run (a longer one, as the
        # first read's, has buffers of its own for that read).
        self._run_rows = ArrayRange(self._hist_fd, 0, bm.KINDS * RUN_SLOTS, bm.ROW_SIZE)
        self._run_counts = ArrayRange(self._counters_fd, 0, RUN_SLOTS, self._counters_size)

    @staticmethod
    def begin(cfg: "Config", plan: Plan) -> None:
        """Begin the build load() will open, in a compile child beside what starts before latency, unless it reads
        quota's flow map, which quota's start makes."""
        if _flows_pin(cfg) is None:
            pinned.begin(build(cfg, plan), cfg.bpf.pin_root)

    @classmethod
    def load(cls, cfg: "Config", plan: Plan, fs: "HostFS") -> "Datapath":
        """Build the program for plan, sized for cfg's tenants, in a compile child, and attach its tracepoints (and
        kprobes, kprobe mode). CapabilityError, with nothing left loaded, where that fails."""
        nslots = bm.slots_for(len(cfg.tenants))
        wanted = build(cfg, plan)
        try:
            prog = pinned.load(wanted, cfg.bpf.pin_root)
        except BpfError as e:
            raise CapabilityError(str(e)) from None
        try:
            if prog.reused:
                # An earlier agent's maps hold its sockets, rows and settings: emptied, the build is as new.
                prog.reset(keep=(RUN, *wanted.shared))
            if prog.has_map(RUN):
                run = prog.map(RUN)
                cur = run.lookup(0)
                cur.run = (cur.run + 1) & 0xFFFFFFFF
                run.update(0, cur)
            prog.attach(fs)
        except (BpfError, OSError) as e:
            prog.close()
            raise CapabilityError(f"attaching the latency probes failed: {e}") from None
        return cls(prog, nslots, runq_rows(cfg, plan) if plan.runq else 0)

    def map(self, name: str) -> "Map":
        return self.prog.map(name)

    # ---- the tenant and port maps ------------------------------------------------------------------------
    def plan(self, cfg: "Config") -> MapsPlan:
        """What cfg makes of the tenant and port maps, keeping the slots tenants have; writes nothing."""
        try:
            return slots.plan(cfg, self.slots, self.nslots, self.runq_rows, self.nrows)
        except ValueError as e:
            raise CapabilityError(str(e)) from None

    def write(self, m: MapsPlan) -> None:
        """Make the tenant and port maps say what m says, in place: entries added, changed, removed."""
        # The slots' tiers around the maps that resolve a connection's slot: an added or moved tenant's slot has its
        # tier's row before lat_slots gives the slot out (or more connections are noted with it), and a removed
        # tenant's slot keeps its row until lat_slots no longer resolves to it (its tenant then has no slot: tierless,
        # lat_state.h), so a process serving it and another tenant of its tier is not taken for one serving several
        # tiers meanwhile. What is left between the writes is docs/latency.md's ("Run-queue latency").
        tiers = self.map("lat_slot_tier")
        old = self.slot_rows
        for slot, row in sorted(m.slot_rows.items()):
            if row != old.get(slot, bm.RUNQ_SHARED):
                tiers.update(slot, tiers.value(row=row))
        self.slot_rows, self.runq_rows = dict(m.slot_rows), dict(m.runq_rows)
        lat_slots = self.map("lat_slots")
        sync(lat_slots, ((lat_slots.key(tenant=tid), lat_slots.value(slot=slot)) for tid, slot in m.slots.items()))
        self.slots = dict(m.slots)
        self._plan_reads()
        for name, want in (("tracked_ports", m.tracked), ("lat_mux_ports", m.mux)):
            ports = self.map(name)
            sync(ports, ((ports.key(port=p), ports.value(on=1)) for p in want))
        self._ports.sync({p: (tid, 0) for p, tid in m.ports.items()})
        sync_cidrs(self.map("tenant_cidrs"), m.cidrs)
        for slot in sorted(set(old) - set(m.slot_rows)):
            if old[slot] != bm.RUNQ_SHARED:
                tiers.update(slot, tiers.value(row=bm.RUNQ_SHARED))

    # ---- each tick ---------------------------------------------------------------------------------------
    def read(self) -> bm.Changes:
        """The state of each slot whose generation moved (lat_gen: qos_common.h): an idle tenant costs its 8 bytes of
        lat_gen and nothing else. The first read finds every slot the kernel ever touched."""
        assert self._gens is not None
        slots = self._gens.changed() & self._by_slot.keys()
        tenants = {}
        for first, count in runs(slots):
            rows = self._run_rows.at(bm.KINDS * first, bm.KINDS * count)
            counts = self._run_counts.at(first, count)
            for i in range(count):
                hist = tuple(bm.histogram(bm.KINDS * (first + i) + k, rows[off:off + bm.ROW_SIZE], self._rows)
                             for k in range(bm.KINDS) for off in ((bm.KINDS * i + k) * bm.ROW_SIZE,))
                c = counts[i * self._counters_size:(i + 1) * self._counters_size]
                tenants[self._by_slot[first + i]] = bm.Cumulative(hist, bm.counters(c))
        runq = None
        if self._runq_gen is not None and self._runq_read is not None and self._runq_gen.changed():
            data, first = self._runq_read.data(), bm.KINDS * self.nslots
            rows = (bm.histogram(first + r, data[r * bm.ROW_SIZE:(r + 1) * bm.ROW_SIZE], self._rows)
                    for r in range(self._runq_read.count))
            runq = {r: h for r, h in enumerate(rows) if h.count}  # rows never observed are left out
        return bm.Changes(tenants, runq, len(slots) + (runq is not None))

    def counted(self) -> int:
        """Connections tracked and requests started on the tracked ports, every slot's, read whole (once, where the
        hooks are verified by traffic; each tick then counts from what it read)."""
        assert self._gens is not None
        data, size = ArrayRange(self._counters_fd, 0, self._gens.count, self._counters_size).data(), self._counters_size
        return sum(c.get(bm.C_CONNS, 0) + c.get(bm.C_STARTED, 0)
                   for c in (bm.counters(data[i:i + size]) for i in range(0, len(data), size)))

    def egress_unread(self) -> int:
        """Packets the egress learner could not tail-call lat_egress for (slot 0's LAT_C_EGRESS_UNREAD), read
        whole: for the self-test, where the ticks' reads have not begun."""
        return bm.counters(ArrayRange(self._counters_fd, 0, 1, self._counters_size).data()).get(bm.C_EGRESS_UNREAD, 0)

    def _plan_reads(self) -> None:
        """The generations and rows each tick reads, worked out when the slots change (start, reload) rather than
        every tick: the generations of the slots in use, which are numbered from 0 up, and the run-queue rows' one;
        the run-queue rows in use, past every slot's, also numbered from 0 (the shared row) up."""
        self._by_slot = {slot: tid for tid, slot in self.slots.items()}
        used = max(self._by_slot) + 1
        if self._gens is None:
            self._gens = Generations(self._gen_fd, 0, used)
            self._runq_gen = Generations(self._gen_fd, self.nslots, 1) if self.runq else None
        self._gens.resize(used)
        rows = max(self.runq_rows.values(), default=bm.RUNQ_SHARED) + 1
        if self.runq and (self._runq_read is None or self._runq_read.count != rows):
            self._runq_read = ArrayRange(self._hist_fd, bm.KINDS * self.nslots, rows, bm.ROW_SIZE)

    # ---- its programs ------------------------------------------------------------------------------------
    def attached(self) -> int:
        """Tracepoints and kprobes attached (the cgroup hooks are counted by their owners)."""
        return len(self.prog.attached)

    def traced(self) -> list[str]:
        """The programs on every socket's path that attach by tracepoint or kprobe; the run-queue probes are left
        out: a wakeup of a new task needs a fork, which one connection does not make."""
        return [k for k in self.prog.attached if not k.startswith("tracepoint__sched__")]

    def fds(self, names: list[str]) -> dict[str, int]:
        return {n: self.prog.fd(n) for n in names}

    def program_ids(self, fs: "HostFS") -> list[dict[str, Any]]:
        """Kernel ids of the loaded programs (what `bpftool prog show id N` finds), for status and the stop test."""
        out = []
        for name in self.prog.programs:
            info = fs.try_read(f"/proc/self/fdinfo/{self.prog.fd(name)}") or ""
            for line in info.splitlines():
                if line.startswith("prog_id:"):
                    out.append({"name": name, "id": int(line.split()[1])})
        return out

    def close(self) -> None:
        for gens in (self._gens, self._runq_gen):
            if gens is not None:
                gens.close()
        self.prog.close()


LAT_SOCK = 72  # sizeof(struct lat_sock), bpf/include/lat_state.h; 112 with the flow key of QOS_FLOWS_PIN


def map_sizes(cfg: "Config", plan: Plan) -> list[mapsize.MapSize]:
    """The program's maps as `qosagent check` counts them (qosagent/ebpf/mapsize.py); what grows per entry (the
    LPM trie, the entries of maps made BPF_F_NO_PREALLOC, socket storage) is what traffic puts in them."""
    M = mapsize.MapSize
    nslots = bm.slots_for(len(cfg.tenants))
    out = [M("tenant_ports", mapsize.ARRAY, PORTS, 4, 8),
           M("lat_hist", mapsize.ARRAY, bm.KINDS * nslots + runq_rows(cfg, plan), 4, bm.ROW_SIZE),
           M("lat_counters", mapsize.PERCPU_ARRAY, nslots, 4, 8 * bm.NCOUNTERS),
           M("lat_gen", mapsize.ARRAY, nslots + 1, 4, GEN_SIZE),
           M("lat_slots", mapsize.HASH, nslots, 4, 4), M("lat_slot_tier", mapsize.ARRAY, nslots, 4, 4),
           M("lat_netns", mapsize.HASH, 4096, 20, 4),
           M("tracked_ports", mapsize.HASH, 1024, 4, 4), M("lat_mux_ports", mapsize.HASH, 1024, 4, 4),
           M("runq_tgids", mapsize.HASH, 1024, 4, 8),
           M("runq_pids", mapsize.HASH, 65536, 4, 16) if plan.runq else None,
           M("lat_adopt", mapsize.BUCKETS, 65536, 36, 1), M("lat_fresh", mapsize.BUCKETS, 8192, 36, 1),
           M("lat_cgroups", mapsize.HASH, 1024, 8, 1) if plan.mode == "sockops" else None]
    if plan.mode != "sockops":
        socks = cfg.latency.socket_slots
        out += [M("lat_socks", mapsize.ARRAY, socks, 4, LAT_SOCK + (40 if _flows_pin(cfg) else 0)),
                M("lat_sock_tags", mapsize.ARRAY, socks // 4, 4, 32)]
        if plan.egress:  # the responses' flows back to their sockets (bpf/include/lat_socktable.h)
            out.append(M("lat_flows", mapsize.BUCKETS, socks, 36, 8))
    return [m for m in out if m is not None]


def build(cfg: "Config", plan: Plan) -> pinned.Spec:
    """The build of plan's program for cfg: its sources and compile-time settings."""
    defines: dict[str, object] = {}
    if plan.mode != "sockops":
        if plan.mode == "kprobe":
            defines["QOS_KPROBE"] = 1
        if plan.arrival:
            defines["QOS_ARRIVAL"] = 1
        if plan.egress:
            defines["QOS_EGRESS"] = 1
        defines["LAT_SOCK_BUCKETS_LOG2"] = (cfg.latency.socket_slots // 4).bit_length() - 1
    defines["LAT_SLOTS"] = bm.slots_for(len(cfg.tenants))
    defines["LAT_RUNQ_ROWS"] = runq_rows(cfg, plan)
    defines.update(_flows_defines(cfg))
    return spec(plan, defines, _flows_pin(cfg))


def spec(plan: Plan, defines: dict[str, object], flows_pin: str | None = None) -> pinned.Spec:
    """The build of plan's program: its sources, and the programs its mode links (the tracepoint functions BCC
    finds itself); kept for the next agent, and reused only while quota's flow map it reads (flows_pin) is still
    the one pinned there."""
    cgroup_skb = {"sockops": ("lat_ingress", "lat_ingress_learn", "lat_egress", "lat_egress_framing",
                              "lat_egress_learn")}.get(plan.mode, ("lat_egress", "lat_egress_framing",
                                                                   "lat_adopt_ingress") if plan.egress else ())
    programs = dict.fromkeys(cgroup_skb, pinned.CGROUP_SKB)
    kprobes: dict[str, str] = {}
    if plan.mode == "sockops":
        programs["lat_sockops"] = pinned.SOCK_OPS
    elif plan.mode == "kprobe":
        for fn, prog in KPROBES + ((KPROBE_ARRIVAL,) if plan.arrival else ()):
            programs[prog] = pinned.KPROBE
            kprobes[prog] = fn
    shared = {"tenant_flows": flows_pin} if flows_pin else {}
    return pinned.Spec("latency", tuple(sources(plan)), defines, programs, kprobes, shared)


def sources(plan: Plan) -> list[str]:
    """The entry files (bpf/<name>.c) of plan's program, one per attach point: the mode's socket hooks, its cgroup_skb
    programs where they are separate, and the run-queue probes."""
    if plan.mode == "sockops":
        out = ["latency_sockops"]
    else:
        out = ["latency_trace"] + (["latency_trace_skb"] if plan.egress else [])
    return out + (["latency_runq"] if plan.runq else [])


def runq_rows(cfg: "Config", plan: Plan) -> int:
    """LAT_RUNQ_ROWS of plan's program for cfg: room for its tiers and more (bpfmaps.runq_rows_for), or the shared
    row alone, never written, without the run-queue probes."""
    return bm.runq_rows_for(len(cfg.tiers)) if plan.runq else 1


def _flows_pin(cfg: "Config") -> str | None:
    """quota's flow map, where header-matched tenants are attributed through it (quota starts first)."""
    if not (cfg.quota.enabled and any(t.match.header for t in cfg.tenants)):
        return None
    return tenant_flows(cfg.bpf.pin_root)


def _flows_defines(cfg: "Config") -> dict[str, object]:
    pin = _flows_pin(cfg)
    return {"QOS_FLOWS_PIN": f'"{pin}"', "QOS_FLOWS": cfg.quota.flow_entries} if pin else {}
