"""Sockops mode's hooks on cgroups: the sock_ops program on the cgroup2 root (it sees every TCP socket's connection
events and picks the server sockets of watched ports), the learners beside it for the first LEARN_S, and the ingress
and egress programs on each cgroup that serves a watched port, linked as the kernel reports it on a ring buffer
(read by a thread of its own), as the agent finds it listening at start, or as an open connection names it."""

from __future__ import annotations

import ctypes
import logging
import posixpath
import select
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable

from qosagent.capability import CapabilityError
from qosagent import listeners
from qosagent.cgroups import CgroupIndex, cgroup_id, cgroup_paths
from qosagent.ebpf.cgrouplinks import CgroupLinks
from qosagent.ebpf.loader import BpfError
from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_EGRESS, ATTACH_CGROUP_INET_INGRESS, ATTACH_CGROUP_SOCK_OPS
from qosagent.latency import links
from qosagent.wakepipe import WakePipe

if TYPE_CHECKING:
    from qosagent.ebpf.libbpf import RingBuffer
    from qosagent.ebpf.pinned import Program
    from qosagent.hostfs import HostFS

log = logging.getLogger("qosagent.latency")

FALLBACK_POLL_MS = 200  # where the ring buffer's epoll fd cannot be had: how long a poll blocks before stop is checked
# How long after start lat_ingress_learn stays linked on the cgroup2 root: servers already running when the agent
# starts are found by their first request's arrival (and it is timed) rather than by their first response.
LEARN_S = 30.0


