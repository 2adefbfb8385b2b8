"""Sockops mode for real: the request-arrival program goes on the cgroup of the process serving a watched port and
nowhere else once the agent has learnt it, a server already running is found by its first request's arrival, the
sock_ops program fires only for the server's sockets, and stop leaves nothing on any cgroup."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import time

import pytest

from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.features import ensure_mounted, probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency import links
from qosagent.latency.capability import Latency
from qosagent.latency.cgroupwatch import CgroupWatch
from qosagent.latency.links import cgroup_root
from qosagent.latency.model import Plan
from tests.conftest import require
from tests.integration.latency_helpers import free_port, until

# One request per connection (HTTP/1.0), each answered after 20 ms.
SERVER = """
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(0.02)
        self.send_response(200); self.send_header("Content-Length", "3"); self.end_headers(); self.wfile.write(b"ok\\n")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def start_server(cgroup: str, port: int) -> subprocess.Popen:
    """The server in its own cgroup, as systemd or a container runtime would run it, listening when this returns."""
    p = subprocess.Popen(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh",
                          sys.executable, "-c", SERVER, str(port)])
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            with open(f"/proc/{p.pid}/net/tcp") as f:
                if any(f":{port:04X} " in line and line.split()[3] == "0A" for line in f):
                    return p
        except OSError:
            pass
        time.sleep(0.02)
    p.kill()
    raise AssertionError("the test server did not listen")


