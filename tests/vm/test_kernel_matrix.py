"""The kernel matrix: the integration tests that depend on the kernel, run inside a VM booted from each cached
distro kernel (Debian 12's 6.1 by default: kprobe mode, cgroup v2 only) with two NUMA nodes, while the rest of the
suite covers this host's kernel natively. One boot per kernel runs the whole selection (tests/vm/runner.py: KVM
where it works, else TCG); the agent's time to ready and its request counting with idle blocked readers are
measured first.

Slow (minutes under TCG) and privileged: under CI=true a host that cannot boot the VM fails, never skips. Part of
`make test` (collected last), and of `make test-kernels` alone.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import require
from tests.vm import runner

# Per kernel, what depends on it: the latency modes it offers (parametrized by tests/kernel_modes.py), quota's
# classifier (BPF_PROG_TEST_RUN: both programs load and give their verdicts), BPF links on the cgroup2 hierarchy, and
# placement with real migrate_pages between the VM's two NUMA nodes (one node natively). Chosen to fit CI's time
# under TCG, where each BPF compile takes ~30 s. Quota's datapath test (test_quota_netns.py) stays native: it asserts
# rates under floods of 32 threads, which emulation cannot drive.
SELECTION = [
    "tests/integration/test_kernel_modes.py",
    "tests/integration/test_latency_probes.py",
    "tests/integration/test_latency_agent.py::test_per_tenant_latency_matches_the_client",
    "tests/integration/test_latency_agent.py::test_stop_detaches_every_program",
    "tests/integration/test_latency_selftest.py",
    # The egress program (TTFT, inter-token gaps, framing) against a scripted server: counts and reasons, no
    # uvicorn (its start alone takes tens of seconds emulated) and no tight timing.
    "tests/integration/test_latency_streaming.py::test_http10_long_headers_empty_bodies_and_resets_are_counted_never_timed_wrong",
    "tests/integration/test_quota_packets.py::test_ip_options_and_quota_verdicts",
    "tests/integration/test_quota_packets.py::test_header_match_and_header_split_across_segments",
    "tests/integration/test_cgroup_links.py",
    # The two that move memory across nodes; the rest of placement does not depend on the node count.
    "tests/integration/test_placement_apply.py::test_issue_example_pins_every_thread_to_cpu1_and_stop_restores",
    "tests/integration/test_placement_apply.py::test_migrate_pages_moves_memory_across_nodes_or_counts_a_noop_on_one",
]
MEMORY_NODES = 2
# Limits, innermost first, each failing with what the guest was doing rather than hanging CI: one test (pytest-timeout
# in the guest: the test fails with its traceback and the run goes on); the whole guest run (a watchdog in the guest
# prints every process with what it waits on, the kernel's blocked tasks and the pytest process's Python stacks,
# then ends it); the VM itself (the host kills QEMU and fails with the guest's last output).
TEST_TIMEOUT_S = 300
GUEST_TIMEOUT_S = 900
TIMEOUT_S = TEST_TIMEOUT_S + GUEST_TIMEOUT_S + 120  # the ready check, pytest, the boot
# What is known to fail on a kernel, with why. The matrix passes when exactly these fail: a fix shows up as a
# failure of the matrix ("now passes"), so that this list is emptied as the causes are fixed, never left stale.
KNOWN_FAILING: dict[str, dict[str, str]] = {
    # 6.1: none since quota_header loads there and the kprobe clock was measured to be right (docs/PERFORMANCE.md).
}
RESULT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def known_failing(kernel: str) -> dict[str, str]:
    return next((v for prefix, v in KNOWN_FAILING.items() if kernel.startswith(prefix)), {})


def kernels() -> list[str]:
    try:
        return runner.kernels() or ["none cached"]
    except OSError:
        return ["none cached"]


@pytest.mark.kernel_matrix
@pytest.mark.slow
@pytest.mark.privileged
@pytest.mark.parametrize("kernel", kernels())
def test_kernel_matrix(kernel: str, tmp_path: Path) -> None:
    why = runner.missing()
    require(why is None, f"the kernel matrix cannot boot a VM: {why}")
    script = (f"export QOSAGENT_TEST_MEMORY_NODES={MEMORY_NODES}\n"
              f"timeout -s ABRT {TEST_TIMEOUT_S} .venv/bin/python -m tests.vm.agent_ready --mode auto --idle 20 "
              "|| echo 'agent_ready: FAILED'\n"
              + runner.pytest_script(["-v", "--tb=short", "-rfEs", "--durations=12", *SELECTION],
                                     limit_s=GUEST_TIMEOUT_S, test_limit_s=TEST_TIMEOUT_S))
    # Streamed as it comes (seen with pytest -s), and kept whole in a file the failure names.
    r = runner.run(script, kernel=kernel, timeout=TIMEOUT_S, numa=MEMORY_NODES == 2, echo=sys.stdout.write)
    log = tmp_path / f"vm-{r.kernel}.log"
    log.write_text(r.output)
    lines = r.output.splitlines()
    # pytest's own summary of what failed, then the end of the output.
    short = lines[next((i for i, line in enumerate(lines) if "short test summary info" in line), len(lines)):]
    tail = "\n".join(short[:40]) + "\n...\n" + r.output[-6000:]
    boot = f"{r.boot_s:.0f}" if r.boot_s is not None else "-"
    summary = (f"kernel {r.kernel} ({r.accel}): boot {boot} s, total {r.wall_s:.0f} s, exit {r.rc}; "
               f"whole output in {log}")
    print(summary)
    for line in r.output.splitlines():
        if line.startswith("agent_ready "):
            print(line)
    assert not r.timed_out, f"{summary}: timed out\n{tail}"
    assert r.boot_s is not None, f"{summary}: the guest never ran its command\n{tail}"
    ready = [json.loads(line.split(" ", 1)[1]) for line in r.output.splitlines() if line.startswith("agent_ready {")]
    assert ready and ready[0]["requests_counted"] == ready[0]["requests_sent"], f"{summary}\n{tail}"
    # Each selected test's outcome, from pytest -v: the known failures fail, everything else passes, none skips.
    outcomes: dict[str, str] = {}
    for line in lines:
        m = RESULT.match(line)
        if m:
            outcomes[m.group(1)] = "failed" if m.group(2) in ("FAILED", "ERROR") else m.group(2).lower()
    known = known_failing(r.kernel)
    assert outcomes, f"{summary}: no test results\n{tail}"
    unexpected = {t: o for t, o in outcomes.items() if o != ("failed" if t in known else "passed")}
    fixed = [t for t in known if outcomes.get(t) == "passed"]
    assert not fixed, f"{summary}: now passing, remove from KNOWN_FAILING: {fixed}"
    assert not unexpected, f"{summary}: unexpected outcomes {unexpected}\n{tail}"
    assert r.rc == (1 if known else 0), f"{summary}\n{tail}"
