"""Who listens on a port, through HostFS: the listening TCP sockets of a network namespace (/proc/PID/net/tcp{,6};
/proc/net/tcp{,6} for the agent's own), and the processes that hold them (/proc/PID/fd links name a socket by inode).
One reader for every capability that asks: quota's interfaces, latency's serving cgroups, server discovery and the
serving network namespaces.

Only listeners are read: the kernel lists them before every other socket, so the first row in another state ends
them, and a busy server's thousands of connections are never read (reading them all cost ~13 ms for 2 800 sockets
here). Rows are read as the kernel writes them, not the whole table first.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Iterable, Iterator

from qosagent.hostfs import HostFS

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


def listeners(fs: HostFS, pid: int | None = None) -> list[Listener] | None:
    """The listening sockets of pid's network namespace (tcp and tcp6; None: the agent's own), None when its
    /proc entries are gone."""
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