def latency(port: int) -> tuple[Latency, Plan]:
    fs = HostFS("/")
    ensure_mounted(fs)
    cfg = parse({"tenants": [{"name": "svc", "tier": "gold", "match": {"ports": [port]}}],
                 "latency": {"mode": "sockops", "ports": [port], "runqueue": {"enabled": False}}}, "test")
    cap = Latency(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is State.ACTIVE and verdict.plan.mode == "sockops"
    return cap, verdict.plan


def get(port: int) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/")
    assert c.getresponse().read() == b"ok\n"
    c.close()


def programs_on(path: str) -> set[str]:
    require(shutil.which("bpftool") is not None, "bpftool not installed")
    out = subprocess.run(["bpftool", "-j", "cgroup", "show", path], check=True, capture_output=True, text=True).stdout
    return {p["name"] for p in json.loads(out.strip() or "[]")}


def ours(cap: Latency) -> set[str]:
    return {p["name"] for p in cap.programs}


@pytest.mark.privileged
def test_a_server_started_later_is_hooked_on_its_own_cgroup_only(bpf: None, cgroup: str) -> None:
    port = free_port()
    cap, plan = latency(port)
    root = cgroup_root(cap.ctx.hostfs)
    cap.start(plan)
    server = None
    try:
        cap.hooks.watch.stop_learning()  # what the agent does LEARN_S after start: from here on, only serving cgroups
        server = start_server(cgroup, port)
        # listen() reported the server's cgroup: linked before any request is sent.
        assert until(lambda: cap.hooks.watch.cgroups() == [cgroup]), cap.hooks.watch.cgroups()
        assert "lat_ingress" in programs_on(cgroup)
        assert cap.hooks.watch.errors == 0
        assert programs_on(root) & ours(cap) == {"lat_sockops"}  # the client's cgroup (the root) has no ingress
        for _ in range(3):
            get(port)
        t = until(lambda: cap.collect().tenants["svc"], lambda t: t.requests >= 3)
        assert (t.requests, t.connections, t.unpaired, t.headers.count) == (3, 3, 0, 3)
        assert 0.02 <= t.headers.quantile(0.5) <= 0.03
    finally:
        cap.stop()
        if server:
            server.kill()
            server.wait()
    assert not programs_on(cgroup) and not (programs_on(root) & ours(cap))


@pytest.mark.privileged
def test_a_server_running_before_the_agent_is_timed_by_the_learner_from_its_first_request(bpf: None,
                                                                                    cgroup: str) -> None:
    port = free_port()
    server = start_server(cgroup, port)
    cap, plan = latency(port)
    cap.start(plan)
    try:
        get(port)  # its arrival reaches the root learner: timed, and the cgroup reported
        assert until(lambda: cgroup in cap.hooks.watch.cgroups()), cap.hooks.watch.cgroups()
        cap.hooks.watch.stop_learning()
        get(port)  # now through the server's own cgroup only
        t = until(lambda: cap.collect().tenants["svc"], lambda t: t.requests >= 2)
        assert (t.requests, t.connections, t.unpaired, t.headers.count) == (2, 2, 0, 2)
    finally:
        cap.stop()
        server.kill()
        server.wait()
    assert not programs_on(cgroup)


@pytest.mark.privileged
def test_the_learners_alone_time_a_request_to_its_response(bpf: None, cgroup: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """lat_egress_learn runs lat_egress by a tail call (one copy compiled and verified): with the server's cgroup
    never linked, the root's learners alone see the request arrive and its response leave."""
    port = free_port()
    server = start_server(cgroup, port)
    monkeypatch.setattr(CgroupWatch, "link", lambda self, cgid, tgid, path=None: None)
    cap, plan = latency(port)
    cap.start(plan)
    try:
        get(port)
        t = until(lambda: cap.collect().tenants["svc"], lambda t: t.requests >= 1)
        assert (t.requests, t.connections, t.unpaired, t.headers.count) == (1, 1, 0, 1)
        assert 0.02 <= t.headers.quantile(0.5) <= 0.03
        assert cap.hooks.watch.cgroups() == []
        assert cap.collect().hooks.egress_unread == 0 and "tail call" not in cap.verdict.reason, cap.verdict
    finally:
        cap.stop()
        server.kill()
        server.wait()


@pytest.mark.privileged
def test_a_learner_whose_tail_call_fails_is_counted_and_fails_the_self_test(bpf: None, cgroup: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's slot left empty: the kernel still counts the learner's runs, so only the packets it counts as
    unread tell it; the self-test degrades the capability on them, and status and metrics show them."""
    port = free_port()
    server = start_server(cgroup, port)
    monkeypatch.setattr(CgroupWatch, "link", lambda self, cgid, tgid, path=None: None)
    monkeypatch.setattr(links, "load_egress_learn", lambda prog, egress: prog.fd("lat_egress_learn"))  # slot empty
    cap, plan = latency(port)
    cap.start(plan)
    try:
        assert cap.verdict.state is State.DEGRADED and "tail call to lat_egress failed" in cap.verdict.reason, \
            cap.verdict
        before = cap.collect().hooks.egress_unread
        assert before > 0
        get(port)
        after = until(lambda: cap.collect().hooks.egress_unread, lambda n: n > before)
        assert after > before, (before, after)
        t = until(lambda: cap.collect().tenants["svc"], lambda t: t.connections >= 1)
        assert (t.connections, t.requests, t.ttft.count) == (1, 0, 0), t  # its response never seen leave
    finally:
        cap.stop()
        server.kill()
        server.wait()


@pytest.mark.privileged
def test_a_server_listening_before_the_agent_is_hooked_at_start_and_its_first_request_counted(
        bpf: None, cgroup: str) -> None:
    """No listen() to report it, no request while the learner runs: its listening socket names its cgroup."""
    port = free_port()
    server = start_server(cgroup, port)
    cap, plan = latency(port)
    cap.start(plan)
    try:
        cap.hooks.watch.stop_learning()
        assert cap.hooks.watch.cgroups() == [cgroup]
        get(port)
        t = until(lambda: cap.collect().tenants["svc"], lambda t: t.requests >= 1)
        assert (t.requests, t.unpaired, t.headers.count) == (1, 0, 1), t
    finally:
        cap.stop()
        server.kill()
        server.wait()
    assert not programs_on(cgroup)
