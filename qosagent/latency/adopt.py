"""Connections that were open before their port was watched: found when the agent starts (or a reload adds watched
ports), handed to the kernel by their addresses (bpf/include/lat_packet.h, `lat_adopt`), and taken under observation
there at their next request. What cannot be is reported, by reason, for as long as the connection stays open.

Finding them reads the host (sock_diag, else /proc/net/tcp); the bookkeeping after that (Adoption) is pure, over
callables that Adopter binds to the kernel's maps, so it is tested without BPF.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_INGRESS
from qosagent.latency import links

if TYPE_CHECKING:
    from qosagent.ebpf.pinned import Program
    from qosagent.hostfs import HostFS
    from qosagent.latency.cgroupwatch import CgroupWatch

log = logging.getLogger("qosagent.latency")

# Why a watched-port connection is not observed (the `reason` label of qosagent_latency_connections_unobserved):
AWAITING = "awaiting_request"  # open and idle since it was found: taken under observation at its next request
NOT_HOOKED = "not_hooked"  # no program of ours sees its packets (its cgroup could not be linked, no cgroup v2)
NO_ROOM = "no_room"  # the kernel's list of connections to adopt (lat_adopt) was full
REASONS = (AWAITING, NOT_HOOKED, NO_ROOM)

# How often, while connections found open are not observed, they are listed again to forget those that closed: a
# listing reads every established socket of the host (sock_diag), which costs on hosts with many.
RELIST_S = 5.0

_V4_MAPPED = bytes(10) + b"\xff\xff"
_TCP_ESTABLISHED = 1  # the kernel's TCP_ESTABLISHED, in sock_diag and as "01" in /proc/net/tcp


@dataclass(frozen=True)
class Conn:
    """A server-side connection: addresses of 16 bytes (IPv4 mapped, as the tracepoints have them), host-order ports."""

    local: bytes
    lport: int
    remote: bytes
    rport: int
    cgroup_id: int = 0  # the socket's cgroup v2 id (sock_diag); 0 where it is not known (/proc/net/tcp)

    @property
    def key(self) -> bytes:
        """struct qos_flow_key of bpf/include/qos_flow.h: remote address, local address, remote port, local port."""
        return self.remote + self.local + struct.pack("=HH", self.rport, self.lport)


def mapped(address: str) -> bytes:
    ip = ipaddress.ip_address(address)
    return _V4_MAPPED + ip.packed if ip.version == 4 else ip.packed


def established(fs: "HostFS", ports: Iterable[int], cgroups: bool = False, elsewhere: Iterable[int] = ()) -> list[Conn]:
    """The established TCP connections whose local port is one of `ports`, in the agent's network namespace, from
    /proc/net/tcp{,6}; with `cgroups`, from sock_diag, which names each socket's cgroup (else as without). pyroute2
    parses sock_diag's answer at ~70 us per established socket on the host, /proc/net/tcp takes ~5 us: measured here
    with 4,000, 287 ms against 20 ms. `elsewhere`: a process in each other network namespace to list too (the serving
    ones, pods), read from its /proc/PID/net/tcp{,6}: sock_diag answers for the namespace of its socket only, and
    opening one in a pod would mean entering it (setns, CAP_SYS_ADMIN)."""
    want = set(ports)
    if not want:
        return []
    out: list[Conn] = []
    for pid in elsewhere:
        out += _from_proc(fs, f"/proc/{pid}/net", want)
    if cgroups:
        try:
            return _from_diag(want) + out
        except Exception as e:  # noqa: BLE001 - pyroute2 raises NetlinkError, OSError, or ImportError without it
            log.info("sock_diag unavailable (%s): open connections read from /proc/net/tcp", e)
    return _from_proc(fs, "/proc/net", want) + out


def _from_proc(fs: "HostFS", net: str, ports: set[int]) -> list[Conn]:
    out: list[Conn] = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        out += parse_proc_net_tcp(fs.try_read(f"{net}/{name}") or "", v6, ports)
    return out


def _from_diag(ports: set[int]) -> list[Conn]:
    from pyroute2 import DiagSocket

    out = []
    with DiagSocket() as ds:
        ds.bind()
        for family in (socket.AF_INET, socket.AF_INET6):
            for m in ds.get_sock_stats(family=family, states=1 << _TCP_ESTABLISHED):
                if m["idiag_sport"] in ports:
                    out.append(Conn(mapped(m["idiag_src"]), m["idiag_sport"], mapped(m["idiag_dst"]),
                                    m["idiag_dport"], m.get_attr("INET_DIAG_CGROUP_ID") or 0))
    return out


def parse_proc_net_tcp(text: str, v6: bool, ports: set[int]) -> list[Conn]:
    """Established connections on `ports` from /proc/net/tcp (v6: tcp6). Addresses are printed as the kernel's 32-bit
    words in host byte order (little-endian here), ports as numbers."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 4 or f[3] != f"{_TCP_ESTABLISHED:02X}":
            continue
        (laddr, lport), (raddr, rport) = (a.split(":") for a in f[1:3])
        if int(lport, 16) not in ports:
            continue
        out.append(Conn(_proc_addr(laddr, v6), int(lport, 16), _proc_addr(raddr, v6), int(rport, 16)))
    return out


