"""The kernel matrix's verdict on one kernel's run (tests/vm/test_kernel_matrix.py), on pytest output as the VM
prints it: known failures match by exact kernel and by their failure text, and anything else fails the matrix."""

from __future__ import annotations

from tests.vm import runner
from tests.vm.test_kernel_matrix import KNOWN_FAILING, judge, outcomes_of, refused, refused_ids, series_ids

A = "tests/integration/test_a.py::test_one[kprobe]"
B = "tests/integration/test_b.py::test_two"
OUTPUT = f"""\
qosagent-vm: up 12.3
{A} PASSED                                                   [ 50%]
{B} FAILED                                                   [100%]
=========================== short test summary info ============================
FAILED {B} - AssertionError: quota unavailable: verifier said EACCES
  at quota_header
======================== 1 failed, 1 passed in 12.00s ========================
"""
KNOWN_B = {B: ("verifier said EACCES", "the header scan is refused on this kernel")}


def test_outcomes_and_the_failure_text_with_its_continuation_lines() -> None:
    outcomes, failures = outcomes_of(OUTPUT)
    assert outcomes == {A: "passed", B: "failed"}
    assert failures == {B: "AssertionError: quota unavailable: verifier said EACCES\n  at quota_header"}


def test_a_guest_killed_in_its_summary_keeps_the_kernels_and_hosts_lines_out_of_the_failure_text() -> None:
    cut = OUTPUT[:OUTPUT.index("=" * 24 + " 1 failed")]  # no closing "=" line: the guest died in the summary
    killed = (cut + "".join(runner._kmsg_lines(["[ 99.1] watchdog: BUG: soft lockup - CPU#1 stuck for 26s!"]))
              + f"{runner.HOST_MARK}load average 2.00 at start, 9.00 8.00 7.00 at end\n")
    assert outcomes_of(killed)[1] == {B: "AssertionError: quota unavailable: verifier said EACCES\n  at quota_header"}


def test_a_storm_of_kernel_reports_keeps_its_first_and_last_lines() -> None:
    lines = runner._kmsg_lines([f"line {i}" for i in range(1000)])
    assert len(lines) == runner.KMSG_HEAD + 1 + runner.KMSG_TAIL
    assert lines[0] == f"{runner.KMSG_MARK}line 0\n" and lines[-1] == f"{runner.KMSG_MARK}line 999\n"
    assert f"({1000 - runner.KMSG_HEAD - runner.KMSG_TAIL} lines left out)" in lines[runner.KMSG_HEAD]


def test_exactly_the_known_failure_with_its_text_passes() -> None:
    assert judge(*outcomes_of(OUTPUT), KNOWN_B) == []


def test_a_known_failure_for_another_reason_fails() -> None:
    (problem,) = judge(*outcomes_of(OUTPUT), {B: ("invalid access to map value", "the scan walks past the buffer")})
    assert "not with the known text 'invalid access to map value'" in problem and "EACCES" in problem


def test_a_known_failure_that_passes_or_no_longer_runs_fails() -> None:
    (fixed,) = judge(*outcomes_of(OUTPUT.replace(f"{B} FAILED", f"{B} PASSED")), {B: KNOWN_B[B]})
    assert "now passes" in fixed
    gone = "tests/integration/test_c.py::test_removed"
    problems = judge(*outcomes_of(OUTPUT), {**KNOWN_B, gone: ("x", "why")})
    assert problems == [f"{gone}: known to fail (why) but did not run: remove it from KNOWN_FAILING or run it"]


def test_an_unknown_failure_or_skip_fails() -> None:
    (problem,) = judge(*outcomes_of(OUTPUT), {})
    assert problem.startswith(f"{B}: failed: AssertionError")
    (skipped,) = judge(*outcomes_of(OUTPUT.replace(f"{A} PASSED", f"{A} SKIPPED")), KNOWN_B)
    assert skipped.startswith(f"{A}: skipped")


def test_known_failures_are_keyed_by_exact_kernel_versions() -> None:
    """A prefix such as "6.1" would also take 6.10-6.19: every key is a whole Debian kernel release."""
    for kernel, entries in KNOWN_FAILING.items():
        assert runner.series_of(kernel) in {s.series for s in runner.matrix()}, kernel
        assert kernel.endswith("-amd64") and kernel.count(".") >= 2, kernel
        for test, (text, why) in entries.items():
            assert test.startswith("tests/") and "::" in test and text and why, (kernel, test)


def test_series_are_told_apart_by_major_and_minor() -> None:
    assert runner.series_of("6.12.48+deb13-amd64") == "6.12"
    assert runner.series_of("6.1.0-57-amd64") == "6.1"
    assert runner.series_of("5.10.0-35-amd64") == "5.10"


def test_series_before_5_12_are_booted_for_the_refusal_only() -> None:
    assert refused("5.10") and refused("4.19") and not refused("5.12") and not refused("6.1")
    assert set(refused_ids()) | set(series_ids()) == {s.series for s in runner.matrix()}
    assert not set(refused_ids()) & set(series_ids())


def test_a_guest_scripts_checks_are_read_with_the_failure_text() -> None:
    output = "qosagent-vm: up 3.1\ncheck run_refused: ok\n  check no_pins: FAILED /sys/fs/bpf/qosagent exists\n" \
             "check nothing_added: FAILED\nnot a check: ok\n"
    assert runner.checks(output) == {"run_refused": "ok", "no_pins": "/sys/fs/bpf/qosagent exists",
                                     "nothing_added": "FAILED"}
    assert runner.check_problems(output, ("run_refused", "no_pins", "check_refused")) == [
        "no_pins: /sys/fs/bpf/qosagent exists", "check_refused: did not run",
        "nothing_added: a check the test does not know"]
