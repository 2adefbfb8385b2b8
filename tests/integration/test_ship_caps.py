"""The unit's CapabilityBoundingSet, with the drop-in `qosagent check --systemd` prints for a config enabling every
capability, is enough, and each capability in it is needed; the shipped unit alone runs the default config
(latency), and a capability it does not grant is unavailable with the setting named. Checked with setpriv, which
applies the same bounding set that systemd would (a root service's effective set is its bounding set)."""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from qosagent import capabilities, sandbox
from qosagent.config import parse
from testkit.agent import TIME_SCALE, AgentProcess

from tests.conftest import netns as make_netns
from tests.conftest import require
from tests.integration.latency_helpers import free_port, serving
from tests.integration.test_latency_probes import Handler, get
from tests.integration.test_ship_systemd import unit_settings

PROBE = textwrap.dedent(r'''
    import os, sys, ctypes
    from bcc import BPF
    what = sys.argv[1]
    if what == "tracepoint":
        b = BPF(text="BPF_ARRAY(n, u64, 1);"
                     "TRACEPOINT_PROBE(sock, inet_sock_set_state) { n.increment(0); return 0; }")
        pin = sys.argv[2]
        from bcc import libbcc
        if libbcc.lib.bpf_obj_pin(b["n"].map_fd, pin.encode()) != 0:
            sys.exit("pin failed: " + os.strerror(ctypes.get_errno()))
        os.unlink(pin)
    elif what == "tc":
        from pyroute2 import IPRoute
        b = BPF(text="#include <uapi/linux/pkt_cls.h>\nint cls(struct __sk_buff *s) { return TC_ACT_UNSPEC; }")
        fn = b.load_func("cls", BPF.SCHED_CLS)
        with IPRoute() as ipr:
            idx = ipr.link_lookup(ifname="lo")[0]
            ipr.tc("add", "clsact", idx)
            ipr.tc("add-filter", "bpf", idx, ":1", fd=fn.fd, name=fn.name, parent="ffff:fff2", classid=1,
                   direct_action=True, prio=1)
            ipr.tc("del", "clsact", idx)
    elif what == "affinity":
        os.sched_setaffinity(int(sys.argv[2]), os.sched_getaffinity(0))
    elif what == "ns":
        os.readlink(f"/proc/{sys.argv[2]}/ns/net")
    elif what == "fd":
        for fd in os.listdir(f"/proc/{sys.argv[2]}/fd"):
            os.readlink(f"/proc/{sys.argv[2]}/fd/{fd}")
    print("ok")
''')


ALL = parse({"quota": {"enabled": True}, "dvfs": {"enabled": True, "mode": "enforce"},
              "placement": {"enabled": True, "mode": "enforce", "selectors": [{"name": "vllm"}]},
              "resources": {"enabled": True, "mode": "enforce"}}, "test")


def unit_caps(dropin: bool = True) -> list[str]:
    """The unit's bounding set, with (dropin) the capabilities the drop-in for every capability adds."""
    granted = list(sandbox.granted_by(unit_settings(), "CapabilityBoundingSet"))
    if dropin:
        dropin = sandbox.dropin(capabilities.sandbox_needs(ALL))
        granted += sandbox.granted_by(sandbox.unit_settings(dropin), "CapabilityBoundingSet")
    return [c.removeprefix("CAP_").lower() for c in granted]


@pytest.fixture
def netns(bpf: None) -> Iterator[str]:
    require(shutil.which("setpriv") is not None and shutil.which("ip") is not None, "setpriv or ip missing")
    with make_netns("ship") as name:
        yield name