def _proc_addr(hexaddr: str, v6: bool) -> bytes:
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return words if v6 else _V4_MAPPED + words


class Adoption:
    """The connections found open on watched ports, from when they are found until the kernel adopts them or they
    close. `write(key)` hands one to the kernel (False: its list is full), `waiting(key)` says whether the kernel
    still has it, `drop(key)` takes it back."""

    def __init__(self, write: Callable[[bytes], bool] | None, waiting: Callable[[bytes], bool],
                 drop: Callable[[bytes], None]):
        self.write = write  # None: nothing in this mode can adopt a connection (no cgroup v2 for the programs)
        self.waiting = waiting
        self.drop = drop
        self.found = 0  # since start
        self._pending: dict[bytes, Conn] = {}  # handed to the kernel, not adopted yet
        self._left: dict[bytes, tuple[Conn, str]] = {}  # not handed over, with the reason

    def add(self, conns: Iterable[Conn], fresh: set[bytes]) -> int:
        """Hand over the connections found, but those the hooks saw established meanwhile (fresh); how many."""
        n = 0
        for c in conns:
            k = c.key
            if k in fresh or k in self._pending or k in self._left:
                continue
            n += 1
            if self.write is None:
                self._left[k] = (c, NOT_HOOKED)
            elif self.write(k):
                self._pending[k] = c
            else:
                self._left[k] = (c, NO_ROOM)
        self.found += n
        return n

    @property
    def pending(self) -> bool:
        """Whether any connection waits for the kernel to adopt it."""
        return bool(self._pending)

    def ports(self) -> set[int]:
        """The local ports of the connections not observed yet: the ones to list again."""
        return {c.lport for c in self._pending.values()} | {c.lport for c, _ in self._left.values()}

    def prune(self, still_open: set[bytes] | None, watched: set[int]) -> None:
        """Forget connections the kernel adopted, and those that closed (when `still_open` lists the open ones) or
        whose port is no longer watched: those are taken back from the kernel's list."""
        def gone(k: bytes, c: Conn) -> bool:
            return (still_open is not None and k not in still_open) or c.lport not in watched

        for k, c in list(self._pending.items()):
            if not self.waiting(k):
                del self._pending[k]
            elif gone(k, c):
                self.drop(k)
                del self._pending[k]
        for k, (c, _) in list(self._left.items()):
            if gone(k, c):
                del self._left[k]

    def unobserved(self, hooked: Callable[[Conn], bool]) -> dict[str, int]:
        """Connections not observed now, by reason: a pending one whose packets no program sees is not_hooked."""
        out = dict.fromkeys(REASONS, 0)
        for c in self._pending.values():
            out[AWAITING if hooked(c) else NOT_HOOKED] += 1
        for _, why in self._left.values():
            out[why] += 1
        return out


def set_listing(prog: "Program", on: bool) -> None:
    """While on, the kernel notes connections established on watched ports in lat_fresh: those are hooked
    already, whatever the listing that runs meanwhile finds. On before the hooks or the ports change."""
    try:
        conf = prog.map("lat_adopt_conf")
    except KeyError:  # built without cgroup_skb programs (no cgroup v2): nothing adopts connections
        return
    cur = conf.lookup(0)
    cur.listing = int(on)
    conf.update(0, cur)
    if not on:
        prog.map("lat_fresh").clear()


