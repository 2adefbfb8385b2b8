"""Placement's discovery from inside a cgroup namespace of its own (as the DaemonSet's container runs) finds a
process that sits in another namespace (a pod) by the host's cgroup path, and reads the cpuset its cgroup allows:
cgroup v2 (this host's /sys/fs/cgroup/unified) and the v1 cpuset hierarchy, both namespaced by `unshare -C`."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from typing import Iterator

import pytest

from qosagent.cgroups import hierarchy
from tests.conftest import REPO, require

pytestmark = pytest.mark.privileged
POD_CPU = max(os.sched_getaffinity(0))

DISCOVER = """
import json, os, sys
from qosagent.hostfs import HostFS
from qosagent.cgroups import HostCgroups
from qosagent.placement.config import Selector
from qosagent.placement.discovery import Matcher, discover
fs = HostFS("/")
hc = HostCgroups(fs)
m = Matcher([Selector(cgroup=sys.argv[1])])
procs = discover(fs, m, own_pid=os.getpid(), cgroups=hc)
print(json.dumps({"raw": open(f"/proc/{sys.argv[2]}/cgroup").read(), "roots": hc.roots,
                  "procs": [[p.pid, p.cgroup, sorted(p.cpuset or [])] for p in procs]}))
"""


@pytest.fixture
def trees(root) -> Iterator[dict[str, str]]:
    """/qa-cgns-X/{agent,pod} in the cgroup2 hierarchy and in v1 cpuset (the pod limited to one CPU)."""
    from qosagent.hostfs import HostFS

    fs = HostFS("/")
    v2, cpuset = hierarchy(fs, "v2"), hierarchy(fs, "cpuset")
    require(v2 is not None, "no cgroup2 hierarchy mounted")
    require(shutil.which("unshare") is not None, "unshare missing")
    name = f"qa-cgns-{secrets.token_hex(3)}"
    made: list[str] = []
    try:
        for base in filter(None, (v2, cpuset)):
            for sub in ("", "/agent", "/pod"):
                os.mkdir(f"{base}/{name}{sub}")
                made.append(f"{base}/{name}{sub}")
                if base == cpuset:
                    # v1 cpuset: a cgroup takes tasks only once it has CPUs and memory nodes; the pod gets one CPU.
                    with open(f"{base}/cpuset.mems") as f:
                        mems = f.read().strip()
                    with open(f"{base}/cpuset.cpus") as f:
                        cpus = f.read().strip() if sub != "/pod" else str(POD_CPU)
                    for knob, value in (("cpuset.mems", mems), ("cpuset.cpus", cpus)):
                        with open(f"{base}/{name}{sub}/{knob}", "w") as f:
                            f.write(value)
        yield {"name": name, "v2": v2 or "", "cpuset": cpuset or ""}
    finally:
        for d in reversed(made):
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.1)


def in_cgroups(trees: dict[str, str], sub: str, argv: list[str]) -> list[str]:
    """argv run in /NAME/sub of both hierarchies, in a new cgroup namespace rooted there."""
    enter = " && ".join(f"echo $$ > {trees[k]}/{trees['name']}/{sub}/cgroup.procs" for k in ("v2", "cpuset")
                        if trees[k])
    return ["sh", "-c", f'{enter} && exec unshare -C "$@"', "sh", *argv]


def test_discovery_in_a_cgroup_namespace_sees_a_pods_host_path_and_cpuset(trees):
    pod = subprocess.Popen(in_cgroups(trees, "pod", ["sleep", "60"]))
    try:
        for _ in range(50):  # the shell has moved itself and exec'd unshare, then sleep
            if open(f"/proc/{pod.pid}/comm").read().strip() == "sleep":
                break
            time.sleep(0.05)
        host_path = f"/{trees['name']}/pod"
        out = subprocess.run(in_cgroups(trees, "agent", [sys.executable, "-c", DISCOVER, host_path, str(pod.pid)]),
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        # What the kernel writes for the agent's namespace: relative paths, the selector's prefix nowhere.
        assert "0::/../pod" in got["raw"], got["raw"]
        assert host_path not in got["raw"]
        want_roots = {"v2": f"/{trees['name']}/agent"}
        if trees["cpuset"]:
            want_roots["cpuset"] = f"/{trees['name']}/agent"
            assert "cpuset:/../pod" in got["raw"], got["raw"]
        assert got["roots"] == want_roots
        # Found by its host path; its cpuset (v1 here, the pod's one CPU) read from the host's tree.
        want_cpus = [POD_CPU] if trees["cpuset"] else None
        (proc,) = got["procs"]
        assert proc[:2] == [pod.pid, host_path]
        if want_cpus is not None:
            assert proc[2] == want_cpus
    finally:
        pod.kill()
        pod.wait(10)
