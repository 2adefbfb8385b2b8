"""Cgroup paths read from a container's cgroup namespace are rebased on the host's tree (fixture trees)."""

from __future__ import annotations

from pathlib import Path

from qosagent.cgroups import HostCgroups
from qosagent.hostfs import HostFS
from qosagent.placement.config import Selector
from qosagent.placement.discovery import Matcher, discover
from testkit.placement_trees import _write, proc_entry

AGENT = 4242
AGENT_CG = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podagent.slice/cri-containerd-a.scope"
POD = "/kubepods.slice/kubepods-pod2.slice/cri-containerd-v.scope"


def host(tmp_path: Path, init: str, agent: str, vllm: str, agent_listed: bool = True) -> HostFS:
    """A cgroup v2 host: the agent in its own container cgroup, a vLLM process in a pod's, each as the agent reads
    /proc from its own cgroup namespace."""
    _write(tmp_path, "/sys/fs/cgroup/cgroup.controllers", "cpuset cpu memory\n")
    _write(tmp_path, f"/sys/fs/cgroup{AGENT_CG}/cgroup.procs", f"{AGENT}\n" if agent_listed else "1\n")
    _write(tmp_path, f"/sys/fs/cgroup{POD}/cgroup.procs", "777\n")
    _write(tmp_path, f"/sys/fs/cgroup{POD}/cpuset.cpus.effective", "2-3\n")
    _write(tmp_path, "/sys/fs/cgroup/init.scope/cgroup.procs", "1\n")
    proc_entry(tmp_path, 1, ["/sbin/init"], "systemd", init)
    proc_entry(tmp_path, AGENT, ["qosagent", "run"], "qosagent", agent)
    proc_entry(tmp_path, 777, ["python", "-m", "vllm", "serve"], "python", vllm)
    return HostFS(tmp_path)


def test_paths_from_a_container_namespace_are_the_hosts(tmp_path: Path) -> None:
    fs = host(tmp_path, "/../../../../init.scope", "/", "/../../../kubepods-pod2.slice/cri-containerd-v.scope")
    hc = HostCgroups(fs, AGENT)
    procs = discover(fs, Matcher([Selector(cgroup="/kubepods.slice/kubepods-pod2.slice")]), own_pid=AGENT,
                     cgroups=hc)
    assert [(p.pid, p.cgroup, p.cpuset) for p in procs] == [(777, POD, frozenset({2, 3}))]
    assert hc.roots == {"v2": AGENT_CG}
    assert hc.host("v2", "/") == AGENT_CG


def test_in_the_hosts_namespace_paths_are_left_alone(tmp_path: Path) -> None:
    fs = host(tmp_path, "/init.scope", AGENT_CG, POD)
    hc = HostCgroups(fs, AGENT)
    assert hc.host("v2", POD) == POD and hc.roots == {}


def test_a_root_that_cannot_be_found_is_reported_and_paths_stay_as_read(tmp_path: Path) -> None:
    read = "/../../../kubepods-pod2.slice/cri-containerd-v.scope"
    fs = host(tmp_path, "/../../../../init.scope", "/", read, agent_listed=False)
    hc = HostCgroups(fs, AGENT)
    assert hc.host("v2", read) == read
    assert hc.unresolved == {"v2"}
