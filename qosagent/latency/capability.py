"""Per-tenant request latency and run-queue latency, measured in the kernel by bpf/latency.c.

The kernel keeps cumulative per-CPU histograms and counters; each tick reads them in batches, sums the CPUs and
builds the LatencyPart: since-start histograms as read, window histograms as the difference to a checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from qosagent.capability import Capability, CapabilityError, State, Verdict
from qosagent.hist import Histogram
from qosagent.latency import bpfmaps as bm
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.latency.window import Window
from qosagent.tenants import UNMATCHED_ID, TenantInfo, tenant_entries, tenant_table

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.ebpf.tenant_ports import TenantPorts
    from qosagent.features import Features
    from qosagent.snapshot import Snapshot

log = logging.getLogger("qosagent.latency")

SOCKET_TRACEPOINTS = ("sock/sock_recv_length", "sock/sock_send_length")
RUNQ_TRACEPOINTS = ("sched/sched_wakeup", "sched/sched_wakeup_new", "sched/sched_switch")
KPROBES = (("tcp_recvmsg", "kp_tcp_enter", "kp_tcp_recvmsg_ret"), ("tcp_sendmsg", "kp_tcp_enter", "kp_tcp_sendmsg_ret"))
RUNQ_REFRESH_S = 1.0  # how often the threads of the serving processes are re-listed


class Latency(Capability):
    name = "latency"

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.mode = ""  # "tracepoint" or "kprobe"
        self.runq = False
        self.arrival = False  # request clocks start at arrival (sock:sk_data_ready), else at the first read
        self.bpf: Any = None
        self.programs: list[dict[str, Any]] = []
        self._known: dict[int, TenantInfo] = {}
        self._tenants: dict[int, TenantInfo] = {}  # the config's tenants, as of the last start or reload
        self._window: Window[bm.Raw] | None = None
        self._runq_next = 0.0
        self._ports: "TenantPorts | None" = None  # tenant_ports as written

    # ---- probe and start ---------------------------------------------------------------------------------
    def probe(self, features: "Features") -> Verdict:
        if not features.has_tracepoint("sock/inet_sock_set_state"):
            return Verdict(State.UNAVAILABLE, "no sock:inet_sock_set_state tracepoint (kernel < 4.16)")
        if all(features.has_tracepoint(tp) for tp in SOCKET_TRACEPOINTS):
            self.mode = "tracepoint"
        elif features.kprobes:
            self.mode = "kprobe"
        else:
            return Verdict(State.UNAVAILABLE, "no sock:sock_recv_length/sock_send_length tracepoints (kernel < 6.4) "
                                              "and no kprobes for the tcp_recvmsg/tcp_sendmsg fallback")
        notes = []
        if self.mode == "kprobe":
            notes.append("kprobe fallback on tcp_recvmsg/tcp_sendmsg")
        self.arrival = features.has_tracepoint("sock/sk_data_ready")
        if not self.arrival:
            notes.append("no sock:sk_data_ready (kernel < 6.6): requests timed from their first read, not arrival")
        cfg = self.ctx.config.latency
        self.runq = cfg.runqueue.enabled and all(features.has_tracepoint(tp) for tp in RUNQ_TRACEPOINTS)
        if cfg.runqueue.enabled and not self.runq:
            return Verdict(State.DEGRADED, "; ".join(notes + ["run-queue latency off: sched tracepoints missing"]))
        return Verdict(State.ACTIVE, "; ".join(notes))

    def start(self) -> None:
        from qosagent.ebpf.loader import BpfError, compile_program

        defines = {}
        if self.runq:
            defines["QOS_RUNQ"] = 1
        if self.mode == "kprobe":
            defines["QOS_KPROBE"] = 1
        if self.arrival:
            defines["QOS_ARRIVAL"] = 1
        defines["LAT_SOCK_BUCKETS_LOG2"] = (self.ctx.config.latency.socket_slots // 4).bit_length() - 1
        defines.update(_flows_defines(self.ctx.config))
        try:
            self.bpf = compile_program("latency", defines)
            if self.mode == "kprobe":
                for fn, entry, ret in KPROBES:
                    self.bpf.attach_kprobe(event=fn.encode(), fn_name=entry.encode())
                    self.bpf.attach_kretprobe(event=fn.encode(), fn_name=ret.encode())
        except BpfError as e:
            raise CapabilityError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception when attaching
            raise CapabilityError(f"attaching the latency probes failed: {e}") from None
        from bcc.utils import get_possible_cpus

        ncpus = len(get_possible_cpus())
        self._hist_reader = self._reader(b"lat_hist", bm.HIST_KEY.size,
                                         bm.per_cpu_value_size(bm.HIST_VALUE.size, ncpus))
        self._counter_reader = self._reader(b"lat_counters", bm.COUNTER_KEY.size,
                                            bm.per_cpu_value_size(bm.COUNTER_VALUE.size, ncpus))
        from qosagent.ebpf.tenant_ports import TenantPorts

        self._ports = TenantPorts(self.bpf[b"tenant_ports"].map_fd)  # a fresh map: all zero
        self._fill_maps(self.ctx.config)
        self.programs = self._program_ids()
        self._window = Window(self.ctx.config.latency.window)
        log.info("latency probes attached (%s mode, %d programs, clock from %s, run-queue %s) on ports %s",
                 self.mode, self.attached(), "arrival" if self.arrival else "first read",
                 "on" if self.runq else "off", bm.watched(self.ctx.config))

    def _reader(self, table: bytes, key_size: int, value_size: int) -> Any:
        from qosagent.ebpf.batch import BatchReader

        return BatchReader(self.bpf[table].map_fd, key_size, value_size)

    def attached(self) -> int:
        if self.bpf is None:
            return 0
        return len(self.bpf.tracepoint_fds) + len(self.bpf.raw_tracepoint_fds) + len(self.bpf.kprobe_fds)

    def _program_ids(self) -> list[dict[str, Any]]:
        """Kernel ids of our loaded programs (what `bpftool prog show id N` finds), for status and the stop test."""
        out = []
        for name, fn in sorted(self.bpf.funcs.items()):
            info = self.ctx.hostfs.try_read(f"/proc/self/fdinfo/{fn.fd}") or ""
            for line in info.splitlines():
                if line.startswith("prog_id:"):
                    out.append({"name": name.decode() if isinstance(name, bytes) else name,
                                "id": int(line.split()[1])})
        return out

    # ---- maps from config --------------------------------------------------------------------------------
    def _fill_maps(self, cfg: "Config") -> None:
        """Make the tenant and port maps say what cfg says, in place: entries added, changed, removed."""
        try:
            table = tenant_table(cfg)
        except ValueError as e:
            raise CapabilityError(str(e)) from None
        ports, cidrs = tenant_entries(cfg)
        b = self.bpf
        self._sync(b[b"watched_ports"], {(p,): 1 for p in bm.watched(cfg)},
                   lambda t, k: t.Key(port=k[0]), lambda t, v: t.Leaf(on=v))
        self._sync(b[b"lat_mux_ports"], {(p,): 1 for p in cfg.latency.multiplexed_ports},
                   lambda t, k: t.Key(port=k[0]), lambda t, v: t.Leaf(on=v))
        assert self._ports is not None
        self._ports.sync({p: (tid, 0) for p, tid in ports.items()})
        self._sync(b[b"tenant_cidrs"], {(c.prefixlen, c.port, c.addr): c.tenant for c in cidrs},
                   self._cidr_key, lambda t, v: t.Leaf(tenant=v))
        self._known.update(table)
        self._tenants = table

    @staticmethod
    def _cidr_key(t: Any, k: tuple[int, int, bytes]) -> Any:
        key = t.Key()
        key.prefixlen = k[0]
        key.port = int.from_bytes(k[1].to_bytes(2, "big"), "little")  # the trie wants the port in network order
        for i, byte in enumerate(k[2]):
            key.addr[i] = byte
        return key

    @staticmethod
    def _sync(tbl: Any, want: dict[tuple[Any, ...], int], make_key: Any, make_leaf: Any) -> None:
        have = list(tbl.keys())
        wanted_keys = {}
        for k, v in want.items():
            key = make_key(tbl, k)
            tbl[key] = make_leaf(tbl, v)
            wanted_keys[bytes(key)] = key
        for k in have:
            if bytes(k) not in wanted_keys:
                del tbl[k]

    def reload(self, config: "Config") -> None:
        if self.bpf is None:
            return
        try:
            self._fill_maps(config)
        except CapabilityError:
            raise
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception on map writes
            raise CapabilityError(f"updating the tenant maps failed part-way ({e}); reload again to retry") from None
        if config.latency.window != self.ctx.config.latency.window:
            self._window = Window(config.latency.window)

    # ---- each tick ---------------------------------------------------------------------------------------
    def read_raw(self) -> bm.Raw:
        return bm.assemble(self._hist_reader.chunks(), self._counter_reader.chunks())

    def collect(self) -> LatencyPart:
        now = self.ctx.clock()
        raw = self.read_raw()
        assert self._window is not None
        base_t, base = self._window.push(now, raw)
        elapsed = now - base_t
        if self.runq and now >= self._runq_next:
            self._runq_next = now + RUNQ_REFRESH_S
            self._refresh_runq_threads()
        cfg = self.ctx.config
        current = self._tenants
        # Configured tenants, and any a reload removed that still have counts since start.
        ids = set(current) | {t for (t, _kind) in raw.hist} | {t for (t, _what) in raw.counters}
        tenants = {}
        for tid in sorted(ids):
            info = current.get(tid) or self._known.get(tid) or TenantInfo(tid, f"id-{tid}", "none", 0, 0.0)
            tenants[info.name] = self._tenant(info, raw, base, elapsed)
        return LatencyPart(
            window_s=cfg.latency.window,
            tenants=tenants,
            runqueue=self._hist(raw, UNMATCHED_ID, bm.KIND_RUNQ) if self.runq else None,
            runqueue_window=(self._hist(raw, UNMATCHED_ID, bm.KIND_RUNQ) - self._hist(base, UNMATCHED_ID, bm.KIND_RUNQ))
            if self.runq else None,
        )

    @staticmethod
    def _hist(raw: bm.Raw, tid: int, kind: int) -> Histogram:
        return Histogram(dict(raw.hist.get((tid, kind), {})), raw.sums.get((tid, kind), 0))

    def _tenant(self, info: TenantInfo, raw: bm.Raw, base: bm.Raw, elapsed: float) -> TenantLatency:
        tid = info.id

        def c(r: bm.Raw, what: int) -> int:
            return r.counters.get((tid, what), 0)

        ttfb = self._hist(raw, tid, bm.KIND_TTFB)
        resp = self._hist(raw, tid, bm.KIND_RESPONSE)
        resp_window = resp - self._hist(base, tid, bm.KIND_RESPONSE)
        return TenantLatency(
            tenant=info.name,
            tier=info.tier,
            requests=resp.count,
            ttfb=ttfb,
            response=resp,
            ttfb_window=ttfb - self._hist(base, tid, bm.KIND_TTFB),
            response_window=resp_window,
            rate_rps=resp_window.count / elapsed if elapsed > 0 else 0.0,
            in_flight=max(c(raw, bm.C_STARTED) - ttfb.count - c(raw, bm.C_UNPAIRED_CLOSE), 0),
            unpaired=c(raw, bm.C_UNPAIRED_SEND) + c(raw, bm.C_UNPAIRED_CLOSE),
            overlapped=c(raw, bm.C_OVERLAPPED),
            unpaired_send=c(raw, bm.C_UNPAIRED_SEND),
            unpaired_close=c(raw, bm.C_UNPAIRED_CLOSE),
            extra_reads=c(raw, bm.C_EXTRA_READS),
            connections=c(raw, bm.C_CONNS),
            multiplexed_connections=c(raw, bm.C_MUX_CONNS),
            lost=c(raw, bm.C_LOST),
            untracked=c(raw, bm.C_UNTRACKED),
        )

    def _refresh_runq_threads(self) -> None:
        """Expand the processes seen serving watched sockets into their threads (the sched tracepoints name threads);
        forget processes that are gone and threads that ended."""
        b = self.bpf
        tgids, pids = b[b"runq_tgids"], b[b"runq_pids"]
        want: set[int] = set()
        for k in list(tgids.keys()):
            tasks = self.ctx.hostfs.listdir(f"/proc/{k.pid}/task")
            if not tasks:
                del tgids[k]
                continue
            want.update(int(t) for t in tasks if t.isdigit())
        have = set()
        for k in list(pids.keys()):
            if k.pid in want:
                have.add(k.pid)
            else:
                del pids[k]
        for tid in want - have:  # new threads only: an existing entry may hold a live wake-up time
            pids[pids.Key(pid=tid)] = pids.Leaf(v=0)

    def stop(self) -> None:
        if self.bpf is None:
            return
        self.bpf.cleanup()
        self.bpf = None
        log.info("latency probes detached")

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: "Snapshot") -> Iterable["Metric"]:
        from qosagent.latency import export

        part = snapshot.part(self.name)
        yield from export.families(part, self.attached())

    def status(self, snapshot: "Snapshot") -> dict[str, Any]:
        from qosagent.latency import export

        part = snapshot.part(self.name)
        slo = {info.name: info.slo_p99 for info in self._tenants.values()}
        out = export.status(part, slo)
        out["mode"] = self.mode
        out["programs"] = self.programs
        return out

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        from qosagent.latency import export

        return export.render(status)



def _flows_defines(cfg: "Config") -> dict[str, object]:
    """Attribute header-matched tenants through the quota classifier's pinned flow map (quota starts first)."""
    if not (cfg.quota.enabled and any(t.match.header for t in cfg.tenants)):
        return {}
    from qosagent.quota.datapath import pin_dir

    return {"QOS_FLOWS_PIN": f'"{pin_dir(cfg)}/tenant_flows"', "QOS_FLOWS": cfg.quota.flow_entries}
