"""`make demo` shows what it promises (latency per tenant, a quota dropping, status) and leaves nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, require


def demo_processes() -> set[int]:
    """The demo's agent (its config is in /tmp/qosagent-demo.XXXXXX) and its traffic processes."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
                if b"/tmp/qosagent-demo." in cmd or b"demo_traffic.py" in cmd:
                    out.add(int(pid))
        except OSError:  # exited while listed
            pass
    return out


@pytest.mark.slow
def test_demo_measures_enforces_and_cleans_up(bpf: None) -> None:
    require(subprocess.run(["ip", "-V"], capture_output=True).returncode == 0, "iproute2 missing")
    env = dict(os.environ, PY=sys.executable, DEMO_SECONDS="4")
    before = demo_processes()
    r = subprocess.run([str(REPO / "scripts" / "demo.sh")], env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    # The agent lives in the demo's namespace, with its pins in that namespace's own bpffs: only its process shows
    # that it was stopped (a stray one keeps its probes attached to the host's tracepoints).
    assert demo_processes() - before == set()
    assert r.returncode == 0, out[-4000:]
    assert re.search(r"^quota\s+active", out, re.M) and re.search(r"^latency\s+active", out, re.M), out[-4000:]
    # The over-quota tenant had requests dropped in the kernel; the one without a quota had none.
    dropped = dict(re.findall(r'qosagent_quota_requests_total\{tenant="(\w+)",tier="\w+",verdict="dropped"\} (\S+)',
                              out))
    assert float(dropped["hobby"]) > 0 and float(dropped["acme"]) == 0, out[-4000:]
    assert re.search(r'qosagent_latency_requests_total\{tenant="acme",tier="gold"\} [1-9]', out), out[-4000:]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "qosagent-demo-" not in netns
    assert not [p for p in os.listdir("/sys/fs/bpf") if p.startswith("qosagent-demo")]
