"""Who listens on a port, through HostFS: the listening TCP sockets of a network namespace, and the processes that hold
them (/proc/PID/fd links name a socket by inode). The agent's own namespace is asked of the kernel (sock_diag, only
the listening hash walked), with /proc/net/tcp{,6} as the fallback where that fails (logged once); another
namespace is read from /proc/PID/net/tcp{,6}, and a host root that is not the agent's own (a copy of another host's
tree) from its /proc/net/tcp{,6}. One reader for every capability that asks: quota's interfaces, latency's serving
cgroups, server discovery and the serving network namespaces.

From the tables, only listeners are read: the kernel lists them before every other socket, so the first row in
another state ends them, and a busy server's thousands of connections are never read (reading them all cost ~13 ms
for 2 800 sockets here). Rows are read as the kernel writes them, not the whole table first.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

from qosagent.hostfs import HostFS

log = logging.getLogger("qosagent.listeners")

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
TABLES = ("tcp", "tcp6")


@dataclass(frozen=True)
class Listener:
    port: int
    local: str  # the bound address as the table writes it: host-order 32-bit words in hex
    inode: int  # the socket's inode, what /proc/PID/fd links name (0 where the row does not say)

    @property
    def address(self) -> str:
        """The bound address as text ("0.0.0.0" and "::" for a wildcard)."""
        raw = bytes.fromhex(self.local)
        host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        return socket.inet_ntop(socket.AF_INET if len(host) == 4 else socket.AF_INET6, host)


def parse(lines: Iterable[str]) -> Iterator[Listener]:
    """The listening sockets of /proc/net/tcp or tcp6 text, up to the first row in another state."""
    for line in lines:
        f = line.split()
        if len(f) < 4 or f[0] == "sl":
            continue
        if f[3] != LISTEN:
            return
        try:
            local, port = f[1].rsplit(":", 1)
            yield Listener(int(port, 16), local, int(f[9]) if len(f) > 9 else 0)
        except ValueError:
            continue


def listening_ports(lines: Iterable[str]) -> set[int]:
    """Local ports in LISTEN state from the lines of /proc/net/tcp or tcp6."""
    return {s.port for s in parse(lines)}


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20  # linux/netlink.h, linux/sock_diag.h
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 0x1, 0x300, 2, 3
TCPF_LISTEN = 1 << 10
_NLMSG = struct.Struct("=IHHII")  # struct nlmsghdr
_REQ = struct.Struct("=BBBBI48x")  # struct inet_diag_req_v2, its socket id left zero
# struct inet_diag_msg: family, state, timer, retrans; id: sport, dport (big-endian), src, dst (16 bytes each), if,
# cookie; expires, rqueue, wqueue, uid, inode.
_MSG = struct.Struct("=BBBB2s2x16s16x4x8x4x4x4x4xI")


def _diag(family: int) -> list[Listener]:
    """The listening TCP sockets of `family` in the agent's own network namespace, from the kernel's sock_diag:
    only the listening hash is walked (/proc/net/tcp walks the whole established hash for its rows, ~5 ms per file
    with 262,144 buckets even on an idle host). Each as /proc/net/tcp writes it: the address as host-order 32-bit
    words in hex."""
    out = []
    words = 1 if family == socket.AF_INET else 4
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
        req = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, TCPF_LISTEN)
        s.send(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while True:
            data = s.recv(65536)
            off = 0
            while off + _NLMSG.size <= len(data):
                length, kind = _NLMSG.unpack_from(data, off)[:2]
                # A length below what the message must hold (0 would never move off: an endless loop) or past the
                # datagram (it would read the next message's bytes as this one's): not an answer to trust.
                least = _NLMSG.size + (0 if kind == NLMSG_DONE else 4 if kind == NLMSG_ERROR else _MSG.size)
                if not least <= length <= len(data) - off:
                    raise OSError(errno.EPROTO, f"sock_diag: a message of {length} bytes (type {kind}) where "
                                                f"{least} to {len(data) - off} fit")
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", data, off + _NLMSG.size)[0]
                    raise OSError(err, f"sock_diag: {os.strerror(err)}")
                _fam, state, _t, _r, sport, src, inode = _MSG.unpack_from(data, off + _NLMSG.size)
                if state == 10:  # TCP_LISTEN
                    local = "".join(f"{w:08X}" for w in struct.unpack_from(f"={words}I", src))
                    out.append(Listener(int.from_bytes(sport, "big"), local, inode))
                off += (length + 3) & ~3
            if not data:
                return out


_diag_failed = False  # sock_diag failed once: said in the log then, not on each of discovery's later asks


def own_netns(fs: HostFS) -> bool:
    """Whether /proc/net under the host root is the agent's own network namespace's (the host's /proc, or the
    agent's, rather than a copy of another host's tree): then the kernel's sock_diag answers for it."""
    try:
        return os.stat(fs.path("/proc/self/ns/net")).st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


