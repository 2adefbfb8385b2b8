"""Pods tenants' sources, without a real runtime: the wire format, the CRI messages, which pod a cgroup path
belongs to (cgroupfs and systemd drivers), and the pod source against a CRI runtime of the test's own (gRPC on a
unix socket) that fails in each way a real one can: an error status, a hang past the deadline, a reply that is not
protobuf, a socket that is gone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qosagent.cgroups import HostCgroups
from qosagent.hostfs import HostFS
from qosagent.pods import cri, wire
from qosagent.pods.config import PodsConfig
from qosagent.pods.model import Pod, by_cgroup_token, pod_of_cgroup
from qosagent.pods.source import PodSource, pod_of_pid
from tests.conftest import require

UID = "6f1c2a9e-0b7d-4c3e-9a51-2d8e7f40b1aa"


@pytest.mark.parametrize(("n", "enc"), [(0, "00"), (1, "01"), (127, "7f"), (128, "8001"), (300, "ac02"),
                                        (2**63, "80808080808080808001"), (-1, "ffffffffffffffffff01")])
def test_varints_as_protobuf_writes_them(n: int, enc: str) -> None:
    assert wire.varint(n).hex() == enc
    if n >= 0:
        assert list(wire.fields(wire.varint(1 << 3) + wire.varint(n))) == [(1, n)]


def test_fields_skip_fixed_width_and_refuse_what_is_not_protobuf() -> None:
    buf = (wire.varint(2 << 3 | wire.I64) + bytes(8) + wire.varint(3 << 3 | wire.I32) + bytes(4) +
           wire.field_str(4, "x"))
    assert list(wire.fields(buf)) == [(4, b"x")]
    for bad, why in [(b"\x0a\x05ab", "5 bytes announced"), (b"\x08\x80", "truncated varint"),
                     (b"\x0b", "wire type 3"), (b"\x11\x00", "truncated fixed-width"),
                     (b"\x08" + b"\xff" * 11, "longer than ten bytes")]:
        with pytest.raises(wire.WireError, match=why):
            list(wire.fields(bad))


def test_the_ready_filter_and_the_version_request_on_the_wire() -> None:
    # filter (1) { state (2) { state (1) = SANDBOX_READY = 0, left out } }: the empty state message is the filter.
    assert cri.list_ready_request() == bytes.fromhex("0a021200")
    assert cri.version_request() == bytes.fromhex("0a027631")  # version (1) = "v1"


def test_ready_pods_parsed_not_ready_and_uidless_ones_left_out() -> None:
    from testkit.cri import FakePod, pod_sandbox

    pods = [FakePod(UID, "ml", "vllm-0", {"app": "vllm", "pod-template-hash": "abc"}),
            FakePod("u2", "ml", "old", ready=False), FakePod("", "ml", "nouid")]
    buf = b"".join(wire.field_bytes(1, pod_sandbox(p)) for p in pods) + wire.field_str(2, "next-page-token")
    got = cri.parse_ready_pods(buf)
    assert got == [Pod(UID, "ml", "vllm-0")]
    assert dict(got[0].labels) == {"app": "vllm", "pod-template-hash": "abc"}


CGROUPFS = f"/kubepods/burstable/pod{UID}/0123456789abcdef"
SYSTEMD = (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
           "cri-containerd-0123456789abcdef.scope")
GUARANTEED = f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-0123.scope"


@pytest.mark.parametrize("path", [CGROUPFS, SYSTEMD, GUARANTEED])
def test_a_pod_is_found_by_its_cgroup_under_either_driver(path: str) -> None:
    pod, other = Pod(UID, "ml", "vllm-0"), Pod("11111111-2222-3333-4444-555555555555", "ml", "other")
    tokens = by_cgroup_token([other, pod])
    assert pod_of_cgroup(["", path], tokens) is pod
    assert pod_of_cgroup([path.replace(UID[:8], "deadbeef").replace(UID.replace("-", "_")[:8], "deadbeef")],
                         tokens) is None
    assert pod_of_cgroup(["/system.slice/containerd.service", "/user.slice/pod.slice"], tokens) is None


def test_a_process_pod_from_its_host_view_cgroup(tmp_path: Path) -> None:
    """The agent in a cgroup namespace of its own reads the pod's path with leading `..`s; HostCgroups rebases it
    on where the agent's namespace root lies in the host's tree, and the pod is still found by its uid."""
    agent_root = "/kubepods/besteffort/podagent/ctr"
    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/unified/cgroup.controllers").write_text("")
    (tmp_path / f"sys/fs/cgroup/unified{agent_root}").mkdir(parents=True)
    (tmp_path / f"sys/fs/cgroup/unified{agent_root}/cgroup.procs").write_text("42\n")
    for pid, path in [(1, "/../../../../init.scope"), (42, "/"), (77, f"/../../../..{CGROUPFS}")]:
        (tmp_path / f"proc/{pid}").mkdir(parents=True)
        (tmp_path / f"proc/{pid}/cgroup").write_text(f"0::{path}\n")
    fs = HostFS(tmp_path)
    cg = HostCgroups(fs, pid=42)
    pod = Pod(UID, "ml", "vllm-0")
    assert pod_of_pid(fs, cg, 77, by_cgroup_token([pod])) is pod
    assert pod_of_pid(fs, cg, 1, by_cgroup_token([pod])) is None
    assert pod_of_pid(fs, cg, 99, by_cgroup_token([pod])) is None  # exited


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def runtime(tmp_path: Path):
    require(importlib.util.find_spec("grpc") is not None, "grpcio missing (make setup-test)")
    from testkit.cri import FakePod, FakeRuntime

    with FakeRuntime(str(tmp_path / "cri.sock"), [FakePod(UID, "ml", "vllm-0", {"app": "vllm"}),
                                                  FakePod("u2", "ml", "gone", ready=False)]) as rt:
        yield rt


def source(tmp_path: Path, clock: Clock, **kw: object) -> PodSource:
    cfg = PodsConfig(runtime_socket="/cri.sock", refresh="1s", timeout="200ms", stale_after="10s", **kw)
    return PodSource(cfg, HostFS(tmp_path), clock)


def test_pods_listed_kept_while_the_runtime_fails_then_unknown(runtime, tmp_path: Path, caplog) -> None:
    caplog.set_level("INFO", "qosagent.pods")
    clock = Clock()
    src = source(tmp_path, clock)
    assert src.view().pods is None and src.view().reason == "not listed yet"
    src.refresh()
    v = src.view()
    assert list(v.pods or {}) == [UID] and v.runtime == "fakeruntime 9.9 (CRI v1) at /cri.sock" and v.errors == 0
    assert [n for n, _ in runtime.requests] == ["Version", "ListPodSandbox"]
    assert runtime.requests[1][1] == cri.list_ready_request()

    for mode in ("error", "hang", "garbage"):
        runtime.mode = mode
        clock.t += 3
        src.refresh()  # never raises: counted, and the last list still holds
        assert src.view().pods is not None, mode
    v = src.view()
    assert v.errors == 3 and v.age == 9
    assert "UNAVAILABLE: runtime restarting" in caplog.text  # the first of the streak is logged
    assert "DEADLINE_EXCEEDED" in v.reason or "not a CRI answer" in v.reason
    assert caplog.text.count("cannot list pods") == 1
    clock.t += 2
    v = src.view()
    assert v.pods is None and "11s old" in v.reason  # past stale_after: unknown, never a wrong pod

    runtime.mode = "ok"
    src.refresh()
    assert src.view().pods is not None and "answers again" in caplog.text
    src.stop()


def test_the_thread_lists_on_its_own_and_stops(runtime, tmp_path: Path) -> None:
    import time

    src = source(tmp_path, Clock())
    src.start()
    deadline = time.monotonic() + 5
    while src.view().pods is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert src.view().pods is not None
    src.stop(wait=True)
    assert src._thread is not None and not src._thread.is_alive() and src._client is None


def test_no_runtime_names_every_socket_tried(tmp_path: Path) -> None:
    require(importlib.util.find_spec("grpc") is not None, "grpcio missing (make setup-test)")
    (tmp_path / "run/crio").mkdir(parents=True)
    (tmp_path / "run/crio/crio.sock").write_text("")  # a file where the socket should be
    runtime, why = cri.find_runtime(HostFS(tmp_path), None, 0.2)
    assert runtime is None
    assert why.startswith("no container runtime answers: /run/containerd/containerd.sock: absent; Version on "
                          "/run/crio/crio.sock: UNAVAILABLE"), why


@pytest.mark.parametrize("caps", ["quota: {enabled: true, interfaces: [lo]}\nlatency: {enabled: false, ports: [8000]}",
                                  "quota: {enabled: false}\nlatency: {enabled: true, ports: [8000]}"])
def test_check_fails_with_pods_tenants_and_no_runtime(tmp_path: Path, caps: str) -> None:
    """Whichever of quota and latency would use the pods."""
    from click.testing import CliRunner

    from qosagent.cli import main

    conf = tmp_path / "c.yaml"
    conf.write_text(f"{caps}\n"
                    "tenants:\n- {name: a, tier: gold, match: {pods: {namespace: ml}}, quota: {rps: 5}}\n"
                    "pods: {runtime_socket: /run/nothing.sock}\n")
    r = CliRunner().invoke(main, ["check", "--config", str(conf), "--host-root", str(tmp_path)])
    assert r.exit_code == 1, r.output
    assert ("tenants[0] match pods, which the agent learns from the container runtime's CRI socket: no container "
            "runtime answers: /run/nothing.sock: absent") in r.output


PODS = {"runtime": "containerd 1.6.20 (CRI v1) at /run/containerd/containerd.sock", "known": True, "ready": 2,
        "age_s": 0.5, "errors": 3, "reason": ""}


def test_status_shows_the_runtime_and_each_namespace_pod() -> None:
    from qosagent.quota.capability import Quota
    from qosagent.status import render

    st = {"interfaces": ["lo"], "pins": "/p", "unmatched_packets": 0, "tenants": [],
          "namespaces": [{"netns": 4026532, "pid": 7, "ports": [8000], "egress": ["veth1"], "pod": "ml/vllm-0",
                          "tenants": {"any": "chat"}},
                         {"netns": 4026533, "pid": 8, "ports": [8000], "egress": ["veth2"], "pod": None,
                          "tenants": {}}]}
    text = Quota.render(st)
    assert "  netns 4026532 (pid 7, ports 8000, pod ml/vllm-0) egress of veth1: port any: chat" in text
    assert "  netns 4026533 (pid 8, ports 8000) egress of veth2: tenants by port and CIDR" in text
    # The runtime's view is the agent's, not quota's: shown with quota off too.
    agent = {"time": 0, "capabilities": {"quota": {"state": "disabled"}}, "pods": PODS}
    assert ("\npods from containerd 1.6.20 (CRI v1) at /run/containerd/containerd.sock: 2 READY, listed 0.5s ago; "
            "3 failed listings") in render(agent)
    agent["pods"] = {**PODS, "known": False, "ready": None, "reason": "the last list is 31s old"}
    assert "unknown (the last list is 31s old); 3 failed listings" in render(agent)
    assert "pods from" not in render({"time": 0})


def test_pods_metrics_pass_promtool() -> None:
    import shutil
    import subprocess

    from prometheus_client import CollectorRegistry, generate_latest

    from qosagent.pods import service

    def scrape(st: dict | None, deprecated: bool = True) -> str:
        class C:
            def collect(self):
                return service.metrics(st, deprecated)

        reg = CollectorRegistry(auto_describe=False)
        reg.register(C())  # type: ignore[arg-type]
        return generate_latest(reg).decode()

    text = scrape(PODS)
    assert "qosagent_pods_list_errors_total 3.0" in text
    assert "qosagent_pods_list_age_seconds 0.5" in text
    # The names of when quota listed the pods, as deprecated copies until metrics.deprecated_names is off.
    assert "qosagent_quota_pods_list_errors_total 3.0" in text and "qosagent_quota_pods_list_age_seconds 0.5" in text
    assert "# HELP qosagent_quota_pods_list_errors_total Deprecated: the name of qosagent_pods_list_errors" in text
    assert "quota_pods" not in scrape(PODS, deprecated=False)
    assert scrape(None) == ""  # no pods tenant: no pods metrics
    assert "pods_list_age" not in scrape({**PODS, "age_s": None})  # never listed
    if shutil.which("promtool"):
        out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_an_unexpected_error_is_counted_and_the_listing_goes_on(runtime, tmp_path: Path, caplog) -> None:
    """grpc raises ValueError, not an RpcError, on a closed channel: that must not end the pods thread."""
    clock = Clock()
    src = source(tmp_path, clock)
    src.refresh()
    assert src._client is not None
    src._client.close()
    src.refresh()  # never raises
    v = src.view()
    assert v.errors == 1 and v.pods is not None and "listing pods: ValueError" in v.reason, v
    assert src._client is None
    src.refresh()  # connects afresh
    assert src.view().reason == "" and src._client is not None
    src.stop()


def test_a_refresh_that_ends_after_stop_leaves_no_client(runtime, tmp_path: Path) -> None:
    src = source(tmp_path, Clock())
    src.stop()  # as when stop()'s wait for the thread ran out while it was still connecting
    src.refresh()
    assert src.view().pods is not None and src._client is None


def test_a_new_source_starts_from_the_last_list_and_keeps_counting_errors(runtime, tmp_path: Path) -> None:
    clock = Clock()
    old = source(tmp_path, clock)
    old.refresh()
    runtime.mode = "error"
    old.refresh()
    old.stop()
    clock.t += 4
    new = PodSource(PodsConfig(runtime_socket="/cri.sock", refresh="2s", timeout="200ms", stale_after="10s"),
                    HostFS(tmp_path), clock, after=old)
    v = new.view()  # before it lists: the last list with its age, which stale_after still bounds
    assert list(v.pods or {}) == [UID] and v.age == 4 and v.errors == 1 and "runtime restarting" in v.reason
    new.refresh()
    assert new.view().errors == 2  # a counter: never back to zero because the source was replaced
    clock.t += 7
    assert new.view().pods is None  # 11s old: unknown, as it would have been without the reload
    other = PodSource(PodsConfig(runtime_socket="/other.sock"), HostFS(tmp_path), clock, after=new)
    assert other.view().pods is None and other.view().errors == 2  # another socket's pods are not carried
    new.stop()


def test_a_reload_never_waits_on_a_hung_runtime_nor_forgets_the_pods(runtime, tmp_path: Path) -> None:
    """After a reload the first follow takes the previous list while the new source connects on its thread, and
    each thread closes its own channel."""
    import threading

    from qosagent.pods.service import Pods

    def pods_config(refresh: str) -> PodsConfig:
        # A deadline far longer than the guard below: a tick that waited on the runtime is caught, not raced.
        return PodsConfig(runtime_socket="/cri.sock", refresh=refresh, timeout="20s", stale_after="60s")

    clock = Clock()
    p = Pods(HostFS(tmp_path), clock)
    assert list(p.current(True, pods_config("20s"), starting=True).pods or {}) == [UID]  # type: ignore[union-attr]
    old = p.source
    assert old is not None
    # start listed already: the thread's own first list is a refresh (20s) away, so it is not racing this test.
    runtime.mode = "error"
    old.refresh()
    runtime.mode, runtime.hang = "hang", 120.0  # answers only when the test releases it
    done = threading.Event()
    views = []

    def tick() -> None:
        views.append(p.current(True, pods_config("30s")))  # the first follow after a reload with new pods settings
        done.set()

    threading.Thread(target=tick, daemon=True).start()
    try:
        assert done.wait(10), "the tick waited on the runtime"
        (v,) = views
        assert v is not None and list(v.pods or {}) == [UID] and v.errors == 1
        assert p.source is not None and p.source is not old and p.source.cfg.refresh == 30
    finally:
        runtime._release.set()
    p.stop(wait=True)
    assert old._thread is not None and p._before is not None and p._before._thread is not None
    old._thread.join(30)
    assert not old._thread.is_alive() and not p._before._thread.is_alive()
    assert old._client is None and p._before._client is None


def test_one_listing_serves_every_capability_and_matches_each_namespace_once(runtime, tmp_path: Path) -> None:
    """services["pods"]: quota and latency share one source and one cgroup reading per namespace and listing; the
    source stops with the last pods tenant and a later one starts from its list."""
    from qosagent.netns import ServingNs
    from qosagent.pods import service
    from qosagent.services import shared

    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/unified/cgroup.controllers").write_text("")
    (tmp_path / "proc/77").mkdir(parents=True)
    (tmp_path / "proc/77/cgroup").write_text(f"0::{CGROUPFS}\n")
    (tmp_path / "proc/88").mkdir(parents=True)
    (tmp_path / "proc/88/cgroup").write_text("0::/system.slice/nginx.service\n")
    services: dict = {}
    clock = Clock()
    cfg = PodsConfig(runtime_socket="/cri.sock", refresh="20s", timeout="1s", stale_after="60s")
    quota = shared(services, service.Pods, HostFS(tmp_path), clock)
    latency = shared(services, service.Pods, HostFS(tmp_path), clock)
    assert quota is latency and services["pods"] is quota
    pod_ns, host_ns = ServingNs(1, 77, frozenset({8000})), ServingNs(2, 88, frozenset({8000}))
    try:
        assert quota.pod_of(pod_ns) is None  # nothing listed: no pod, no error
        quota.current(True, cfg, starting=True)
        lists = sum(n == "ListPodSandbox" for n, _ in runtime.requests)
        assert lists >= 1
        pod = quota.pod_of(pod_ns)
        assert pod is not None and pod.ref == "ml/vllm-0" and pod.labels == {"app": "vllm"}
        assert quota.pod_of(host_ns) is None
        (tmp_path / "proc/77/cgroup").write_text("0::/elsewhere\n")  # read once per listing: not again
        latency.current(True, cfg)
        assert latency.pod_of(pod_ns) is pod
        assert latency.collect() == {**(quota.collect() or {}), "ready": 1, "known": True}
        assert latency.source is quota.source  # one source: the runtime is asked once, not per capability
        first = quota.source
        assert quota.current(False, cfg) is None and quota.source is None and quota.pod_of(pod_ns) is None
        v = quota.current(True, cfg)  # a pods tenant back (a reload): the last list, before this one lists
        assert v is not None and list(v.pods or {}) == [UID] and quota.source is not first
    finally:
        quota.stop(wait=True)


def test_stop_does_not_wait_for_a_call_in_flight_and_the_thread_closes_its_channel(runtime, tmp_path: Path) -> None:
    import threading
    import time

    runtime.mode, runtime.hang = "hang", 120.0
    src = PodSource(PodsConfig(runtime_socket="/cri.sock", refresh="20s", timeout="20s", stale_after="60s"),
                    HostFS(tmp_path), Clock())
    src.start()
    deadline = time.monotonic() + 10
    while not runtime.requests and time.monotonic() < deadline:
        time.sleep(0.02)  # until the thread's first call hangs in the runtime
    assert runtime.requests
    stopped = threading.Event()
    threading.Thread(target=lambda: (src.stop(), stopped.set()), daemon=True).start()
    try:
        assert stopped.wait(10), "stop() waited for the hung call (deadline 20s)"
        assert src._thread is not None and src._thread.is_alive()  # still in its call: nobody waited for it
    finally:
        runtime._release.set()
    src._thread.join(30)
    assert not src._thread.is_alive() and src._client is None
