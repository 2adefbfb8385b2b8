"""Per-tenant request latency and run-queue latency, measured in the kernel by bpf/latency.c.

The kernel keeps cumulative histograms (shared by all CPUs) and counters (per CPU) in rows per tenant slot; each
tick reads the rows of the slots in use, sums the counters' CPUs and builds the LatencyPart: since-start histograms
as read, window histograms as the difference to a checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import posixpath
import threading
from typing import TYPE_CHECKING, Any, Iterable

from qosagent.capability import UNCHANGED, Capability, CapabilityError, Change, State, Verdict, rewrite
from qosagent.hist import Histogram, Since
from qosagent.latency import bpfmaps as bm
from qosagent.latency import selftest, slots
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.latency.slots import MapsPlan
from qosagent.latency.window import Window
from qosagent.schedule import Every
from qosagent.tenants import UNMATCHED_ID, TenantInfo

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.ebpf.tenant_ports import TenantPorts
    from qosagent.features import Features
    from qosagent.snapshot import Snapshot

log = logging.getLogger("qosagent.latency")

SOCKET_TRACEPOINTS = ("sock/sock_recv_length", "sock/sock_send_length")
RUNQ_TRACEPOINTS = ("sched/sched_wakeup", "sched/sched_wakeup_new", "sched/sched_switch")
# The kprobe fallback (< 6.4): kernel function -> program, at entry only (bpf/latency.c says why no kretprobes).
KPROBES = (("tcp_cleanup_rbuf", "kp_tcp_read"), ("tcp_sendmsg", "kp_tcp_sendmsg"))
# The kprobe fallback's arrival clock, where there is no sock:sk_data_ready tracepoint (< 6.6): the function the
# tracepoint was put in, TCP's data-ready callback.
KPROBE_ARRIVAL = ("sock_def_readable", "kp_data_ready")
RUNQ_REFRESH_S = 1.0  # how often the threads of the serving processes are re-listed
CGROUP_EVENT_POLL_MS = 200  # how long the cgroup watcher blocks on the ring buffer before checking for stop
# How long after start lat_ingress_learn stays linked on the cgroup2 root: servers already running when the agent
# starts are found by their first request's arrival (and it is timed) rather than by their first response.
LEARN_S = 30.0
# How often, while connections found open are not observed, they are listed again to forget those that closed: a
# listing reads every established socket of the host (sock_diag), which costs on hosts with many.
ADOPT_RELIST_S = 5.0
_EMPTY: dict[int, int] = {}


class Latency(Capability):
    name = "latency"

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.mode = ""  # "sockops", "tracepoint" or "kprobe"
        self.runq = False
        self.arrival = False  # request clocks start at arrival (sock:sk_data_ready), else at the first read
        self.egress = False  # responses are read as they leave (TTFT, inter-token): a cgroup_skb egress program
        self._egress_error = "no cgroup v2 hierarchy for the egress program"  # why not, when not
        self._egress_lost = False  # probe promised it, start could not attach it
        self.bpf: Any = None
        self.programs: list[dict[str, Any]] = []
        self._known: dict[int, TenantInfo] = {}
        self._tenants: dict[int, TenantInfo] = {}  # the config's tenants, as of the last start or reload
        self._maps: MapsPlan | None = None  # what the tenant and port maps say (the last start or reload)
        self._window: Window[bm.Raw] | None = None
        # Re-listing the serving processes' threads (run-queue) and pruning the links of cgroups gone (sockops).
        self._refresh = Every(RUNQ_REFRESH_S)
        self._ports: "TenantPorts | None" = None  # tenant_ports as written
        self._nslots = 0  # LAT_SLOTS of the loaded program
        self._slots: dict[int, int] = {}  # tenant id -> its slot (row) in the kernel's arrays; 0 is unmatched
        self._rows = bm.RowParser()
        self._hist_fd = self._counters_fd = -1
        self._counters_size = 0  # lat_counters' value: struct lat_counts per possible CPU
        self._by_slot: dict[int, int] = {}  # slot -> tenant id, and the ranges each tick reads (_plan_reads)
        self._reads: tuple[Any, Any, Any] | None = None
        # sockops mode: the sock_ops program's link on the cgroup2 root, the ingress program's links on the serving
        # cgroups, and the thread that attaches the latter as the kernel reports them.
        self._sockops_link: Any = None
        self._learn_link: Any = None
        self._learn_egress_link: Any = None
        self._learn_until = 0.0
        self._ingress: Any = None
        self._egress: Any = None  # sockops mode: lat_egress on the serving cgroups, beside lat_ingress
        self._egress_root_link: Any = None  # tracepoint and kprobe modes: lat_egress on the cgroup2 root
        self._cgroup_index: Any = None
        self._cgroup_ids: dict[int, str] = {}  # cgroup id -> host path, for those the ingress program is linked to
        self._cgroup_lock = threading.Lock()
        self._cgroup_errors = 0  # serving cgroups not linked (not found, link refused) and failed polls: status
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        # Connections open before their port was watched (_adopt_open); tracepoint and kprobe modes link
        # lat_adopt_ingress on the cgroup2 root while any waits for its first request.
        self._adoption: Any = None
        self._adopt_link: Any = None
        self._adopt_relist_at = 0.0

    # ---- probe and start ---------------------------------------------------------------------------------
    def probe(self, features: "Features") -> Verdict:
        cfg = self.ctx.config.latency
        sockops_ok = features.sockops_sendmsg and bool(features.cgroup2)
        tracepoints_ok = all(features.has_tracepoint(tp) for tp in SOCKET_TRACEPOINTS)
        set_state = features.has_tracepoint("sock/inet_sock_set_state")
        kprobe_fns = all(features.kprobe_functions.get(fn, False) for fn, _ in KPROBES)
        notes = []
        if cfg.mode == "sockops" or (cfg.mode == "auto" and sockops_ok):
            if not sockops_ok:
                return Verdict(State.UNAVAILABLE, "latency.mode is sockops, but " + (
                    "the kernel's sock_ops has no per-socket sendmsg callback (kernel < 6.15)"
                    if not features.sockops_sendmsg else "no cgroup v2 hierarchy is mounted"))
            self.mode = "sockops"
            self.arrival = True  # the ingress program sees request bytes arrive
            self.egress = True  # and the egress program response bytes leave
        elif cfg.mode in ("auto", "tracepoint") and set_state and tracepoints_ok:
            self.mode = "tracepoint"
        elif cfg.mode in ("auto", "kprobe") and set_state and features.kprobes and kprobe_fns:
            self.mode = "kprobe"
            notes.append("kprobe fallback on " + "/".join(fn for fn, _ in KPROBES))
        else:
            kp_why = "no kprobes" if not features.kprobes else "no " + "/".join(
                fn for fn, _ in KPROBES if not features.kprobe_functions.get(fn, False)) + " to probe"
            missing = ("no sock:inet_sock_set_state tracepoint (kernel < 4.16)" if not set_state else
                       "no sock:sock_recv_length/sock_send_length tracepoints (kernel < 6.4)" if cfg.mode != "kprobe"
                       else kp_why)
            if cfg.mode == "auto":
                missing += f", {kp_why} for the kprobe fallback" if set_state else ""
                missing += ", and no per-socket sock_ops hooks (kernel < 6.15 or no cgroup v2)"
            return Verdict(State.UNAVAILABLE, f"latency.mode {cfg.mode}: {missing}")
        if self.mode != "sockops":
            self.egress = bool(features.cgroup2)
            if not self.egress:
                notes.append("no cgroup v2 hierarchy: time to first token and inter-token latency unavailable")
        if self.mode == "kprobe":
            self.arrival = features.kprobe_functions.get(KPROBE_ARRIVAL[0], False)
            if self.arrival:
                notes.append(f"request arrival from a kprobe on {KPROBE_ARRIVAL[0]}")
            else:
                notes.append(f"no {KPROBE_ARRIVAL[0]} to probe: requests timed from their first read, not arrival")
        elif self.mode != "sockops":
            self.arrival = features.has_tracepoint("sock/sk_data_ready")
            if not self.arrival:
                notes.append("no sock:sk_data_ready (kernel < 6.6): requests timed from their first read, not arrival")
        self.runq = cfg.runqueue.enabled and all(features.has_tracepoint(tp) for tp in RUNQ_TRACEPOINTS)
        if cfg.runqueue.enabled and not self.runq:
            notes.append("run-queue latency off: sched tracepoints missing")
        # Without TTFT (the default SLO signal) or run-queue latency the capability is short of what it promises.
        degraded = not self.egress or (cfg.runqueue.enabled and not self.runq)
        return Verdict(State.DEGRADED if degraded else State.ACTIVE, "; ".join(notes))

    def start(self) -> None:
        from qosagent.ebpf.loader import BpfError, compile_program

        defines: dict[str, object] = {}
        if self.runq:
            defines["QOS_RUNQ"] = 1
        if self.mode == "sockops":
            defines["QOS_SOCKOPS"] = 1
        else:
            if self.mode == "kprobe":
                defines["QOS_KPROBE"] = 1
            if self.arrival:
                defines["QOS_ARRIVAL"] = 1
            if self.egress:
                defines["QOS_EGRESS"] = 1
            defines["LAT_SOCK_BUCKETS_LOG2"] = (self.ctx.config.latency.socket_slots // 4).bit_length() - 1
        self._nslots = bm.slots_for(len(self.ctx.config.tenants))
        self._slots = {}
        self._rows = bm.RowParser()
        defines["LAT_SLOTS"] = self._nslots
        defines.update(_flows_defines(self.ctx.config))
        try:
            self.bpf = compile_program("latency", defines)
            if self.mode == "kprobe":
                for fn, prog in KPROBES:
                    self.bpf.attach_kprobe(event=fn.encode(), fn_name=prog.encode())
                if self.arrival:
                    self.bpf.attach_kprobe(event=KPROBE_ARRIVAL[0].encode(), fn_name=KPROBE_ARRIVAL[1].encode())
        except BpfError as e:
            raise CapabilityError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception when attaching
            self._release()
            raise CapabilityError(f"attaching the latency probes failed: {e}") from None
        from qosagent.ebpf.maps import Map
        from qosagent.ebpf.tenant_ports import TenantPorts

        self._ports = TenantPorts(Map.of(self.bpf, "tenant_ports").fd)  # a fresh map: all zero
        hist, counters = Map.of(self.bpf, "lat_hist"), Map.of(self.bpf, "lat_counters")
        self._hist_fd, self._counters_fd = hist.fd, counters.fd
        # A per-CPU value is one copy per possible CPU, as bcc's table type for it has it: the kernel writes that
        # many, so the buffer must hold them.
        self._counters_size = ctypes.sizeof(counters.value)
        self._maps = None
        self._listing(True)
        self._write_maps(self._plan_maps(self.ctx.config))
        if self.mode == "sockops":
            # Maps first, hooks last: a connection established before the tenant maps were written would be
            # resolved against empty ones.
            self._attach_sockops()
        elif self.egress:
            self._attach_egress_root()
        self._adopt_open(set(bm.watched(self.ctx.config)))
        self.programs = self._program_ids()
        log.info("latency probes attached (%s mode, %d programs, clock from %s, run-queue %s) on ports %s",
                 self.mode, self.attached(), "arrival" if self.arrival else "first read",
                 "on" if self.runq else "off", bm.watched(self.ctx.config))

    def started(self, verdict: Verdict) -> Verdict:
        if self._egress_lost:
            why = f"time to first token and inter-token latency unavailable: {self._egress_error}"
            verdict = Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, why) if r))
        # Active only once the hooks were seen running (qosagent/latency/selftest.py): those on every socket's path.
        rooted = (("lat_sockops", self._sockops_link), ("lat_ingress_learn", self._learn_link),
                  ("lat_egress_learn", self._learn_egress_link), ("lat_egress", self._egress_root_link))
        # The run-queue probes are left out: a wakeup of a new task needs a fork, which one connection does not make.
        traced = [k.decode() for k in self.bpf.funcs if k.startswith((b"tracepoint__", b"raw_tracepoint__", b"kp_"))
                  and not k.startswith(b"tracepoint__sched__")]
        names = [n for n, link in rooted if link is not None] + traced
        try:
            silent = selftest.check({n: self.bpf.funcs[n.encode()].fd for n in names},
                                    set(bm.watched(self.ctx.config)))
        except selftest.Unverifiable as e:
            # Said, not degraded: the documented unit runs without CAP_SYS_ADMIN, and a capability degraded on every
            # such host would be a false alarm (and an agent never ready).
            log.info("latency: %s", e)
            return Verdict(verdict.state, "; ".join(r for r in (verdict.reason, str(e)) if r))
        if silent:
            log.warning("latency: %s", silent)
            verdict = Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, silent) if r))
        return verdict

    def _attach_sockops(self) -> None:
        """The sock_ops program on the cgroup2 root (it sees every TCP socket's connection events, and picks the
        server sockets of watched ports), and a thread that links the ingress program to each cgroup the kernel
        reports serving them. Links, so that a killed agent leaves nothing attached."""
        from bcc import BPF

        from qosagent.ebpf.cgroups import CgroupIndex, CgroupLinks
        from qosagent.ebpf.libbpf import (
            ATTACH_CGROUP_INET_EGRESS,
            ATTACH_CGROUP_INET_INGRESS,
            ATTACH_CGROUP_SOCK_OPS,
        )

        root = self._cgroup_root()
        try:
            sockops = self.bpf.load_func(b"lat_sockops", BPF.SOCK_OPS)
            ingress = self.bpf.load_func(b"lat_ingress", BPF.CGROUP_SKB)
            learn = self.bpf.load_func(b"lat_ingress_learn", BPF.CGROUP_SKB)
            egress = self._load_egress()
            egress_learn = self.bpf.load_func(b"lat_egress_learn", BPF.CGROUP_SKB)
            self._ingress = CgroupLinks(ingress.fd, ATTACH_CGROUP_INET_INGRESS, self.ctx.hostfs)
            self._egress = CgroupLinks(egress.fd, ATTACH_CGROUP_INET_EGRESS, self.ctx.hostfs)
            self._cgroup_index = CgroupIndex(self.ctx.hostfs, root)
            self.bpf[b"lat_cgroup_events"].open_ring_buffer(self._on_cgroup_event)
            # The learners first: no socket the sock_ops program tracks may have bytes nobody sees.
            self._learn_link = self._link_root(root, learn.fd, ATTACH_CGROUP_INET_INGRESS)
            self._learn_egress_link = self._link_root(root, egress_learn.fd, ATTACH_CGROUP_INET_EGRESS)
            self._learn_until = self.ctx.clock() + LEARN_S
            self._sockops_link = self._link_root(root, sockops.fd, ATTACH_CGROUP_SOCK_OPS)
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception when loading
            self._release()
            raise CapabilityError(f"attaching the sock_ops latency hooks at {root} failed: {e}") from None
        # From here on the kernel reports serving cgroups on the ring buffer; this thread links each as it comes.
        self._stopping.clear()
        self._watcher = threading.Thread(target=self._watch_cgroups, name="latency-cgroups", daemon=True)
        self._watcher.start()
        self._link_listeners(root)

    def _link_listeners(self, root: str) -> None:
        """Link the cgroups of servers already listening on watched ports in this network namespace: they called
        listen() before the agent, so nothing reports them until their first request reaches the learner or their
        first write, and the requests of connections opened before that would go unseen. Servers in other network
        namespaces (pods) are left to the learner and to their first write."""
        import psutil

        from qosagent.placement.discovery import cgroup_paths

        ports = set(bm.watched(self.ctx.config))
        try:
            pids = {c.pid for c in psutil.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports and c.pid}
        except (psutil.Error, OSError) as e:
            log.warning("latency: listing the listening sockets failed (%s): serving cgroups are learnt from "
                        "traffic only", e)
            return
        for pid in sorted(pids):
            v2 = cgroup_paths(self.ctx.hostfs.try_read(f"/proc/{pid}/cgroup") or "")[0]
            if not v2:
                continue
            path = posixpath.join(root, v2.lstrip("/"))
            try:
                cgid = os.stat(self.ctx.hostfs.path(path)).st_ino  # the id, as the kernel would report it
            except OSError:
                continue  # the process or its cgroup went meanwhile
            self._link_cgroup(cgid, pid, path)

    def _link_root(self, root: str, prog_fd: int, attach_type: int) -> int:
        """A link of the program on the cgroup2 root (its fd): a killed agent leaves nothing attached."""
        from qosagent.ebpf.libbpf import link_create

        fd = os.open(self.ctx.hostfs.path(root), os.O_RDONLY | os.O_DIRECTORY)
        try:
            return link_create(prog_fd, fd, attach_type)
        finally:
            os.close(fd)

    def _load_egress(self) -> Any:
        """lat_egress, with lat_egress_framing in its tail-call slot: the framing reader is verified as a program of
        its own (bpf/latency.c, lat_response_segment)."""
        from bcc import BPF

        from qosagent.ebpf.maps import Map

        egress = self.bpf.load_func(b"lat_egress", BPF.CGROUP_SKB)
        framing = self.bpf.load_func(b"lat_egress_framing", BPF.CGROUP_SKB)
        Map.of(self.bpf, "lat_tail").update(0, framing.fd)
        return egress

    def _attach_egress_root(self) -> None:
        """lat_egress on the cgroup2 root, for the whole run: in tracepoint and kprobe modes it finds a response's
        socket by the packet's addresses, whichever cgroup sends it. A link, so a killed agent leaves nothing.
        Where it cannot be (a verifier of another kernel refusing the parser, say), the send hooks still time the
        headers and responses: TTFT and inter-token latency are unavailable, with the reason, and nothing else."""
        from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_EGRESS

        try:
            root = self._cgroup_root()
            self._egress_root_link = self._link_root(root, self._load_egress().fd, ATTACH_CGROUP_INET_EGRESS)
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception when loading
            self.egress = False
            self._egress_lost = True
            self._egress_error = f"the egress program could not be attached: {e}"
            log.warning("latency: %s; time to first token and inter-token latency unavailable", self._egress_error)

    def _cgroup_root(self) -> str:
        from qosagent.ebpf.cgroups import cgroup2_mount

        root = cgroup2_mount(self.ctx.hostfs)
        if not root:
            raise CapabilityError("latency in sockops mode needs a cgroup v2 hierarchy, and none is mounted")
        return root

    def _watch_cgroups(self) -> None:
        while not self._stopping.is_set():
            try:
                self.bpf.ring_buffer_poll(CGROUP_EVENT_POLL_MS)
            except Exception as e:  # noqa: BLE001 - a failed poll must not end the watcher silently
                self._cgroup_errors += 1
                log.warning("latency: polling the cgroup events failed: %s", e)
                self._stopping.wait(1.0)

    def _on_cgroup_event(self, _ctx: Any, data: Any, _size: int) -> None:
        ev = ctypes.cast(data, ctypes.POINTER(_CgroupEvent)).contents
        self._link_cgroup(int(ev.id), int(ev.tgid))

    def _link_cgroup(self, cgid: int, tgid: int, path: str | None = None) -> None:
        """Attach the ingress and egress programs to a cgroup a watched port is served from: its id as the kernel
        reports it (its path then found under the hierarchy), or its path when the agent found it itself."""
        with self._cgroup_lock:
            if self._ingress is None:
                return
            path = path or self._cgroup_index.path_of(cgid)
            if path is None:
                self._cgroup_errors += 1
                log.warning("latency: cgroup id %d (where %s serves a watched port) not found under %s: request "
                            "arrivals there are not seen, and those requests count as responses without request",
                            cgid, f"process {tgid}" if tgid else "a tracked socket", self._cgroup_index.root)
                return
            try:
                self._cgroup_ids[cgid] = path
                self._egress.attach(path)
                if self._ingress.attach(path):
                    log.info("latency: request arrivals hooked on cgroup %s (%s serves a watched port there)",
                             path, f"process {tgid}" if tgid else "a tracked socket")
            except OSError as e:
                self._cgroup_errors += 1
                log.warning("latency: %s; requests served from there are not timed", e)

    def stop_learning(self) -> None:
        """Unlink the learners from the cgroup2 root: from now on only the serving cgroups' programs see requests."""
        with self._cgroup_lock:
            for link in (self._learn_link, self._learn_egress_link):
                if link is not None:
                    os.close(link)
            self._learn_link = self._learn_egress_link = None

    def _prune_cgroups(self) -> None:
        """Drop the links of cgroups that were removed (the kernel has detached them already)."""
        with self._cgroup_lock:
            if self._ingress is None:
                return
            for cgid, path in list(self._cgroup_ids.items()):
                if self.ctx.hostfs.is_dir(path):
                    continue
                self._ingress.detach(path)
                self._egress.detach(path)
                del self._cgroup_ids[cgid]
                # Room in the kernel's set for new cgroups (ids are never reused).
                from qosagent.ebpf.maps import Map

                Map.of(self.bpf, "lat_cgroups").delete(cgid)

    def _release(self) -> None:
        """Undo what start() did, in reverse: the cgroup watcher, the links, the programs and maps."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._cgroup_lock:
            for links in (self._ingress, self._egress):
                if links is not None:
                    links.close()
            self._ingress = self._egress = None
            for link in (self._sockops_link, self._learn_link, self._learn_egress_link, self._egress_root_link,
                         self._adopt_link):
                if link is not None:
                    os.close(link)
            self._sockops_link = self._learn_link = self._learn_egress_link = self._egress_root_link = None
            self._adopt_link = None
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None

    def attached(self) -> int:
        if self.bpf is None:
            return 0
        n = len(self.bpf.tracepoint_fds) + len(self.bpf.raw_tracepoint_fds) + len(self.bpf.kprobe_fds)
        if self._sockops_link is not None:
            n += 1 + (2 if self._ingress is not None and self._ingress.paths else 0)
            n += 2 if self._learn_link is not None else 0
        n += 1 if self._egress_root_link is not None else 0
        n += 1 if self._adopt_link is not None else 0
        return n

    def cgroups(self) -> list[str]:
        """The cgroups whose request arrivals are hooked (sockops mode)."""
        with self._cgroup_lock:
            return self._ingress.paths if self._ingress is not None else []

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
    def _plan_maps(self, cfg: "Config") -> MapsPlan:
        """What cfg makes of the tenant and port maps; writes nothing."""
        try:
            return slots.plan(cfg, self._slots, self._nslots)
        except ValueError as e:
            raise CapabilityError(str(e)) from None

    def _write_maps(self, m: MapsPlan) -> None:
        """Make the tenant and port maps say what m says, in place: entries added, changed, removed."""
        from qosagent.ebpf.maps import Map, sync
        from qosagent.ebpf.tenant_ports import sync_cidrs

        slots = Map.of(self.bpf, "lat_slots")
        sync(slots, ((slots.key(tenant=tid), slots.value(slot=slot)) for tid, slot in m.slots.items()))
        self._slots = dict(m.slots)
        self._plan_reads()
        for name, want in (("watched_ports", m.watched), ("lat_mux_ports", m.mux)):
            ports = Map.of(self.bpf, name)
            sync(ports, ((ports.key(port=p), ports.value(on=1)) for p in want))
        assert self._ports is not None
        self._ports.sync({p: (tid, 0) for p, tid in m.ports.items()})
        sync_cidrs(Map.of(self.bpf, "tenant_cidrs"), m.cidrs)
        self._known.update(m.tenants)
        self._tenants = m.tenants
        if self._maps is None or self._maps.window != m.window:
            self._window = Window(m.window)
        self._maps = m

    def prepare(self, config: "Config") -> Change:
        if self.bpf is None:
            return UNCHANGED
        new, old = self._plan_maps(config), self._maps
        assert old is not None
        return rewrite(self._write_maps_adopting, new, old, "tenant maps")

    def _write_maps_adopting(self, m: MapsPlan) -> None:
        """_write_maps, then the connections already open on the ports m newly watches taken under observation."""
        assert self._maps is not None
        added = set(m.watched) - set(self._maps.watched)
        try:
            self._listing(bool(added))
            self._write_maps(m)
            if added:
                self._adopt_open(added)
        finally:
            self._listing(False)

    # ---- each tick ---------------------------------------------------------------------------------------
    def read_raw(self) -> bm.Raw:
        assert self._reads is not None
        rows, runq, counters = self._reads
        hist = list(enumerate(rows.read()))
        if runq is not None:
            hist.append((runq.first, runq.read()[0]))
        return bm.assemble(hist, enumerate(counters.read()), self._by_slot, bm.KINDS * self._nslots, self._rows)

    def _plan_reads(self) -> None:
        """What each tick reads, worked out when the slots change (start, reload) rather than every tick: the rows
        and counters of the slots in use, which are numbered from 0 up, as one batch each, and the run-queue row.
        A batch read of the whole arrays would copy (and the tick compare) every spare slot's rows too, ~600 KB per
        tick; a lookup per row would cost a syscall each."""
        from qosagent.ebpf.maps import ArrayRange

        self._by_slot = {slot: tid for tid, slot in self._slots.items()}
        used = max(self._by_slot) + 1
        self._reads = (ArrayRange(self._hist_fd, 0, bm.KINDS * used, bm.ROW_SIZE),
                       ArrayRange(self._hist_fd, bm.KINDS * self._nslots, 1, bm.ROW_SIZE) if self.runq else None,
                       ArrayRange(self._counters_fd, 0, used, self._counters_size))

    def maintain(self) -> None:
        now = self.ctx.clock()
        if not self._refresh.due(now):
            return
        if self.runq:
            self._refresh_runq_threads()
        self._maintain_adoption()
        if self.mode == "sockops":
            self._prune_cgroups()
            if self._learn_link is not None and now >= self._learn_until:
                self.stop_learning()
                log.info("latency: arrivals now hooked on the serving cgroups only: %s",
                         ", ".join(self.cgroups()) or "none yet")

    def collect(self) -> LatencyPart:
        now = self.ctx.clock()
        raw = self.read_raw()
        assert self._window is not None
        base_t, base = self._window.push(now, raw)
        elapsed = now - base_t
        cfg = self.ctx.config
        current = self._tenants
        # Configured tenants, and any a reload removed that still have counts since start.
        ids = set(current) | {t for (t, _kind) in raw.hist} | {t for (t, _what) in raw.counters}
        tenants = {}
        for tid in sorted(ids):
            info = current.get(tid) or self._known.get(tid) or TenantInfo(tid, f"id-{tid}", "none", 0, 0.0)
            tenants[info.name] = self._tenant(info, raw, base, elapsed)
        runq = self._hist(raw, UNMATCHED_ID, bm.KIND_RUNQ) if self.runq else None
        return LatencyPart(
            window_s=cfg.latency.window,
            tenants=tenants,
            runqueue=runq,
            runqueue_window=Since(runq, self._hist(base, UNMATCHED_ID, bm.KIND_RUNQ)) if runq is not None else None,
            found_open=self._adoption.found if self._adoption is not None else 0,
            unobserved=self._unobserved(),
        )

    @staticmethod
    def _hist(raw: bm.Raw, tid: int, kind: int) -> Histogram:
        # Not copied: RowParser makes a new dict for each changed row and never touches one it has handed out.
        return Histogram(raw.hist.get((tid, kind), _EMPTY), raw.sums.get((tid, kind), 0))

    def _tenant(self, info: TenantInfo, raw: bm.Raw, base: bm.Raw, elapsed: float) -> TenantLatency:
        tid = info.id

        def c(r: bm.Raw, what: int) -> int:
            return r.counters.get((tid, what), 0)

        def since(kind: int) -> tuple[Histogram, Histogram]:
            h = self._hist(raw, tid, kind)
            return h, Since(h, self._hist(base, tid, kind))

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

    # ---- connections open before their port was watched --------------------------------------------------------
    def _listing(self, on: bool) -> None:
        """While on, the kernel notes connections established on watched ports in lat_fresh: those are hooked
        already, whatever the listing that runs meanwhile finds. On before the hooks or the ports change."""
        from qosagent.ebpf.maps import Map

        try:
            conf = Map.of(self.bpf, "lat_adopt_conf")
        except KeyError:  # built without cgroup_skb programs (no cgroup v2): nothing adopts connections
            return
        cur = conf.lookup(0)
        cur.listing = int(on)
        conf.update(0, cur)
        if not on:
            Map.of(self.bpf, "lat_fresh").clear()

    def _adopt_open(self, ports: set[int]) -> None:
        """Take the established connections on `ports` under observation: the kernel adopts each at its next
        request (bpf/latency.c, lat_adopt). In sockops mode their cgroups are linked, as the listeners' are."""
        from qosagent.ebpf.maps import Map
        from qosagent.latency import adopt

        if self._adoption is None:
            self._adoption = self._new_adoption()
        # Sockops mode links each connection's cgroup, which only sock_diag names.
        conns = adopt.established(self.ctx.hostfs, ports, cgroups=self.mode == "sockops")
        fresh = ({bytes(k) for k in Map.of(self.bpf, "lat_fresh").keys()} if self._adoption.write is not None
                 else set())
        self._listing(False)
        # Everything that adopts in place first: a connection is observed from the first request after its entry.
        if self.mode == "sockops":
            for cgid in sorted({c.cgroup_id for c in conns if c.cgroup_id}):
                if cgid not in self._cgroup_ids:
                    self._link_cgroup(cgid, 0)
        if conns:
            self._set_adopting(True)
        n = self._adoption.add(conns, fresh)
        self._set_adopting()
        if n:
            log.info("latency: %d connections were open on watched ports before the agent watched them: each is "
                     "observed from its next request", n)

    def _new_adoption(self) -> Any:
        from qosagent.latency import adopt

        if self.mode != "sockops" and not self.egress:
            # No cgroup_skb program to see a request arrive: nothing can adopt a connection.
            return adopt.Adoption(None, lambda k: False, lambda k: None)
        from qosagent.ebpf.maps import Map

        tbl = Map.of(self.bpf, "lat_adopt")

        def write(k: bytes) -> bool:
            try:
                tbl.update(k, tbl.value(on=1))
            except OSError:  # full (E2BIG): counted as no room by the caller
                return False
            return True

        def waiting(k: bytes) -> bool:
            return tbl.lookup(k) is not None

        def drop(k: bytes) -> None:
            tbl.delete(k)

        return adopt.Adoption(write, waiting, drop)

    def _set_adopting(self, pending: bool | None = None) -> None:
        """Tell the kernel whether connections wait for adoption (default: whether any does); in tracepoint and
        kprobe modes, link the program that adopts them on the cgroup2 root while any does, and only then (it sees
        every packet arriving)."""
        if self._adoption is None or self._adoption.write is None:
            return
        pending = self._adoption.pending if pending is None else pending
        from qosagent.ebpf.maps import Map

        conf = Map.of(self.bpf, "lat_adopt_conf")
        cur = conf.lookup(0)
        if bool(cur.adopting) != pending:
            cur.adopting = int(pending)
            conf.update(0, cur)
        if self.mode == "sockops":
            return
        if pending and self._adopt_link is None:
            from bcc import BPF

            from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_INGRESS

            prog = self.bpf.load_func(b"lat_adopt_ingress", BPF.CGROUP_SKB)
            self._adopt_link = self._link_root(self._cgroup_root(), prog.fd, ATTACH_CGROUP_INET_INGRESS)
        elif not pending and self._adopt_link is not None:
            with self._cgroup_lock:
                os.close(self._adopt_link)
                self._adopt_link = None

    def _maintain_adoption(self) -> None:
        """Once a second while any watched-port connection is not observed: forget those the kernel adopted, and
        every ADOPT_RELIST_S those that closed."""
        from qosagent.latency import adopt

        if self._adoption is None or not self._adoption.ports():
            return
        still = None
        now = self.ctx.clock()
        if now >= self._adopt_relist_at:
            self._adopt_relist_at = now + ADOPT_RELIST_S
            still = {c.key for c in adopt.established(self.ctx.hostfs, self._adoption.ports())}
        self._adoption.prune(still, set(bm.watched(self.ctx.config)))
        self._set_adopting()

    def _unobserved(self) -> dict[str, int]:
        if self._adoption is None:
            return {}
        if self.mode != "sockops":
            return self._adoption.unobserved(lambda c: self._adopt_link is not None)
        # Sockops mode: a connection's segments reach the ingress program on its own cgroup, or on the root while
        # the learner is linked; an unknown cgroup (no sock_diag) is taken to be its listener's, linked at start.
        linked = set(self._cgroup_ids)
        learning = self._learn_link is not None
        return self._adoption.unobserved(lambda c: learning or not c.cgroup_id or c.cgroup_id in linked)

    def _refresh_runq_threads(self) -> None:
        """Expand the processes seen serving watched sockets into their threads (the sched tracepoints name threads);
        forget processes that are gone and threads that ended."""
        from qosagent.ebpf.maps import Map

        tgids, pids = Map.of(self.bpf, "runq_tgids"), Map.of(self.bpf, "runq_pids")
        want: set[int] = set()
        for k in tgids.keys():
            tasks = self.ctx.hostfs.listdir(f"/proc/{k.pid}/task")
            if not tasks:
                tgids.delete(k)
                continue
            want.update(int(t) for t in tasks if t.isdigit())
        have = set()
        for k in pids.keys():
            if k.pid in want:
                have.add(k.pid)
            else:
                pids.delete(k)
        for tid in want - have:  # new threads only: an existing entry may hold a live wake-up time
            pids.update(pids.key(pid=tid), pids.value(v=0))

    def stop(self) -> None:
        if self.bpf is None:
            return
        self._release()
        log.info("latency probes detached")

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: "Snapshot") -> Iterable["Metric"]:
        from qosagent.latency import export

        part = snapshot.part(self.name)
        adm = self.ctx.config.admission
        yield from export.families(part, self.attached(), adm.signal, adm.quantile,
                                   self.ctx.config.latency.classic_buckets)

    def status(self, snapshot: "Snapshot") -> dict[str, Any]:
        from qosagent.latency import export

        part = snapshot.part(self.name)
        slo = {info.name: info.slo_p99 for info in self._tenants.values()}
        adm = self.ctx.config.admission
        out = export.status(part, slo, adm.signal, adm.quantile)
        out["mode"] = self.mode
        out["ttft"] = ("measured: responses read as they leave" if self.egress else
                       f"unavailable: {self._egress_error}")
        out["programs"] = self.programs
        if self.mode == "sockops":
            out["cgroups"] = self.cgroups()
            out["learning"] = self._learn_link is not None
            out["cgroup_errors"] = self._cgroup_errors
        return out

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        from qosagent.latency import export

        return export.render(status)


class _CgroupEvent(ctypes.Structure):
    """struct lat_cgroup_event of bpf/latency.c."""

    _fields_ = [("id", ctypes.c_uint64), ("tgid", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


def _flows_defines(cfg: "Config") -> dict[str, object]:
    """Attribute header-matched tenants through the quota classifier's pinned flow map (quota starts first)."""
    if not (cfg.quota.enabled and any(t.match.header for t in cfg.tenants)):
        return {}
    from qosagent.quota.datapath import pin_dir

    return {"QOS_FLOWS_PIN": f'"{pin_dir(cfg)}/tenant_flows"', "QOS_FLOWS": cfg.quota.flow_entries}
