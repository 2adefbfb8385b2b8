"""cgroup links on the real cgroup2 hierarchy: a linked program shows on the cgroup, closing the link removes it,
and a process that dies holding a link leaves nothing attached (the reason for links over BPF_PROG_ATTACH)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

from qosagent.cgroups import CgroupIndex, cgroup2_mount
from qosagent.ebpf.cgrouplinks import CgroupLinks
from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_INGRESS, ATTACH_CGROUP_SOCK_OPS, prog_id
from qosagent.hostfs import HostFS
from tests.conftest import require
from testkit.agent import agent_env

PROG = b"int f(struct __sk_buff *skb) { return 1; }"


@pytest.fixture
def skb_prog(bpf: None) -> Iterator[Any]:
    from bcc import BPF

    b = BPF(text=PROG)
    try:
        yield b.load_func(b"f", BPF.CGROUP_SKB)
    finally:
        b.cleanup()


def attached_ids(path: str) -> set[int]:
    require(shutil.which("bpftool") is not None, "bpftool not installed")
    out = subprocess.run(["bpftool", "-j", "cgroup", "show", path], check=True, capture_output=True, text=True).stdout
    return {int(p["id"]) for p in json.loads(out.strip() or "[]")}


def test_link_shows_on_the_cgroup_until_closed(cgroup: str, skb_prog: Any) -> None:
    pid = prog_id(skb_prog.fd)
    links = CgroupLinks(skb_prog.fd, ATTACH_CGROUP_INET_INGRESS, HostFS("/"))
    try:
        assert links.attach(cgroup) is True
        assert links.attach(cgroup + "/") is False  # the same directory, however spelled
        assert links.paths == [cgroup]
        assert pid in attached_ids(cgroup)
        links.detach(cgroup)
        assert pid not in attached_ids(cgroup)
        links.detach(cgroup)  # absent: no error
        assert links.attach(cgroup) is True
        assert pid in attached_ids(cgroup)
    finally:
        links.close()
    assert links.paths == []
    assert pid not in attached_ids(cgroup)


def test_attach_failure_names_the_path(cgroup: str, skb_prog: Any) -> None:
    links = CgroupLinks(skb_prog.fd, ATTACH_CGROUP_INET_INGRESS, HostFS("/"))
    missing = cgroup + "/not-there"
    with pytest.raises(OSError, match=missing):
        links.attach(missing)
    # A program of the wrong type for the hook: the kernel refuses, and the message still says where.
    wrong_hook = CgroupLinks(skb_prog.fd, ATTACH_CGROUP_SOCK_OPS, HostFS("/"))
    with pytest.raises(OSError, match=cgroup):
        wrong_hook.attach(cgroup)
    assert links.paths == [] and wrong_hook.paths == []


CHILD = """
import sys, time
from qosagent.ebpf.cgrouplinks import CgroupLinks
from qosagent.hostfs import HostFS
CgroupLinks(int(sys.argv[1]), int(sys.argv[2]), HostFS("/")).attach(sys.argv[3])
print("linked", flush=True)
time.sleep(120)
"""


def test_a_killed_holder_leaves_nothing_attached(cgroup: str, skb_prog: Any) -> None:
    pid = prog_id(skb_prog.fd)
    # The child gets our program fd, so it links without compiling; killing it must release only its link.
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(skb_prog.fd), str(ATTACH_CGROUP_INET_INGRESS), cgroup],
                             pass_fds=[skb_prog.fd], stdout=subprocess.PIPE, text=True, env=agent_env())
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "linked"
        assert pid in attached_ids(cgroup)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    # The exiting task's files are released before it can be reaped; a short bounded poll covers a slow release.
    for _ in range(50):
        if pid not in attached_ids(cgroup):
            break
        time.sleep(0.1)
    assert pid not in attached_ids(cgroup), "a killed holder's program stayed attached: not a BPF link?"


def test_index_finds_a_real_cgroup_by_its_id(cgroup: str) -> None:
    fs = HostFS("/")
    mount = cgroup2_mount(fs)
    assert mount is not None
    idx = CgroupIndex(fs, mount)
    assert idx.path_of(os.stat(cgroup).st_ino) == cgroup
    # The root cgroup's id is its directory's inode too.
    assert idx.path_of(os.stat(mount).st_ino) == mount
