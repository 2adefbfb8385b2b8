"""Tenants matched by pod, against a real containerd: the test's own daemon (config, root, state, socket and CNI
config under its tmp dir, in a network namespace of its own standing for the node), real pod sandboxes made through
CRI RunPodSandbox (a kubelet's call: cgroupfs driver, CNI bridge in 198.18.8.0/24), an HTTP server put into each
pod's network namespace and cgroup, and the agent in the node namespace learning the pods from containerd's
socket. Checked: the client's messages against containerd's CRI (Version, ListPodSandbox: READY only, labels), two
pods on one port told apart by their labels and held to their quotas, a runtime that stops answering (pods kept
for pods.stale_after, then unknown), and a host left as it was."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from qosagent.pods.cri import CriClient
from qosagent.status import request
from tests.conftest import require
from tests.integration.netlab import LOAD, Lab
from tests.integration.quota_agent import start_quota_agent

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

SUBNET, NODE = "198.18.8.0/24", "198.18.8.1"  # the CNI bridge's gateway address is the node's


class Node:
    def __init__(self, lab: Lab, tmp: Path):
        from testkit.containerd import Containerd, pause_image

        self.lab, self.tmp = lab, tmp
        self.netns = lab.netns("node")
        self.runtime = Containerd(tmp / "containerd", self.netns, lab.tag, SUBNET)
        try:
            self.runtime.start()
            self.runtime.ctr("images", "import", str(pause_image(tmp)))
        except BaseException:
            self.runtime.close()  # the fixture never gets this Node to close: a started containerd would stay
            raise

    def pod(self, name: str, labels: dict[str, str], namespace: str = "qa") -> tuple[str, str, int]:
        """(uid, address, pause pid) of a new READY pod sandbox."""
        uid = str(uuid.uuid4())
        self.runtime.run_pod(name, uid, namespace, labels)
        pid = self.runtime.sandbox_pid(uid)
        out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-4", "-o", "addr", "show", "eth0"],
                             check=True, capture_output=True, text=True).stdout
        return uid, out.split()[3].split("/")[0], pid

    def serve_in(self, pid: int, addr: str, port: int) -> subprocess.Popen:
        """An HTTP server in the network namespace and the cgroups of pod process pid (as a container of the pod
        would be)."""
        procs = []
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            mount = "unified" if not controllers else controllers.replace("name=", "")
            procs.append(f"/sys/fs/cgroup/{mount}{path}/cgroup.procs")

        def join() -> None:
            for f in procs:
                with open(f, "w") as fh:
                    fh.write(str(os.getpid()))

        p = subprocess.Popen(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, LOAD, "serve", addr,
                              str(port)], stdout=subprocess.PIPE, text=True, preexec_fn=join)
        self.lab.procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p


@pytest.fixture
def node(root, bpf, tmp_path) -> Iterator[Node]:
    require(all(shutil.which(t) for t in ("containerd", "ctr", "runc", "nsenter", "ip")) and
            os.path.exists("/usr/lib/cni/bridge") and os.path.exists("/bin/busybox"),
            "containerd, ctr, runc, the CNI plugins or busybox missing (QOSAGENT_SETUP_TEST=1 scripts/setup.sh)")
    before = sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []
    lab = Lab("podctd")
    n = None
    try:
        n = Node(lab, tmp_path)
        yield n
    finally:
        for a in lab.agents:
            a.kill()
        if n is not None:
            n.runtime.close()
        lab.close()
        shutil.rmtree(f"/sys/fs/bpf/qosagent-test-{lab.tag}", ignore_errors=True)
    # Nothing of containerd's stays: no process, mount, cgroup or network namespace.
    base = str(tmp_path / "containerd")
    assert not [m for m in Path("/proc/mounts").read_text().splitlines() if base in m]
    assert not list(Path("/sys/fs/cgroup").glob(f"*/qa-{lab.tag}"))
    assert (sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []) == before


def test_the_client_reads_ready_pods_from_containerd(node) -> None:
    c = CriClient(node.runtime.socket, 2.0)
    try:
        v = c.version()
        assert v.runtime_name == "containerd" and v.runtime_api_version == "v1", v
        assert c.ready_pods() == []
        uid, _, _ = node.pod("chat-0", {"app": "chat", "example.com/tier": "gold"})
        other, _, _ = node.pod("batch-0", {"app": "batch"}, namespace="jobs")
        pods = {p.uid: p for p in c.ready_pods()}
        assert set(pods) == {uid, other}
        # Their network namespaces are mounted under the runtime's state dir, where its sweep finds them.
        state = f"{node.runtime.base}/state/"
        assert sum(m.split()[1].startswith(state) and "/netns/" in m.split()[1]
                   for m in Path("/proc/mounts").read_text().splitlines()) == 2
        p = pods[uid]
        assert (p.namespace, p.name) == ("qa", "chat-0")
        # containerd adds labels of its own to what the kubelet asked for; ours are all there.
        assert {"app": "chat", "example.com/tier": "gold"}.items() <= dict(p.labels).items()
        # A stopped sandbox is NOTREADY: not listed.
        from testkit.cri import by_sandbox_id

        node.runtime.call("StopPodSandbox", by_sandbox_id(node.runtime.sandboxes[1]))
        assert [q.uid for q in c.ready_pods()] == [uid]
    finally:
        c.close()


def rate(r: dict, frm: float = 1.0) -> float:
    t0 = r["start"] + frm
    return sum(1 for t, _ in r["done"] if t0 <= t < r["end"]) / (r["end"] - t0)


def test_pods_tenants_enforced_by_labels_and_unknown_when_the_runtime_stops_answering(node, tmp_path) -> None:
    chat_uid, chat_ip, chat_pid = node.pod("chat-0", {"app": "chat"})
    _, batch_ip, batch_pid = node.pod("batch-0", {"app": "batch"})
    node.serve_in(chat_pid, chat_ip, 8000)
    node.serve_in(batch_pid, batch_ip, 8000)
    socket, log, conf = str(tmp_path / "status.sock"), tmp_path / "agent.log", tmp_path / "qosagent.yaml"
    conf.write_text(yaml.safe_dump({
        "interval": "100ms", "state_dir": str(tmp_path), "status": {"socket": socket},
        "metrics": {"enabled": False}, "bpf": {"pin_root": f"/sys/fs/bpf/qosagent-test-{node.lab.tag}"},
        "latency": {"enabled": True, "ports": [8000], "runqueue": {"enabled": False}},
        "quota": {"enabled": True, "interfaces": ["lo"]},
        "pods": {"runtime_socket": node.runtime.socket, "refresh": "500ms", "timeout": "300ms",
                 "stale_after": "3s"},
        "tenants": [
            {"name": "chat", "tier": "silver", "match": {"pods": {"namespace": "qa", "labels": {"app": "chat"}}},
             "quota": {"rps": 10, "burst": 5}},
            {"name": "batch", "tier": "bronze", "match": {"pods": {"labels": {"app": "batch"}}, "ports": [8000]},
             "quota": {"rps": 25, "burst": 5}},
        ],
    }))
    agent = start_quota_agent(node.netns, conf, socket, log, ("--detach-on-exit",))
    node.lab.agents.append(agent)

    def quota() -> dict:
        return request(socket, {"cmd": "status"})["quota"]

    def pods() -> dict:
        return request(socket, {"cmd": "status"})["pods"]  # the agent's, not quota's: latency uses them too

    def wait(cond, what: str, timeout: float = 10.0, part=quota) -> dict:
        deadline = time.monotonic() + timeout
        while not cond(q := part()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cond(q), f"{what}: {json.dumps(q, indent=1)}\n{log.read_text()[-3000:]}"
        return q

    q = wait(lambda q: len(q["namespaces"]) == 2 and all(n["tenants"] for n in q["namespaces"]), "two pods")
    by_pod = {n["pod"]: n for n in q["namespaces"]}
    assert by_pod["qa/chat-0"]["tenants"] == {"any": "chat"}
    assert by_pod["qa/batch-0"]["tenants"] == {"8000": "batch"}
    p = pods()
    assert p["known"] and p["ready"] == 2 and p["runtime"].startswith("containerd 1.6"), p
    from qosagent.status import render

    shown = render(request(socket, {"cmd": "status"}))  # what `qosagent status` prints
    assert "pods from containerd 1.6.20" in shown and "2 READY" in shown, shown
    assert "pod qa/chat-0) egress of veth" in shown and ": port any: chat" in shown, shown

    loads = [node.lab.load(node.netns, chat_ip, 8000, NODE, threads=8, duration=8, timeout=15),
             node.lab.load(node.netns, batch_ip, 8000, NODE, threads=16, duration=8, timeout=15)]
    res = [json.loads(p.communicate(timeout=120)[0]) for p in loads]
    chat, batch = rate(res[0]), rate(res[1])
    print(f"chat {chat:.1f}/s of 10, batch {batch:.1f}/s of 25")
    assert 9 <= chat <= 11, chat
    assert 22.5 <= batch <= 27.5, batch
    time.sleep(0.3)
    t = {x["tenant"]: x for x in quota()["tenants"]}
    assert t["chat"]["dropped"] > 0 and t["batch"]["dropped"] > 0
    # Latency tells the pods apart by the same labels (the pod of each namespace as quota found it), by their
    # addresses: every request served is its tenant's, none more than quota admitted.
    lat = request(socket, {"cmd": "status"})["latency"]
    assert {n["pod"]: n["tenants"] for n in lat["namespaces"]} == {"qa/chat-0": {"any": "chat"},
                                                                  "qa/batch-0": {"8000": "batch"}}, lat["namespaces"]
    seen = {x["tenant"]: x["requests"] for x in lat["tenants"]}
    for i, name in enumerate(("chat", "batch")):
        assert len(res[i]["done"]) <= seen[name] <= t[name]["admitted"], (name, seen, t[name])
    assert seen.get("unmatched", 0) == 0, seen

    # containerd stops answering (stopped, not gone): the last list holds for stale_after, then pods are unknown
    # and the pods' namespaces have no tenant; it answers again and they are back.
    assert node.runtime.proc is not None
    os.kill(node.runtime.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)
        assert all(n["tenants"] for n in quota()["namespaces"])  # within stale_after: still enforced
        p = wait(lambda p: not p["known"], "pods unknown", timeout=8, part=pods)
        assert p["errors"] > 0 and "stale_after" in p["reason"]
        wait(lambda q: not any(n["tenants"] for n in q["namespaces"]), "tenants gone with the pods")
    finally:
        os.kill(node.runtime.proc.pid, signal.SIGCONT)
    wait(lambda p: p["known"], "pods known again", part=pods)
    wait(lambda q: all(n["tenants"] for n in q["namespaces"]), "tenants back with the pods")
    text = log.read_text()
    assert "pods: cannot list pods" in text and "answers again" in text
    assert agent.stop() == 0, text


def test_latency_alone_tells_pods_apart_by_labels(node, tmp_path) -> None:
    """Quota off: the agent still lists the pods (its own service, not quota's), and latency attributes each pod's
    requests to its pods tenant by the namespace's address."""
    _, chat_ip, chat_pid = node.pod("chat-0", {"app": "chat"})
    _, batch_ip, batch_pid = node.pod("batch-0", {"app": "batch"})
    node.serve_in(chat_pid, chat_ip, 8000)
    node.serve_in(batch_pid, batch_ip, 8000)
    socket, log, conf = str(tmp_path / "status.sock"), tmp_path / "agent.log", tmp_path / "qosagent.yaml"
    conf.write_text(yaml.safe_dump({
        "interval": "100ms", "state_dir": str(tmp_path), "status": {"socket": socket},
        "metrics": {"enabled": False}, "bpf": {"pin_root": f"/sys/fs/bpf/qosagent-test-{node.lab.tag}"},
        "latency": {"enabled": True, "ports": [8000], "runqueue": {"enabled": False}},
        "quota": {"enabled": False},
        "pods": {"runtime_socket": node.runtime.socket, "refresh": "500ms", "timeout": "300ms"},
        "tenants": [
            {"name": "chat", "tier": "silver", "match": {"pods": {"namespace": "qa", "labels": {"app": "chat"}}}},
            {"name": "batch", "tier": "bronze", "match": {"pods": {"labels": {"app": "batch"}}, "ports": [8000]}},
        ],
    }))
    from testkit.agent import AgentProcess

    agent = AgentProcess(conf, socket, log, prefix=["nsenter", f"--net=/run/netns/{node.netns}"],
                         args=("--detach-on-exit",))
    node.lab.agents.append(agent)
    agent.start()
    deadline = time.monotonic() + 10
    while len((st := request(socket, {"cmd": "status"}))["latency"]["namespaces"]) < 2 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert st["capabilities"]["quota"]["state"] == "disabled", st["capabilities"]
    assert {n["pod"]: n["tenants"] for n in st["latency"]["namespaces"]} == {
        "qa/chat-0": {"any": "chat"}, "qa/batch-0": {"8000": "batch"}}, (st["latency"], log.read_text()[-3000:])
    assert st["pods"]["known"] and st["pods"]["ready"] == 2, st["pods"]
    loads = [node.lab.load(node.netns, chat_ip, 8000, NODE, threads=2, duration=2, timeout=15),
             node.lab.load(node.netns, batch_ip, 8000, NODE, threads=4, duration=2, timeout=15)]
    res = [json.loads(p.communicate(timeout=60)[0]) for p in loads]
    done = {"chat": len(res[0]["done"]), "batch": len(res[1]["done"])}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        seen = {x["tenant"]: x["requests"] for x in request(socket, {"cmd": "status"})["latency"]["tenants"]}
        if all(seen.get(n, 0) >= d for n, d in done.items()):
            break
        time.sleep(0.1)
    assert done["chat"] > 0 and done["batch"] > 0, done
    assert {n: seen.get(n, 0) for n in done} == done and seen.get("unmatched", 0) == 0, (seen, done)
    assert agent.stop() == 0, log.read_text()


def test_a_runtime_that_answers_only_after_the_agent_started_systemd_driver(root, bpf, tmp_path) -> None:
    """No runtime at start: quota runs and says so, the pod's namespace is followed without a tenant; then a runtime
    (the test's own CRI server) answers and the namespace gets its pods tenant. The pod's cgroup is named the
    systemd driver's way (kubepods-besteffort-pod<uid with _>.slice), in the cgroup2 hierarchy."""
    require(importlib.util.find_spec("grpc") is not None, "grpcio missing (make setup-test)")
    from testkit.cri import FakePod, FakeRuntime

    require(all(shutil.which(t) for t in ("ip", "nsenter")), "ip or nsenter missing")
    uid = str(uuid.uuid4())
    v2 = "/sys/fs/cgroup/unified" if os.path.exists("/sys/fs/cgroup/unified/cgroup.procs") else "/sys/fs/cgroup"
    lab = Lab("podlate")
    top = Path(v2) / f"qa-{lab.tag}"
    cg = top / "kubepods.slice/kubepods-besteffort.slice" / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    socket, log, conf = str(tmp_path / "status.sock"), tmp_path / "agent.log", tmp_path / "qosagent.yaml"
    cri_socket = tmp_path / "cri.sock"
    try:
        node, pod = lab.netns("node"), lab.netns("pod")
        lab.veth((node, "pa", "198.18.9.254/24"), (pod, "eth0", "198.18.9.1/24"))
        server = lab.serve(pod, "198.18.9.1", 8000)
        cg.mkdir(parents=True)
        (cg / "cgroup.procs").write_text(str(server.pid))
        conf.write_text(yaml.safe_dump({
            "interval": "100ms", "state_dir": str(tmp_path), "status": {"socket": socket},
            "metrics": {"enabled": False}, "bpf": {"pin_root": f"/sys/fs/bpf/qosagent-test-{lab.tag}"},
            "latency": {"enabled": False, "ports": [8000]}, "quota": {"enabled": True, "interfaces": ["lo"]},
            "pods": {"runtime_socket": str(cri_socket), "refresh": "500ms", "timeout": "300ms"},
            "tenants": [{"name": "chat", "tier": "silver", "match": {"pods": {"labels": {"app": "chat"}}},
                         "quota": {"rps": 10, "burst": 5}}],
        }))
        agent = start_quota_agent(node, conf, socket, log, ("--detach-on-exit",))
        lab.agents.append(agent)
        st = request(socket, {"cmd": "status"})
        assert "no container runtime answers" in st["capabilities"]["quota"]["reason"], st["capabilities"]
        deadline = time.monotonic() + 10
        while not (q := st["quota"])["namespaces"] and time.monotonic() < deadline:
            time.sleep(0.1)
            st = request(socket, {"cmd": "status"})
        (n,) = q["namespaces"]
        assert n["pod"] is None and n["tenants"] == {} and not st["pods"]["known"], st
        with FakeRuntime(str(cri_socket), [FakePod(uid, "qa", "chat-0", {"app": "chat"})]):
            while time.monotonic() < deadline + 10:
                (n,) = request(socket, {"cmd": "status"})["quota"]["namespaces"]
                if n["tenants"]:
                    break
                time.sleep(0.1)
            assert n["pod"] == "qa/chat-0" and n["tenants"] == {"any": "chat"}, (n, log.read_text()[-2000:])
            assert "tenants now port any: chat" in log.read_text()
            # A reload: new pods settings (listed again under them) and a label the pod lacks: no tenant.
            doc = yaml.safe_load(conf.read_text())
            doc["pods"]["refresh"] = "1s"
            doc["tenants"][0]["match"]["pods"]["labels"] = {"app": "other"}
            conf.write_text(yaml.safe_dump(doc))
            assert agent.reload().get("ok"), log.read_text()[-2000:]
            deadline = time.monotonic() + 10
            while (n := request(socket, {"cmd": "status"})["quota"]["namespaces"][0])["tenants"] and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            assert n["tenants"] == {} and n["pod"] == "qa/chat-0", n
            # The source started again with the new refresh says so from its own thread once it has connected
            # (pods/source.py), which may come after the reload moved the tenants: waited for, not read at once.
            while "every 1s" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "every 1s" in log.read_text(), log.read_text()[-2000:]
        assert agent.stop() == 0, log.read_text()
    finally:
        for a in lab.agents:
            a.kill()
        lab.close()
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            if d.exists():
                d.rmdir()
        shutil.rmtree(f"/sys/fs/bpf/qosagent-test-{lab.tag}", ignore_errors=True)