@pytest.fixture
def nobody_process():
    """A process of another user, like an inference server the agent pins."""
    p = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def run_with(caps: list[str], netns: str, *args: str) -> subprocess.CompletedProcess[str]:
    bounding = "-all," + ",".join(f"+{c}" for c in caps)
    argv = ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", sys.executable, "-c", PROBE, *args]
    if args[0] == "tc":
        # Only TC needs the namespace (never the host's interfaces). setpriv runs after `ip netns exec` has entered
        # it, so the probe holds only `caps`. Not for tracepoints: `ip netns exec` mounts a fresh /sys without tracefs.
        argv = ["ip", "netns", "exec", netns, *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_unit_capabilities_load_attach_pin_and_pin_cpus(netns: str, nobody_process: int) -> None:
    caps = unit_caps()
    pin = f"/sys/fs/bpf/qosagent-test-{secrets.token_hex(4)}"
    try:
        for args in (("tracepoint", pin), ("tc",), ("affinity", str(nobody_process)), ("ns", str(nobody_process)),
                     ("fd", str(nobody_process))):
            r = run_with(caps, netns, *args)
            assert r.returncode == 0 and r.stdout.strip() == "ok", (args, r.stderr[-2000:])
    finally:
        if os.path.exists(pin):
            os.unlink(pin)


@pytest.mark.parametrize("dropped,probe", [("perfmon", "tracepoint"), ("bpf", "tc"), ("net_admin", "tc"),
                                           ("sys_nice", "affinity"), ("sys_ptrace", "ns"), ("sys_ptrace", "fd"),
                                           ("dac_read_search", "fd")])
def test_each_capability_is_needed(netns: str, nobody_process: int, dropped: str, probe: str) -> None:
    caps = [c for c in unit_caps() if c != dropped]
    extra = {"tracepoint": (f"/sys/fs/bpf/qosagent-test-{secrets.token_hex(4)}",), "tc": (),
             "affinity": (str(nobody_process),), "ns": (str(nobody_process),), "fd": (str(nobody_process),)}[probe]
    r = run_with(caps, netns, probe, *extra)
    assert r.returncode != 0, f"{probe} worked without CAP_{dropped.upper()}"
    # Refused for want of privilege, not for some other reason.
    assert re.search("super-user|not permitted|Permission denied", r.stderr), r.stderr[-2000:]


# The agent's two scans of every process, once each: namespace links (netns) and socket holders (listeners), the
# latter over every pid but those given.
SCAN = ("import os, sys; from qosagent import listeners, netns; from qosagent.hostfs import HostFS; fs = HostFS('/'); "
        "netns.serving_namespaces(fs, [1], os.stat('/proc/self/ns/net').st_ino, False); "
        "skip = {int(p) for p in sys.argv[1:]}; "
        "listeners.holders(fs, [1], [p for p in listeners.pids(fs) if p not in skip]); "
        "print(fs.unreadable['ns_net'], fs.unreadable['fd'])")


def _refused_to_root(pid: int) -> bool:
    """Whether this test's own process (root with every capability it has) is refused pid's namespace or fds."""
    try:
        os.readlink(f"/proc/{pid}/ns/net")
        for fd in os.listdir(f"/proc/{pid}/fd"):
            os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError as e:
        return e.errno in (errno.EACCES, errno.EPERM)
    return False


def test_the_scans_read_every_process_under_the_units_set_and_count_what_less_refuses(root: None,
                                                                                      nobody_process: int) -> None:
    """The real kernel, this host's processes (a nobody one among them): under the unit's set nothing is refused
    that full root may read; under the set the unit had before CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH, every such
    read was, and the scans took each for a process gone; now each is counted. Full root is not the bar everywhere:
    where this test itself runs sandboxed, a supervisor outside the sandbox (its pid 1 on the build machine) is
    refused to any process inside by an LSM, whatever its capabilities; those are left out of the fd scan, and may
    be counted by the namespace scan, at most once each."""
    require(shutil.which("setpriv") is not None, "setpriv missing")
    blind = [p for p in (int(n) for n in os.listdir("/proc") if n.isdigit()) if _refused_to_root(p)]
    assert nobody_process not in blind

    def refused(caps: list[str]) -> tuple[int, int]:
        r = subprocess.run(["setpriv", "--bounding-set=-all," + ",".join(f"+{c}" for c in caps), "--inh-caps=-all",
                            sys.executable, "-c", SCAN, *map(str, blind)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        ns, fd = r.stdout.split()
        return int(ns), int(fd)

    ns, fd = refused(unit_caps(dropin=False))
    assert ns <= len(blind) and fd == 0, (ns, fd, blind)
    ns, fd = refused(["bpf", "perfmon", "net_admin"])
    assert ns > len(blind) and fd >= 1, (ns, fd, blind)


WRITABLE = "import sys; from qosagent import sandbox; print(sandbox.this_process().writable(sys.argv[1]))"


def test_a_read_only_path_is_its_mount_not_a_mode_root_cannot_write_without_dac_override(root: None, tmp_path) -> None:
    """cgroup2's root directory is mode 0555: root under the unit's set (no CAP_DAC_OVERRIDE) may not create in it,
    yet the cgroup files resources writes below it are root's. The sandbox check asks what the unit's settings decide,
    whether the path is mounted read-only: such a directory is writable to it, a read-only bind mount is not."""
    require(shutil.which("setpriv") is not None and shutil.which("unshare") is not None, "setpriv or unshare missing")
    d = tmp_path / "cgroup-root-like"
    d.mkdir()
    d.chmod(0o555)
    setpriv = ["setpriv", "--bounding-set=-all," + ",".join(f"+{c}" for c in unit_caps()), "--inh-caps=-all"]
    check = [*setpriv, sys.executable, "-c", WRITABLE, str(d)]
    r = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "True", r.stdout + r.stderr
    denied = subprocess.run([*setpriv, "touch", str(d / "f")], capture_output=True, text=True, timeout=60)
    assert denied.returncode != 0, "the directory was writable to the unit's set: this test shows nothing"
    # A private mount namespace (unshare's default propagation): the read-only bind mount never reaches the host.
    ro = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" '
                         '&& shift && exec "$@"', "sh", str(d), *check], capture_output=True, text=True, timeout=60)
    assert ro.stdout.strip() == "False", ro.stdout + ro.stderr


def _agent_with_unit_caps(conf, sock, log, prefix: list[str], shell: str = "", dropin: bool = True) -> AgentProcess:
    """The agent under the unit's bounding set (setpriv), behind prefix; optionally set up by shell first."""
    bounding = "-all," + ",".join(f"+{c}" for c in unit_caps(dropin))
    setpriv = ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all"]
    if shell:
        # Set up as full root first (the way systemd mounts bpffs at boot), then drop to the unit's set.
        setpriv = ["sh", "-c", shell + ' && exec "$@"', "sh", *setpriv]
    return AgentProcess(conf, str(sock), log, prefix=[*prefix, *setpriv], args=["--detach-on-exit"])


@pytest.mark.parametrize("mode", ["sockops", "tracepoint"])
def test_latency_runs_with_only_the_units_capabilities(bpf: None, tmp_path, mode: str) -> None:
    """The real agent, not a probe: under the unit's bounding set its latency programs load and attach, in both
    modes (sockops links programs to the cgroup2 root). Without CAP_SYS_ADMIN its self-test cannot run: the first
    requests to a tracked port verify the hooks instead."""
    sock = tmp_path / "status.sock"
    conf = tmp_path / "config.yaml"
    port = free_port()
    conf.write_text(f"metrics: {{enabled: false}}\nstatus: {{socket: {sock}}}\n"
                    f"latency: {{mode: {mode}, ports: [{port}]}}\n")
    with _agent_with_unit_caps(conf, sock, tmp_path / "agent.log", [], dropin=False) as agent, \
            serving((port,), Handler):
        status = agent.status()
        assert status["capabilities"]["latency"]["state"] == "active", status["capabilities"]
        assert status["latency"]["mode"] == mode
        assert re.search(r"hooks not verified at start \(BPF run statistics: .*Operation not permitted\), awaiting "
                         "traffic", status["capabilities"]["latency"]["reason"]), status["capabilities"]["latency"]
        get(port, "127.0.0.1", 3)
        deadline = time.monotonic() + 15 * TIME_SCALE
        while "by traffic" not in (latency := agent.status()["capabilities"]["latency"])["reason"] \
                and time.monotonic() < deadline:
            time.sleep(0.5)
    assert latency["state"] == "active" and re.search(r"hooks verified at \S+Z by traffic \(\d+ connections",
                                                      latency["reason"]), latency
    assert "latency hooks verified at" in agent.output()
    assert agent.proc is not None and agent.proc.returncode == 0, agent.output()[-3000:]


def test_a_capability_the_unit_does_not_grant_is_unavailable_and_named(bpf: None, tmp_path) -> None:
    """placement in enforce under the shipped unit without its drop-in (or a unit an operator cut down): the agent
    says which setting refuses it, and /readyz is not ready."""
    sock = tmp_path / "status.sock"
    conf = tmp_path / "config.yaml"
    port = free_port()
    conf.write_text(f"metrics: {{listen: '127.0.0.1:{port}'}}\nstatus: {{socket: {sock}}}\n"
                    "latency: {enabled: false}\n"
                    "placement: {enabled: true, mode: enforce, selectors: [{name: vllm}]}\n")
    with _agent_with_unit_caps(conf, sock, tmp_path / "agent.log", [], dropin=False) as agent:
        placement = agent.status()["capabilities"]["placement"]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10)
            ready = 200
        except urllib.error.HTTPError as e:
            ready = e.code
    assert placement["state"] == "unavailable", placement
    assert "CapabilityBoundingSet lacks CAP_SYS_NICE" in placement["reason"], placement
    assert ready == 503
    assert "lacks CAP_SYS_NICE" in agent.output()


