"""The classifier on clsact ingress (and egress of host-side veths) through pyroute2, under the agent's own prio
and handle.

Only what qosagent created is ever replaced or deleted: its filter (prio, handle and name all match) and a clsact
qdisc it created itself. Everything else on the hook is reported, never touched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyroute2 import IPRoute as _IPRoute


def IPRoute() -> "_IPRoute":  # noqa: N802 - stands in for the class it returns
    """A netlink socket. pyroute2 is imported on first use: it costs ~20 MB and ~0.25 s, which an agent with quota
    disabled should not pay."""
    from pyroute2 import IPRoute as ipr

    return ipr()


# rtnetlink's multicast group of link notifications (RTMGRP_LINK, linux/rtnetlink.h).
_RTMGRP_LINK = 1


class Links:
    """The links of the agent's namespace, through one netlink socket kept while quota runs (opening pyroute2's
    costs ~0.3 ms and listing the links ~1 ms here: most of what following namespaces once a second cost), listed
    again only after the kernel announced a change on a second socket subscribed to link notifications (a veth
    made for a pod or gone with it, an interface made again with another index). `gen` moves with each change;
    what was worked out of the links holds while it stands."""

    def __init__(self) -> None:
        self.ipr = IPRoute()
        self._events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                     socket.NETLINK_ROUTE)
        self._events.bind((0, _RTMGRP_LINK))
        self.gen = 0
        self._settling = False
        self._listed = -1
        self._links: list[Any] = []
        self._peered = False

    def poll(self) -> int:
        """Read what the kernel announced since the last poll: gen moves when anything came, and once more at the
        next poll, because a link moved into another namespace is announced gone before its peer shows the move (a
        listing in between would see the veth leading nowhere)."""
        came = False
        while True:
            try:
                if not self._events.recv(65536):
                    break
                came = True
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                came = True  # the socket overflowed: what was lost can only have been changes
        if came or self._settling:
            self.gen += 1
        self._settling = came
        return self.gen

    def links(self) -> list[Any]:
        """Every link as of the last poll (listed once per gen)."""
        if self._listed != self.gen:
            self._links = self.ipr.get_links()
            self._peered = any(link.get_attr("IFLA_LINK_NETNSID") is not None for link in self._links)
            self._listed = self.gen
        return self._links

    def peered(self) -> bool:
        """Whether any link leads into another namespace (a veth whose peer lies there: its IFLA_LINK_NETNSID)."""
        self.links()
        return self._peered

    def close(self) -> None:
        self._events.close()
        self.ipr.close()


def _netlink_error() -> type[Exception]:
    from pyroute2.netlink.exceptions import NetlinkError

    return NetlinkError

INGRESS = "ffff:fff2"
INGRESS_ID = 0xFFFFFFF2
# The egress of a host-side veth: what leaves it enters the serving namespace at its other end.
EGRESS = "ffff:fff3"
EGRESS_ID = 0xFFFFFFF3
HOOKS = {INGRESS_ID: (INGRESS, "ingress"), EGRESS_ID: (EGRESS, "egress")}
FILTER_NAME = "qosagent-quota"


def netns_ino() -> int:
    return os.stat("/proc/self/ns/net").st_ino & 0xFFFFFFFF


@dataclass(frozen=True)
class Hooked:
    """A filter on an ingress hook (ours or someone else's)."""

    ifname: str
    prio: int
    handle: int
    kind: str
    name: str
    hook: str = "ingress"

    def __str__(self) -> str:
        return f"{self.ifname} {self.hook} pref {self.prio} handle {self.handle:#x} {self.kind} {self.name}".rstrip()


def ifindex(ipr: "_IPRoute", name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return found[0] if found else None


def ingress_filters(ipr: "_IPRoute", idx: int, ifname: str, parent_id: int = INGRESS_ID) -> list[Hooked]:
    """The filters on one hook of an interface (ingress unless parent_id says egress)."""
    out = []
    try:
        msgs = ipr.get_filters(index=idx, parent=parent_id)
    except _netlink_error() as e:
        if e.code in (errno.EINVAL, errno.ENOENT):  # no clsact/ingress qdisc: nothing hooked
            return []
        raise
    for f in msgs:
        if not f.get("handle"):
            continue  # the chain/prio header the kernel lists before the filters
        opts = f.get_attr("TCA_OPTIONS")
        name = (opts.get_attr("TCA_BPF_NAME") if opts is not None and hasattr(opts, "get_attr") else None) or ""
        out.append(Hooked(ifname, f["info"] >> 16, f["handle"], f.get_attr("TCA_KIND") or "?", name,
                          HOOKS[parent_id][1]))
    return out


def is_ours(h: Hooked, prio: int, handle: int) -> bool:
    return h.prio == prio and h.handle == handle and h.kind == "bpf" and h.name == FILTER_NAME


def ensure_clsact(ipr: "_IPRoute", idx: int) -> bool:
    """Add clsact; True when we created it. An existing one (EEXIST) belongs to someone else."""
    try:
        ipr.tc("add", "clsact", idx)
        return True
    except _netlink_error() as e:
        if e.code == errno.EEXIST:
            return False
        raise


def attach(ipr: "_IPRoute", idx: int, prog_fd: int, prio: int, handle: int, parent: str = INGRESS) -> None:
    """Put our program in place, replacing only our own filter (an adopted one keeps its place: no second filter)."""
    ipr.tc("replace-filter", "bpf", idx, handle, fd=prog_fd, name=FILTER_NAME, parent=parent, classid=1,
           direct_action=True, prio=prio)


def remove(ipr: "_IPRoute", idx: int, ifname: str, prio: int, handle: int, created_clsact: bool) -> list[str]:
    """Remove our filter from either hook (checked by prio, handle and name) and a clsact we created, if nothing else
    sits on it."""
    done = []
    for parent_id, (parent, _) in HOOKS.items():
        for h in ingress_filters(ipr, idx, ifname, parent_id):
            if is_ours(h, prio, handle):
                ipr.tc("del-filter", "bpf", idx, handle, parent=parent, prio=prio)
                done.append(f"removed filter {h}")
    if created_clsact:
        others = [h for parent_id in HOOKS for h in ingress_filters(ipr, idx, ifname, parent_id)]
        if others:
            done.append(f"kept clsact on {ifname}: other filters sit on it ({'; '.join(map(str, others))})")
        else:
            try:
                ipr.tc("del", "clsact", idx)
                done.append(f"removed clsact qdisc on {ifname} (qosagent created it)")
            except _netlink_error() as e:
                if e.code not in (errno.EINVAL, errno.ENOENT):
                    raise
    return done


def tcx_programs(ifname: str) -> list[str]:
    """TCX ingress programs on an interface (kernels >= 6.6 run them before cls_bpf), from bpftool; [] if unknown."""
    if not shutil.which("bpftool"):
        return []
    try:
        out = subprocess.run(["bpftool", "-j", "net", "show", "dev", ifname], capture_output=True, text=True,
                             timeout=5, check=True).stdout
        data: Any = json.loads(out or "[]")
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    progs = []
    for section in data if isinstance(data, list) else [data]:
        for entry in section.get("tcx", []) if isinstance(section, dict) else []:
            if entry.get("kind", "").endswith("ingress"):
                progs.append(f"{ifname} tcx ingress prog {entry.get('name', '?')} id {entry.get('prog_id', '?')}")
    return progs