class CgroupEvent(ctypes.Structure):
    """struct lat_cgroup_event of bpf/latency_sockops.c."""

    _fields_ = [("id", ctypes.c_uint64), ("tgid", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


class CgroupWatch:
    """The links sockops mode makes on cgroups, and the thread that makes those of serving cgroups as the kernel
    reports them. The lock orders that thread's linking against pruning, the learners' end and close."""

    def __init__(self, prog: "Program", fs: "HostFS", root: str, clock: Callable[[], float]):
        self.prog = prog
        self.fs = fs
        self.root = root
        self.clock = clock
        self.errors = 0  # serving cgroups not linked (not found, link refused) and failed polls: status
        self._lock = threading.Lock()
        self._sockops_link: int | None = None
        self._learn_link: int | None = None
        self._learn_egress_link: int | None = None
        self._learn_until = 0.0
        self._ingress: Any = None
        self._egress: Any = None  # lat_egress on the serving cgroups, beside lat_ingress
        self._index: Any = None
        self._events: "RingBuffer | None" = None
        self._ids: dict[int, str] = {}  # cgroup id -> host path, for those the ingress program is linked to
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake: WakePipe | None = None  # close() rings it to end the thread's wait

    def start(self, ports: set[int], pods: Iterable[int] = ()) -> None:
        """Link the learners, then the sock_ops program, on the root; start the thread; link the cgroups of the
        servers listening on `ports`, and of `pods` (every process of the serving network namespaces). Raises
        CapabilityError; close() undoes what was done."""
        try:
            sockops = self.prog.fd("lat_sockops")
            learn = self.prog.fd("lat_ingress_learn")
            egress = links.load_egress(self.prog)  # once: its fd goes both to the learner's slot and to the cgroups
            egress_learn = links.load_egress_learn(self.prog, egress)
            self._ingress = CgroupLinks(self.prog.fd("lat_ingress"), ATTACH_CGROUP_INET_INGRESS, self.fs)
            self._egress = CgroupLinks(egress, ATTACH_CGROUP_INET_EGRESS, self.fs)
            self._index = CgroupIndex(self.fs, self.root)
            self._events = self.prog.ring_buffer("lat_cgroup_events", self._on_event)
            # The learners first: no socket the sock_ops program tracks may have bytes nobody sees.
            self._learn_link = links.link_root(self.fs, self.root, learn, ATTACH_CGROUP_INET_INGRESS)
            self._learn_egress_link = links.link_root(self.fs, self.root, egress_learn, ATTACH_CGROUP_INET_EGRESS)
            self._learn_until = self.clock() + LEARN_S
            self._sockops_link = links.link_root(self.fs, self.root, sockops, ATTACH_CGROUP_SOCK_OPS)
        except (BpfError, OSError, KeyError) as e:
            raise CapabilityError(f"attaching the sock_ops latency hooks at {self.root} failed: {e}") from None
        # From here on the kernel reports serving cgroups on the ring buffer; this thread links each as it comes.
        self._start_watch()
        self._link_listeners(ports, pods)

    def _start_watch(self) -> None:
        self._stopping.clear()
        self._wake = WakePipe()
        self._thread = threading.Thread(target=self._watch, name="latency-cgroups", daemon=True)
        self._thread.start()

    def _link_listeners(self, ports: set[int], pods: Iterable[int]) -> None:
        """Link the cgroups of servers already listening on watched ports in this network namespace: they called
        listen() before the agent, so nothing reports them until their first request reaches the learner or their
        first write, and the requests of connections opened before that would go unseen. In other network
        namespaces (pods) the listener's process is named by no table the agent can read without entering them, so
        every process of a serving namespace has its cgroup linked (a pod's pause and sidecars too: their packets
        cost the programs one storage lookup)."""
        held = listeners.holders(self.fs, [s.inode for s in listeners.on_ports(self.fs, ports) if s.inode],
                                 listeners.pids(self.fs), every=True)
        pids = {pid for holders in held.values() for pid in holders}
        for pid in sorted(pids | set(pods)):
            v2 = cgroup_paths(self.fs.try_read(f"/proc/{pid}/cgroup") or "")[0]
            if not v2:
                continue
            path = posixpath.join(self.root, v2.lstrip("/"))
            cgid = cgroup_id(self.fs, path)
            if cgid is None:
                continue  # the process or its cgroup went meanwhile
            self.link(cgid, pid, path)

    def _watch(self) -> None:
        """Wait, without a timeout, until the ring buffer holds a record or close() writes the pipe: a node where
        no server starts wakes this thread never (a 200 ms poll woke it five times a second)."""
        assert self._events is not None and self._wake is not None
        waiting = select.poll()
        bell = self._wake.fileno()
        waiting.register(bell, select.POLLIN)
        try:
            waiting.register(self._events.epoll_fd(), select.POLLIN)
            polled = False
        except OSError as e:  # a libbpf without ring_buffer__epoll_fd (< 0.3): its own poll, with a timeout
            log.info("waiting on the cgroup events in %d ms polls: %s", FALLBACK_POLL_MS, e)
            polled = True
        while not self._stopping.is_set():
            try:
                if polled:
                    self._events.poll(FALLBACK_POLL_MS)
                elif any(fd != bell for fd, _ in waiting.poll()):
                    self._events.consume()
            except Exception as e:  # noqa: BLE001 - a failed read must not end the watcher silently
                self.errors += 1
                log.warning("reading the cgroup events failed: %s", e)
                self._stopping.wait(1.0)

    def _on_event(self, data: Any, _size: int) -> None:
        ev = ctypes.cast(data, ctypes.POINTER(CgroupEvent)).contents
        self.link(int(ev.id), int(ev.tgid))

    def link(self, cgid: int, tgid: int, path: str | None = None) -> None:
        """Attach the ingress and egress programs to a cgroup a watched port is served from: its id as the kernel
        reports it (its path then found under the hierarchy), or its path when the agent found it itself."""
        with self._lock:
            if self._ingress is None:
                return
            path = path or self._index.path_of(cgid)
            if path is None:
                self.errors += 1
                log.warning("cgroup id %d (where %s serves a watched port) not found under %s: request "
                            "arrivals there are not seen, and those requests count as responses without request",
                            cgid, f"process {tgid}" if tgid else "a tracked socket", self._index.root)
                return
            try:
                self._ids[cgid] = path
                self._egress.attach(path)
                if self._ingress.attach(path):
                    log.info("request arrivals hooked on cgroup %s (%s serves a watched port there)",
                             path, f"process {tgid}" if tgid else "a tracked socket")
            except OSError as e:
                self.errors += 1
                log.warning("%s; requests served from there are not timed", e)

    def maintain(self) -> None:
        """Drop the links of cgroups gone; unlink the learners LEARN_S after start."""
        self._prune()
        if self._learn_link is not None and self.clock() >= self._learn_until:
            self.stop_learning()
            log.info("arrivals now hooked on the serving cgroups only: %s",
                     ", ".join(self.cgroups()) or "none yet")

    def _prune(self) -> None:
        """Drop the links of cgroups that were removed (the kernel has detached them already)."""
        with self._lock:
            if self._ingress is None:
                return
            for cgid, path in list(self._ids.items()):
                if self.fs.is_dir(path):
                    continue
                self._ingress.detach(path)
                self._egress.detach(path)
                del self._ids[cgid]
                # Room in the kernel's set for new cgroups (ids are never reused).
                self.prog.map("lat_cgroups").delete(cgid)

    def stop_learning(self) -> None:
        """Unlink the learners from the cgroup2 root: from now on only the serving cgroups' programs see requests."""
        with self._lock:
            links.close(self._learn_link)
            links.close(self._learn_egress_link)
            self._learn_link = self._learn_egress_link = None

    @property
    def learning(self) -> bool:
        """Whether the learners are linked on the root (they see every socket's segments)."""
        return self._learn_link is not None

    def cgroups(self) -> list[str]:
        """The cgroups whose request arrivals are hooked."""
        with self._lock:
            return self._ingress.paths if self._ingress is not None else []

    def linked(self) -> set[int]:
        """The ids of the cgroups the ingress program is linked to."""
        with self._lock:
            return set(self._ids)

    def rooted(self) -> list[str]:
        """The programs linked on the cgroup2 root, which see every socket's path: the self-test's to check."""
        return [n for n, link in (("lat_sockops", self._sockops_link), ("lat_ingress_learn", self._learn_link),
                                  ("lat_egress_learn", self._learn_egress_link)) if link is not None]

    def attached(self) -> int:
        """How many programs are attached: sock_ops, ingress and egress while any cgroup is, the learners."""
        if self._sockops_link is None:
            return 0
        n = 1 + (2 if self._ingress is not None and self._ingress.paths else 0)
        return n + (2 if self._learn_link is not None else 0)

    def close(self) -> None:
        """Stop the thread, then unlink everything; safe to call twice."""
        self._stopping.set()
        if self._wake is not None:
            self._wake.ring()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        with self._lock:
            for cg_links in (self._ingress, self._egress):
                if cg_links is not None:
                    cg_links.close()
            self._ingress = self._egress = None
            for link in (self._sockops_link, self._learn_link, self._learn_egress_link):
                links.close(link)
            self._sockops_link = self._learn_link = self._learn_egress_link = None
