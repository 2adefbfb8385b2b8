"""The kernel matrix: the integration tests that depend on the kernel, run inside a VM booted from each cached
distro kernel (Debian 12's 6.1 by default: kprobe mode, cgroup v2 only), while the rest of the suite covers this
host's kernel natively. One boot per kernel runs the whole selection (tests/vm/runner.py: KVM where it works,
else TCG); the agent's time to ready and its request counting with idle blocked readers are measured first.

Slow (minutes under TCG) and privileged: under CI=true a host that cannot boot the VM fails, never skips.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import require
from tests.vm import runner

# Per kernel, what depends on it: the latency modes it offers (parametrized by tests/kernel_modes.py), quota's
# classifier (BPF_PROG_TEST_RUN) and datapath (a real agent, real TCP through the TC filter in a namespace), and
# BPF links on the cgroup2 hierarchy. Chosen to fit CI's time under TCG, where each BPF compile takes ~30 s.
SELECTION = [
    "tests/integration/test_kernel_modes.py",
    "tests/integration/test_latency_probes.py",
    "tests/integration/test_latency_agent.py::test_per_tenant_latency_matches_the_client",
    "tests/integration/test_latency_agent.py::test_stop_detaches_every_program",
    "tests/integration/test_quota_packets.py::test_ip_options_and_quota_verdicts",
    "tests/integration/test_quota_packets.py::test_header_match_and_header_split_across_segments",
    "tests/integration/test_quota_netns.py::test_rates_isolation_retransmission_reload_and_stop",
    "tests/integration/test_cgroup_links.py",
]
TIMEOUT_S = 1500


def kernels() -> list[str]:
    try:
        return runner.kernels() or ["none cached"]
    except OSError:
        return ["none cached"]


@pytest.mark.slow
@pytest.mark.privileged
@pytest.mark.parametrize("kernel", kernels())
def test_kernel_matrix(kernel: str) -> None:
    why = runner.missing()
    require(why is None, f"the kernel matrix cannot boot a VM: {why}")
    script = (".venv/bin/python -m tests.vm.agent_ready --mode auto --idle 20 || echo 'agent_ready: FAILED'\n"
              + runner.pytest_script(["-v", "-rfEs", *SELECTION]))
    r = runner.run(script, kernel=kernel, timeout=TIMEOUT_S)
    tail = r.output[-12000:]
    summary = f"kernel {r.kernel} ({r.accel}): boot {r.boot_s} s, total {r.wall_s:.0f} s, exit {r.rc}"
    print(summary)
    for line in r.output.splitlines():
        if line.startswith("agent_ready "):
            print(line)
    assert not r.timed_out, f"{summary}: timed out\n{tail}"
    assert r.boot_s is not None, f"{summary}: the guest never ran its command\n{tail}"
    ready = [json.loads(line.split(" ", 1)[1]) for line in r.output.splitlines() if line.startswith("agent_ready {")]
    assert ready and ready[0]["requests_counted"] == ready[0]["requests_sent"], f"{summary}\n{tail}"
    assert r.rc == 0, f"{summary}\n{tail}"
    # pytest's last line, e.g. "==== 21 passed in 812.40s ====": everything selected ran, nothing was skipped.
    final = [line for line in r.output.splitlines() if re.match(r"=+ .* in [\d.]+s", line)]
    assert final and "passed" in final[-1] and "skipped" not in final[-1], f"{summary}\n{tail}"