def test_quota_runs_with_only_the_units_capabilities(netns: str, tmp_path) -> None:
    """The quota classifier attaches, pins and enforces under the unit's set, on the namespace's own lo."""
    sock = tmp_path / "status.sock"
    conf = tmp_path / "config.yaml"
    conf.write_text(f"metrics: {{enabled: false}}\nstatus: {{socket: {sock}}}\nlatency: {{enabled: false}}\n"
                    "quota: {enabled: true, interfaces: [lo]}\n"
                    "tenants: [{name: hobby, tier: bronze, match: {ports: [18002]}, quota: {rps: 5, burst: 2}}]\n")
    # `ip netns exec` gives a private /sys: bpffs is mounted there, and vanishes with the namespace's mounts.
    with _agent_with_unit_caps(conf, sock, tmp_path / "agent.log", ["ip", "netns", "exec", netns],
                               shell="mount -t bpf bpf /sys/fs/bpf") as agent:
        status = agent.status()
        assert status["capabilities"]["quota"]["state"] == "active", status["capabilities"]
    assert agent.proc is not None and agent.proc.returncode == 0, agent.output()[-3000:]
    filters = subprocess.run(["tc", "-n", netns, "filter", "show", "dev", "lo", "ingress"], capture_output=True,
                             text=True).stdout
    assert filters.strip() == "", f"the agent left a filter behind: {filters}"