def listeners(fs: HostFS, pid: int | None = None) -> list[Listener] | None:
    """The listening sockets of pid's network namespace (tcp and tcp6; None: the agent's own), None when its
    /proc entries are gone. The agent's own are asked of the kernel (sock_diag) where it can: the same rows as
    /proc/net/tcp{,6}, without its walk of every established socket's bucket."""
    global _diag_failed
    if pid is None and own_netns(fs):
        try:
            return _diag(socket.AF_INET) + _diag(socket.AF_INET6)
        except (OSError, struct.error) as e:
            # No sock_diag (a kernel without inet_diag), or an answer that does not hold together: the tables, as
            # before. Logged the first time only, as discovery asks every few seconds.
            if not _diag_failed:
                _diag_failed = True
                log.warning("sock_diag failed (%s): the listeners are read from /proc/net/tcp{,6}", e)
    out: list[Listener] = []
    seen = False
    base = "/proc/net" if pid is None else f"/proc/{pid}/net"
    for name in TABLES:
        try:
            with open(fs.path(f"{base}/{name}"), encoding="ascii", errors="replace") as f:
                out.extend(parse(f))
                seen = True
        except OSError:
            continue
    return out if seen else None


def on_ports(fs: HostFS, ports: Iterable[int], pid: int | None = None) -> list[Listener]:
    """The listening sockets on one of ports in pid's network namespace."""
    want = set(ports)
    return [s for s in listeners(fs, pid) or () if s.port in want]


def holders(fs: HostFS, inodes: Iterable[int], pids: Iterable[int], every: bool = False) -> dict[int, list[int]]:
    """Socket inode -> the pids (in the order given) whose fds hold it, among pids. Without `every`, the first
    holder of each is enough, and fds are read no further once each socket has one; with it, every holder (the
    workers of a pre-forking server share its listening socket)."""
    want = set(inodes)
    found: dict[int, list[int]] = {}
    if not want:
        return found  # nothing listens: no process's fds need reading (a few hundred readlinks on a quiet host)
    for pid in pids:
        if not every and not want:
            break
        for fd in fs.listdir(f"/proc/{pid}/fd", proc="fd"):
            target = fs.readlink(f"/proc/{pid}/fd/{fd}", proc="fd")
            if not target or not target.startswith("socket:["):
                continue
            try:
                inode = int(target[8:-1])
            except ValueError:
                continue
            if inode in want:
                if pid not in found.setdefault(inode, []):
                    found[inode].append(pid)
                if not every:
                    want.discard(inode)
    return found


def pids(fs: HostFS) -> list[int]:
    """Every process in the host's /proc, in pid order."""
    return sorted(int(n) for n in fs.listdir("/proc") if n.isdigit())


def _stat_start(stat: str) -> int | None:
    # comm (field 2) may hold spaces and parentheses: the fields after it start after the last ')'.
    tail = stat.rsplit(")", 1)[-1].split()
    try:
        return int(tail[19])
    except (IndexError, ValueError):
        return None


def proc_start(fs: HostFS, pid: int) -> int | None:
    """A process's start time in clock ticks (/proc/PID/stat), which with its pid names it (a reused pid is another
    process); None when it has exited."""
    text = fs.try_read(f"/proc/{pid}/stat")
    return _stat_start(text) if text else None