class Adopter:
    """The connections found open, handed to the kernel's lat_adopt and followed there until adopted or closed. In
    sockops mode their cgroups are linked through the cgroup watcher, as the listeners' are; in tracepoint and
    kprobe modes lat_adopt_ingress is linked on the cgroup2 root (`root`) while any waits, and only then (it sees
    every packet arriving). `root` None outside sockops mode: no cgroup_skb program runs, nothing can adopt.
    `elsewhere(ports)`: a process in each other network namespace where one of ports listens (pods), whose
    connections are listed too."""

    def __init__(self, prog: "Program", fs: "HostFS", clock: Callable[[], float], watch: "CgroupWatch | None",
                 root: str | None, elsewhere: Callable[[set[int]], list[int]] = lambda ports: []):
        self.prog = prog
        self.fs = fs
        self.clock = clock
        self.elsewhere = elsewhere
        self.watch = watch
        self.root = root
        self._link: int | None = None  # lat_adopt_ingress on the root (tracepoint and kprobe modes)
        self._relist_at = 0.0
        self.adoption = self._adoption()

    def _adoption(self) -> Adoption:
        if self.watch is None and self.root is None:
            # No cgroup_skb program to see a request arrive: nothing can adopt a connection.
            return Adoption(None, lambda k: False, lambda k: None)
        tbl = self.prog.map("lat_adopt")

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

        return Adoption(write, waiting, drop)

    @property
    def found(self) -> int:
        return self.adoption.found

    def open(self, ports: set[int]) -> None:
        """Take the established connections on `ports` under observation: the kernel adopts each at its next
        request (bpf/include/lat_packet.h, lat_adopt)."""
        # Sockops mode links each connection's cgroup, which only sock_diag names.
        conns = established(self.fs, ports, cgroups=self.watch is not None, elsewhere=self.elsewhere(ports))
        fresh = ({bytes(k) for k in self.prog.map("lat_fresh").keys()} if self.adoption.write is not None
                 else set())
        set_listing(self.prog, False)
        # Everything that adopts in place first: a connection is observed from the first request after its entry.
        if self.watch is not None:
            linked = self.watch.linked()
            for cgid in sorted({c.cgroup_id for c in conns if c.cgroup_id}):
                if cgid not in linked:
                    self.watch.link(cgid, 0)
        if conns:
            self.set_adopting(True)
        n = self.adoption.add(conns, fresh)
        self.set_adopting()
        if n:
            log.info("%d connections were open on watched ports before the agent watched them: each is "
                     "observed from its next request", n)

    def set_adopting(self, pending: bool | None = None) -> None:
        """Tell the kernel whether connections wait for adoption (default: whether any does); outside sockops mode,
        link the program that adopts them on the cgroup2 root while any does."""
        if self.adoption.write is None:
            return
        pending = self.adoption.pending if pending is None else pending
        conf = self.prog.map("lat_adopt_conf")
        cur = conf.lookup(0)
        if bool(cur.adopting) != pending:
            cur.adopting = int(pending)
            conf.update(0, cur)
        if self.watch is not None:
            return
        if pending and self._link is None:
            assert self.root is not None
            self._link = links.link_root(self.fs, self.root, self.prog.fd("lat_adopt_ingress"),
                                         ATTACH_CGROUP_INET_INGRESS)
        elif not pending:
            self.close()

    def maintain(self, watched: set[int]) -> None:
        """While any watched-port connection is not observed: forget those the kernel adopted, and every RELIST_S
        those that closed."""
        if not self.adoption.ports():
            return
        still = None
        now = self.clock()
        if now >= self._relist_at:
            self._relist_at = now + RELIST_S
            ports = self.adoption.ports()
            still = {c.key for c in established(self.fs, ports, elsewhere=self.elsewhere(ports))}
        self.adoption.prune(still, watched)
        self.set_adopting()

    def unobserved(self) -> dict[str, int]:
        if self.watch is None:
            return self.adoption.unobserved(lambda c: self._link is not None)
        # Sockops mode: a connection's segments reach the ingress program on its own cgroup, or on the root while
        # the learner is linked; an unknown cgroup (no sock_diag) is taken to be its listener's, linked at start.
        linked = self.watch.linked()
        learning = self.watch.learning
        return self.adoption.unobserved(lambda c: learning or not c.cgroup_id or c.cgroup_id in linked)

    def attached(self) -> int:
        return 1 if self._link is not None else 0

    def close(self) -> None:
        """Unlink lat_adopt_ingress; set_adopting() links it again while a connection waits."""
        if self._link is not None:
            os.close(self._link)
            self._link = None
