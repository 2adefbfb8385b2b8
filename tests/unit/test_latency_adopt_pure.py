"""The bookkeeping of connections open before their port was watched (qosagent/latency/adopt.py), without BPF: the
/proc/net/tcp reader on the kernel's text, and the life of a found connection until it is adopted or closes."""

from __future__ import annotations

import socket
import struct

from qosagent.latency import adopt

# Two established connections to port 8000 (0x1F40) from 127.0.0.2:50000 and 127.0.0.3:50001, one to port 9000,
# the listener, and a TIME_WAIT one: as /proc/net/tcp prints them on a little-endian machine.
PROC_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0 100 0 0 10 0
   1: 0100007F:1F40 0200007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 1002 1 0 20 4 30 10 -1
   2: 0100007F:1F40 0300007F:C351 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0 20 4 30 10 -1
   3: 0100007F:2328 0200007F:C352 01 00000000:00000000 00:00000000 00000000     0        0 1004 1 0 20 4 30 10 -1
   4: 0100007F:1F40 0200007F:C353 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0
"""
# ::1 port 8000 from 2001:db8::5 port 40000.
PROC_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when
   0: 00000000000000000000000001000000:1F40 B80D0120000000000000000005000000:9C40 01 00000000:00000000 00:00000000
"""


def v4(a: str) -> bytes:
    return bytes(10) + b"\xff\xff" + socket.inet_aton(a)


def test_proc_net_tcp_gives_the_established_connections_on_the_ports_asked() -> None:
    got = adopt.parse_proc_net_tcp(PROC_TCP, False, {8000})
    assert got == [adopt.Conn(v4("127.0.0.1"), 8000, v4("127.0.0.2"), 50000),
                   adopt.Conn(v4("127.0.0.1"), 8000, v4("127.0.0.3"), 50001)]
    assert adopt.parse_proc_net_tcp(PROC_TCP, False, {9000})[0].rport == 50002
    (c,) = adopt.parse_proc_net_tcp(PROC_TCP6, True, {8000})
    assert (c.local, c.remote, c.rport) == (socket.inet_pton(socket.AF_INET6, "::1"),
                                            socket.inet_pton(socket.AF_INET6, "2001:db8::5"), 40000)
    assert adopt.parse_proc_net_tcp("", False, {8000}) == []


def test_a_connections_key_is_the_kernels_flow_key() -> None:
    c = adopt.Conn(v4("127.0.0.1"), 8000, v4("127.0.0.2"), 50000)
    # struct qos_flow_key: raddr[16], laddr[16], rport, lport (host order)
    assert c.key == v4("127.0.0.2") + v4("127.0.0.1") + struct.pack("=HH", 50000, 8000)
    assert adopt.mapped("127.0.0.2") == v4("127.0.0.2") and len(adopt.mapped("::1")) == 16


class Kernel:
    """lat_adopt as a set, with room for `room` entries."""

    def __init__(self, room: int = 100):
        self.room = room
        self.keys: set[bytes] = set()

    def write(self, k: bytes) -> bool:
        if len(self.keys) >= self.room:
            return False
        self.keys.add(k)
        return True

    def adoption(self) -> adopt.Adoption:
        return adopt.Adoption(self.write, lambda k: k in self.keys, self.keys.discard)


A = adopt.Conn(v4("127.0.0.1"), 8000, v4("127.0.0.2"), 50000, cgroup_id=7)
B = adopt.Conn(v4("127.0.0.1"), 8000, v4("127.0.0.3"), 50001, cgroup_id=9)
C = adopt.Conn(v4("127.0.0.1"), 9000, v4("127.0.0.2"), 50002)


def test_found_connections_wait_until_adopted_or_closed() -> None:
    k = Kernel()
    a = k.adoption()
    assert a.add([A, B, C], fresh={C.key}) == 2  # C was established while listing: hooked already
    assert k.keys == {A.key, B.key} and a.found == 2 and a.pending
    assert a.unobserved(lambda c: True) == {adopt.AWAITING: 2, adopt.NOT_HOOKED: 0, adopt.NO_ROOM: 0}
    # B's cgroup has no program: not hooked, while it waits.
    assert a.unobserved(lambda c: c.cgroup_id != 9) == {adopt.AWAITING: 1, adopt.NOT_HOOKED: 1, adopt.NO_ROOM: 0}
    k.keys.discard(A.key)  # the kernel adopted A at its request
    a.prune(None, {8000})  # not listed this time: only what the kernel adopted is forgotten
    assert a.unobserved(lambda c: True)[adopt.AWAITING] == 1 and a.ports() == {8000}
    a.prune(set(), {8000})  # B closed: taken back from the kernel
    assert not k.keys and not a.pending and a.ports() == set() and a.found == 2
    assert a.add([A], fresh=set()) == 1  # found again (a later reload): a new finding
    assert a.found == 3


def test_a_full_list_and_no_programs_are_reasons_and_a_dropped_port_forgets() -> None:
    k = Kernel(room=1)
    a = k.adoption()
    a.add([A, B], fresh=set())
    assert a.unobserved(lambda c: True) == {adopt.AWAITING: 1, adopt.NOT_HOOKED: 0, adopt.NO_ROOM: 1}
    a.prune({A.key, B.key}, watched={9000})  # port 8000 no longer watched: neither is to be observed
    assert not k.keys and a.unobserved(lambda c: True) == dict.fromkeys(adopt.REASONS, 0)
    none = adopt.Adoption(None, lambda k: False, lambda k: None)
    none.add([A], fresh=set())
    assert none.unobserved(lambda c: True)[adopt.NOT_HOOKED] == 1 and not none.pending
