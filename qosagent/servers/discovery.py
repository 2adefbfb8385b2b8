"""Which process serves a port, and what it is: listening socket → owning process (qosagent/listeners.py) → command
line (through HostFS).

Also the host's process table, reduced to what admission needs: the processes of pre-allocating servers, so that
GPU memory is not read as load on GPUs they hold (docs/servers.md).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from qosagent import listeners
from qosagent.hostfs import HostFS
from qosagent.servers import kinds


def reach(address: str) -> str:
    """Where to reach a listener bound to address; a wildcard one answers on loopback."""
    addr = ipaddress.ip_address(address)
    if addr.is_unspecified:
        return "127.0.0.1"  # a wildcard "::" listener takes IPv4 too unless IPV6_V6ONLY, which servers do not set
    return str(addr)


def listening_inodes(fs: HostFS, ports: set[int]) -> dict[int, tuple[int, str]]:
    """Socket inode -> (port, address to reach it on), for the TCP sockets listening on one of ports."""
    out: dict[int, tuple[int, str]] = {}
    for s in listeners.on_ports(fs, ports):
        try:
            if s.inode:
                out[s.inode] = (s.port, reach(s.address))
        except (ValueError, OSError):
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
    """Port -> (pid of the process holding its listening socket, its address): the lowest such pid. Stops reading
    fds once every socket is found."""
    held = listeners.holders(fs, inodes, sorted(procs))
    found: dict[int, tuple[int, str]] = {}
    for pid, inode in sorted((pids[0], inode) for inode, pids in held.items()):
        port, address = inodes[inode]
        found.setdefault(port, (pid, address))
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
