"""Which process serves a port, and what it is: listening socket → owning process → command line (through HostFS).

Also the host's process table, reduced to what admission needs: the processes of pre-allocating servers, so that
GPU memory is not read as load on GPUs they hold (docs/servers.md).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from qosagent.hostfs import HostFS
from qosagent.servers import kinds

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _address(hexaddr: str) -> str:
    """/proc/net/tcp's address (host-order 32-bit words in hex) as text; where a wildcard listener answers: loopback."""
    raw = bytes.fromhex(hexaddr)
    host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(socket.inet_ntop(socket.AF_INET if len(host) == 4 else socket.AF_INET6, host))
    if addr.is_unspecified:
        return "127.0.0.1"  # a wildcard "::" listener takes IPv4 too unless IPV6_V6ONLY, which servers do not set
    return str(addr)


def listening_inodes(fs: HostFS, ports: set[int]) -> dict[int, tuple[int, str]]:
    """Socket inode -> (port, address to reach it on), for the TCP sockets listening on one of ports."""
    out: dict[int, tuple[int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = fs.try_read(table) or ""
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != LISTEN:
                continue
            try:
                addr, port_hex = cols[1].rsplit(":", 1)
                port, inode = int(port_hex, 16), int(cols[9])
                if port in ports and inode:
                    out[inode] = (port, _address(addr))
            except (IndexError, ValueError, OSError):
                continue
    return out


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    argv: tuple[str, ...]


def processes(fs: HostFS) -> dict[int, Proc]:
    """Every process's parent and command line; kernel threads (no command line) and vanished pids left out."""
    out: dict[int, Proc] = {}
    for name in fs.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = fs.try_read(f"/proc/{name}/stat")
        cmd = fs.try_read(f"/proc/{name}/cmdline")
        if not stat or not cmd:
            continue
        # The command name (2nd field) may hold spaces and parentheses: the fields after its last ')' are fixed.
        rest = stat.rsplit(")", 1)[-1].split()
        try:
            ppid = int(rest[1])
        except (IndexError, ValueError):
            continue
        out[int(name)] = Proc(int(name), ppid, tuple(a for a in cmd.split("\x00") if a))
    return out


def owners(fs: HostFS, inodes: dict[int, tuple[int, str]], procs: dict[int, Proc]) -> dict[int, tuple[int, str]]:
    """Port -> (pid of the process holding its listening socket, its address). Stops reading fds once every socket
    is found."""
    found: dict[int, tuple[int, str]] = {}
    want = dict(inodes)
    for pid in sorted(procs):
        if not want:
            break
        for fd in fs.listdir(f"/proc/{pid}/fd"):
            target = fs.readlink(f"/proc/{pid}/fd/{fd}")
            if not target or not target.startswith("socket:["):
                continue
            try:
                inode = int(target[8:-1])
            except ValueError:
                continue
            where = want.pop(inode, None)
            if where is not None:
                found.setdefault(where[0], (pid, where[1]))
    return found


def children(procs: dict[int, Proc]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for p in procs.values():
        out.setdefault(p.ppid, []).append(p.pid)
    return out


def family(root: int, kids: dict[int, list[int]]) -> frozenset[int]:
    """root and all its descendants (a vLLM API server's engine and worker processes hold the GPUs, not it)."""
    seen = {root}
    stack = [root]
    while stack:
        for c in kids.get(stack.pop(), ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return frozenset(seen)


def server_root(pid: int, procs: dict[int, Proc]) -> int:
    """Up from the listening process while the parent is the same kind of server: TGI's router listens, but the
    shards that hold the GPUs are its launcher's children."""
    me = procs.get(pid)
    k = kinds.from_cmdline(list(me.argv)) if me else None
    while me is not None and k is not None:
        parent = procs.get(me.ppid)
        if parent is None or parent.pid <= 1 or kinds.from_cmdline(list(parent.argv)) != k:
            break
        me = parent
    return me.pid if me is not None else pid


def preallocating_pids(procs: dict[int, Proc]) -> frozenset[int]:
    """Every process of a pre-allocating server on the host: those whose command line names one, and their
    descendants (worker processes started by spawn carry no server name)."""
    kids = children(procs)
    out: set[int] = set()
    for p in procs.values():
        k = kinds.from_cmdline(list(p.argv))
        if k is not None and kinds.kind(k).preallocates and p.pid not in out:
            out |= family(p.pid, kids)
    return frozenset(out)
