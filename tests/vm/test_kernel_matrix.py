"""The kernel matrix: the integration tests that depend on the kernel, run inside a VM booted from each distro
kernel series of tests/vm/kernels.txt, while the rest of the suite covers this host's kernel natively. One boot per
kernel runs its selection (tests/vm/runner.py: KVM where it works, else TCG); the agent's time to ready and its
request counting with idle blocked readers are measured first.

A series older than the agent runs on (before 5.12: no BPF atomic operations) is booted for its refusal only: the
agent started there exits 4 with one line and leaves nothing behind, and `qosagent check` says the same
(tests/vm/refused_kernel.sh; Debian 11's 5.10: 93 s under TCG, 2026-12-02).

Slow (minutes under TCG) and privileged: under CI=true a host that cannot boot the VM, or a series with no cached
kernel, fails, never skips. Part of `make test` (collected last), and of `make test-kernels` alone.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests import kernel_modes
from tests.conftest import require
from tests.vm import runner

# Per kernel, what depends on it: the latency modes it offers (parametrized by tests/kernel_modes.py), quota's
# classifier (BPF_PROG_TEST_RUN: both programs load and give their verdicts), BPF links on the cgroup2 hierarchy, and
# placement with real migrate_pages between the VM's two NUMA nodes (one node natively). Chosen to fit CI's time
# under TCG, where each BPF compile takes ~30 s. Quota's datapath test (test_quota_netns.py) stays native: it asserts
# rates under floods of 32 threads, which emulation cannot drive.
KERNEL_DEPENDENT = [
    "tests/integration/test_kernel_modes.py",
    "tests/integration/test_latency_probes.py",
    # The run-queue probes by tier: the sched tracepoints and each mode's hook noting the serving process.
    "tests/integration/test_latency_runq_tiers.py",
    # Not the silent-hooks test by traffic: it needs sockops (>= 6.15), which no kernel of the matrix has (its empty
    # parameter set would be a skip, which the matrix fails).
    "tests/integration/test_latency_selftest.py::test_hooks_seen_running_keep_the_verdict",
    "tests/integration/test_latency_selftest.py::test_hooks_that_never_run_are_named_and_degrade",
    "tests/integration/test_latency_selftest.py::test_without_run_statistics_real_traffic_verifies_the_hooks",
    # The egress program (TTFT, inter-token gaps, framing) against a scripted server: counts and reasons, no
    # uvicorn (its start alone takes tens of seconds emulated) and no tight timing.
    "tests/integration/test_latency_streaming.py::test_http10_long_headers_empty_bodies_and_resets_are_counted_never_timed_wrong",
    "tests/integration/test_quota_packets.py::test_ip_options_and_quota_verdicts",
    "tests/integration/test_quota_packets.py::test_header_match_and_header_split_across_segments",
    "tests/integration/test_cgroup_links.py",
]
# One kernel (Debian 12's, the first the matrix had) runs that in every latency mode the kernel offers, and also what
# depends on the VM's shape or on timing more than on the kernel: the agent's quantiles against its clients', the stop
# that detaches every program, and the two placement tests that move memory across the two NUMA nodes. The others
# run it in the mode `latency.mode: auto` picks there (their users' mode; tests/kernel_modes.py's ONLY): each further
# mode or test costs minutes of emulation, and make test must stay under an hour (docs/operations.md has the cost).
FULL = "6.1"
FULL_EXTRA = [
    "tests/integration/test_latency_agent.py::test_per_tenant_latency_matches_the_client",
    "tests/integration/test_latency_agent.py::test_stop_leaves_no_program_attached_and_detach_unloads_them",
    "tests/integration/test_placement_apply.py::test_issue_example_pins_every_thread_to_cpu1_and_stop_restores",
    "tests/integration/test_placement_apply.py::test_migrate_pages_moves_memory_across_nodes_or_counts_a_noop_on_one",
] + [
    # Tier resources on pure cgroup v2 (the guest mounts cgroup2 alone; the host's layout is hybrid v1): v2's files,
    # one directory shared by the cpu and memory controllers, restored on stop, kill -9 and detach, and `qosagent
    # check` naming a group above its memory.high by memory.current (~200 s; the check ~25 s of it). Not the
    # refused write: v2's memory files take any value, so it skips there, and the matrix fails a skip.
    f"tests/integration/test_resources_cgroups.py::{name}" for name in (
        "test_enforce_sets_files_and_hints_every_thread_then_stop_restores",
        "test_dry_run_writes_nothing_and_says_would",
        "test_a_reload_to_dry_run_restores_what_enforce_wrote",
        "test_kill9_then_detach_or_the_next_agent_restores",
        "test_an_explicit_memory_high_is_kept_to_and_v1_derives_no_hard_limit_from_it",
        "test_shared_cgroup_is_reported_or_moved_and_two_tiers_in_one_are_reported",
        "test_a_value_rewritten_by_another_owner_is_left_to_it",
        "test_check_names_a_serving_cgroup_already_above_what_it_would_get_and_writes_nothing",
    )
]
# The series whose selection runs in every latency mode the kernel offers (6.12: tracepoint, `auto`'s, and kprobe);
# any other in `auto`'s mode only.
EVERY_MODE = {FULL, "6.12"}
MEMORY_NODES = 2
# Limits, innermost first, each failing with what the guest was doing rather than hanging CI: one test (pytest-timeout
# in the guest: the test fails with its traceback and the run goes on); the whole guest run (a watchdog in the guest
# prints every process with what it waits on, the kernel's blocked tasks and the pytest process's Python stacks,
# then ends it); the VM itself (the host kills QEMU and fails with the guest's last output).
TEST_TIMEOUT_S = 300
GUEST_TIMEOUT_S = 1200
TIMEOUT_S = TEST_TIMEOUT_S + GUEST_TIMEOUT_S + 120  # the ready check, pytest, the boot
# What is known to fail, per exact kernel version (a new ABI of the same series is a new kernel: it starts with no
# known failures), per test: (text its failure must contain, why it fails). The matrix passes when exactly these fail,
# each with its text: a fix ("now passes"), a known test that no longer runs, or one failing for another reason fails
# the matrix, so that this list is emptied as the causes are fixed, never left stale.
KNOWN_FAILING: dict[str, dict[str, tuple[str, str]]] = {
    # 6.1: none since quota_header loads there and the kprobe clock was measured to be right (docs/PERFORMANCE.md).
}
RESULT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
SUMMARY_ENTRY = re.compile(r"^(FAILED|ERROR) (tests/\S+::\S+)(?: - (.*))?$")


# Left out on the other kernels, each costing ~40 s of BPF compile there for what the ones kept load and check too
# (measured on 6.12: the whole list above in 600 s, this selection in an estimated ~450 s).
NOT_ADDED = [
    "tests/integration/test_latency_probes.py::test_a_request_sent_during_a_response_is_counted_overlapped_not_timed",
    "tests/integration/test_latency_probes.py::test_reload_rewrites_the_tenant_maps_in_place",
    "tests/integration/test_latency_selftest.py::test_hooks_that_never_run_are_named_and_degrade",
    "tests/integration/test_quota_packets.py::test_ip_options_and_quota_verdicts",
]


def selection(series: str) -> list[str]:
    if series == FULL:
        return KERNEL_DEPENDENT + FULL_EXTRA
    # Those inside a file the list names whole are deselected (a node id prefix takes every mode's).
    return [t for t in KERNEL_DEPENDENT if t not in NOT_ADDED] + [f"--deselect={t}" for t in NOT_ADDED
                                                                  if t not in KERNEL_DEPENDENT]


def outcomes_of(output: str) -> tuple[dict[str, str], dict[str, str]]:
    """From pytest -v -rfE output: each test's outcome (passed, failed, skipped...), and each failed test's line in
    the short summary with what follows it up to the next entry (the exception's message; CI=true keeps it whole)."""
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    lines = output.splitlines()
    for line in lines:
        m = RESULT.match(line)
        if m:
            outcomes[m.group(1)] = "failed" if m.group(2) in ("FAILED", "ERROR") else m.group(2).lower()
    start = next((i for i, line in enumerate(lines) if "short test summary info" in line), len(lines))
    current = None
    for line in lines[start + 1:]:
        m = SUMMARY_ENTRY.match(line)
        if m:
            current = m.group(2)
            failures[current] = failures.get(current, "") + (m.group(3) or "")
        elif line.startswith(("=", "qosagent-vm:", runner.KMSG_MARK, runner.HOST_MARK)):
            current = None
        elif current is not None:
            failures[current] += "\n" + line
    return outcomes, failures


def judge(outcomes: dict[str, str], failures: dict[str, str], known: dict[str, tuple[str, str]]) -> list[str]:
    """What is wrong with a kernel's run, given its known failures: empty when exactly those fail, for their reason,
    and everything else passes (nothing skips)."""
    problems = []
    for test, (text, why) in known.items():
        got = outcomes.get(test)
        if got is None:
            problems.append(f"{test}: known to fail ({why}) but did not run: remove it from KNOWN_FAILING or run it")
        elif got == "passed":
            problems.append(f"{test}: now passes, remove it from KNOWN_FAILING ({why})")
        elif got != "failed":
            problems.append(f"{test}: known to fail ({why}) but {got}")
        elif text not in failures.get(test, ""):
            problems.append(f"{test}: fails, but not with the known text {text!r} ({why}): "
                            f"{failures.get(test, '(no summary line)')[:400]}")
    for test, got in outcomes.items():
        if test not in known and got != "passed":
            problems.append(f"{test}: {got}: {failures.get(test, '')[:400]}")
    return problems


# The agent refuses kernels before 5.12 at start (qosagent/ebpf/atomics.py): a series older than that is booted only
# to check the refusal.
RUNS_FROM = (5, 12)
REFUSED_CHECKS = ("run_refused", "check_refused", "no_pins", "nothing_added")
REFUSED_TIMEOUT_S = 600


def refused(series: str) -> bool:
    major, minor = series.split(".")
    return (int(major), int(minor)) < RUNS_FROM


def series_ids() -> list[str]:
    return [s.series for s in runner.matrix() if not refused(s.series)]


def refused_ids() -> list[str]:
    return [s.series for s in runner.matrix() if refused(s.series)]


@pytest.mark.kernel_matrix
@pytest.mark.slow
@pytest.mark.privileged
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("series", series_ids())
def test_kernel_matrix(series: str, tmp_path: Path) -> None:
    kernel, why = runner.cached_kernel(series)
    require(kernel is not None, f"the kernel matrix: {why}")
    assert kernel is not None
    script = (f"export QOSAGENT_TEST_MEMORY_NODES={MEMORY_NODES}\n"
              + ("" if series in EVERY_MODE else f"export {kernel_modes.ONLY}=auto\n")
              + f"timeout -s ABRT {TEST_TIMEOUT_S} .venv/bin/python -m tests.vm.agent_ready --mode auto --idle 20 "
              "|| echo 'agent_ready: FAILED'\n"
              + runner.pytest_script(["-v", "--tb=short", "-rfEs", "--durations=12", *selection(series)],
                                     limit_s=GUEST_TIMEOUT_S, test_limit_s=TEST_TIMEOUT_S))
    # Streamed as it comes (seen with pytest -s), and kept whole in a file the failure names.
    r = runner.run(script, kernel=kernel, timeout=TIMEOUT_S, numa=MEMORY_NODES == 2, echo=sys.stdout.write)
    boot = f"{r.boot_s:.0f}" if r.boot_s is not None else "-"
    summary = r.kept(tmp_path / f"vm-{r.kernel}.log", f", boot {boot} s")
    lines = r.output.splitlines()
    # pytest's own summary of what failed, then the end of the output.
    short = lines[next((i for i, line in enumerate(lines) if "short test summary info" in line), len(lines)):]
    tail = "\n".join(short[:40]) + "\n...\n" + r.output[-6000:]
    for line in r.output.splitlines():
        if line.startswith("agent_ready "):
            print(line)
    assert not r.timed_out, f"{summary}: timed out\n{tail}"
    assert r.boot_s is not None, f"{summary}: the guest never ran its command\n{tail}"
    ready = [json.loads(line.split(" ", 1)[1]) for line in r.output.splitlines() if line.startswith("agent_ready {")]
    assert ready and ready[0]["requests_counted"] == ready[0]["requests_sent"], f"{summary}\n{tail}"
    outcomes, failures = outcomes_of(r.output)
    assert outcomes, f"{summary}: no test results\n{tail}"
    known = KNOWN_FAILING.get(r.kernel, {})
    others = sorted(k for k in KNOWN_FAILING if runner.series_of(k) == series and k != r.kernel)
    problems = judge(outcomes, failures, known)
    assert not problems, (f"{summary}:\n" + "\n".join(problems)
                          + (f"\n(known failures are recorded for {others}, not this {r.kernel})" if others else "")
                          + f"\n{tail}")
    assert r.rc == (1 if known else 0), f"{summary}\n{tail}"


@pytest.mark.kernel_matrix
@pytest.mark.slow
@pytest.mark.privileged
@pytest.mark.timeout(REFUSED_TIMEOUT_S + 60)
@pytest.mark.parametrize("series", refused_ids())
def test_an_older_kernel_is_refused_in_one_line_leaving_nothing(series: str, tmp_path: Path) -> None:
    kernel, why = runner.cached_kernel(series)
    require(kernel is not None, f"the kernel matrix: {why}")
    r = runner.run("bash tests/vm/refused_kernel.sh", kernel=kernel, timeout=REFUSED_TIMEOUT_S,
                   echo=sys.stdout.write)
    summary = r.kept(tmp_path / f"vm-{r.kernel}.log")
    tail = r.output[-6000:]
    assert not r.timed_out, f"{summary}: timed out\n{tail}"
    problems = runner.check_problems(r.output, REFUSED_CHECKS)
    assert not problems, f"{summary}:\n" + "\n".join(problems) + f"\n{tail}"
    assert r.rc == 0, f"{summary}\n{tail}"


@pytest.mark.kernel_matrix
def test_known_failures_name_kernels_the_matrix_boots() -> None:
    """An entry for a kernel the matrix no longer boots (a newer ABI of its series came) is stale: it fails here."""
    require(runner.missing() is None, f"the kernel matrix cannot boot a VM: {runner.missing()}")
    booted = {runner.newest(s.series) for s in runner.matrix()}
    stale = sorted(k for k in KNOWN_FAILING if k not in booted)
    assert not stale, f"KNOWN_FAILING names kernels the matrix does not boot: {stale}; booted: {sorted(booted)}"
