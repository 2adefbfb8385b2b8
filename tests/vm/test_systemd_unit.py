"""The shipped unit under a real systemd: the kernel matrix's VM (Debian 12's 6.1, two NUMA nodes) booted with systemd
as PID 1, the agent installed with `make install`, then started, reloaded, killed, hung, stopped and uninstalled by
systemd itself (tests/vm/systemd_unit.sh, which says what each check is).

Slow and privileged: under CI=true a host that cannot boot the VM fails, never skips. Part of `make test` (collected
last, beside the kernel matrix). Its cost under TCG on the 2 shared CPUs, 2026-12-02 (host load ~2-3): 592-666 s in
all; the boot 28-32 s, `make install` 191-345 s, the first start (BPF compiled) 40-163 s, the restarts after kill -9
and after the watchdog's kill (kept builds opened, 30 s of WatchdogSec in the second) 25-57 s and 56-77 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import require
from tests.vm import runner

KERNEL_SERIES = "6.1"  # Debian 12's, whose systemd (252) is the host root's the VM boots
# What systemd_unit.sh checks, in its order: each must print `check NAME: ok`.
CHECKS = ("install", "dropin_written", "start", "active", "readyz", "capabilities", "metrics", "resources_written",
          "proc_readable", "reload", "reloaded_tenant", "handover_while_down", "restarted_after_kill",
          "one_filter_after_restart", "restarted_after_hang", "watchdog_named", "stop", "stopped_handover",
          "stopped_pins", "stopped_no_latency", "stopped_no_socket", "stopped_resources_restored", "uninstall",
          "uninstalled_filter", "uninstalled_pins", "uninstalled_qdisc", "uninstalled_programs", "uninstalled_maps",
          "uninstalled_attachments", "uninstalled_files", "config_kept")
# Writable in the guest (overlays; the host's stay as they are): what `make install` writes and the agent keeps.
RW = ("/etc", "/opt", "/usr/share", "/var", "/tmp", str(runner.REPO))
TIMEOUT_S = 2400


@pytest.mark.kernel_matrix
@pytest.mark.slow
@pytest.mark.privileged
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_the_unit_under_systemd(tmp_path: Path) -> None:
    kernel, why = runner.cached_kernel(KERNEL_SERIES)
    require(kernel is not None, f"the systemd VM: {why}")
    r = runner.run("bash tests/vm/systemd_unit.sh", kernel=kernel, timeout=TIMEOUT_S, numa=True,
                   echo=sys.stdout.write, systemd=True, rw=RW)
    summary = r.kept(tmp_path / f"vm-systemd-{r.kernel}.log", ", systemd")
    tail = r.output[-8000:]
    assert not r.timed_out, f"{summary}: timed out\n{tail}"
    problems = runner.check_problems(r.output, CHECKS)
    assert not problems, f"{summary}:\n" + "\n".join(problems) + f"\n{tail}"
    assert r.rc == 0, f"{summary}\n{tail}"
