"""Boot a cached distro kernel in a VM on this host's root filesystem and run a shell script in it.

The kernels are unpacked by scripts/vm-kernel.sh (from `make setup-kernels`) under QOSAGENT_VM_CACHE
(/var/lib/qosagent-vm/kernels/<version>). virtme-ng boots one with the host's root filesystem shared read-only (9p;
/etc, /tmp, /var and a few more get a throwaway overlay in the guest), so the guest runs this checkout and its
.venv as they are here. KVM when it works, QEMU's TCG emulation when it does not (nested KVM often fails). QEMU
runs niced, in a session of its own that is killed on timeout: no VM outlives a run.

    python -m tests.vm.runner [--kernel VERSION] [--cpus N] [--memory SIZE] [--numa] -- pytest args...

runs `pytest args` in the VM with CI=true and exits with pytest's status.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("QOSAGENT_VM_CACHE", "/var/lib/qosagent-vm"))
VENV_BIN = REPO / ".venv" / "bin"
UP_MARK = "qosagent-vm: up"
# The guest kernel's warnings and worse (dmesg -n 5: levels 0-4) go to a console of their own that the host keeps in a
# file, added to the output after the run (KMSG_MARK on each line): a guest that panics (QEMU exits, virtme-ng says
# 255) or locks up says why. virtme-ng's own console is quiet and goes to /dev/null.
KMSG_LEVEL = 5
KMSG_MARK = "qosagent-kmsg: "
KMSG_HEAD, KMSG_TAIL = 60, 100  # the first report and the last ones (a panic's trace is ~60 lines)
# The tracepoints the programs attach to, held enabled in the guest for the whole run (as ftrace events, tracing_on
# 0: nothing recorded). Attaching the first probe to a tracepoint, or detaching the last, flips its static key, which
# the kernel patches into every call site through int3 (text_poke_bp); QEMU's multi-threaded TCG can run a stale
# translation of a site on another vCPU after the patch completed: CI's 6.12 guest panicked on
# "Oops: int3" at ttwu_do_activate+0x8d (the sched_wakeup site) while the tests attached and detached the run-queue
# probes. With the keys held on, attaching and detaching edit the probe lists only and patch no code. Real hardware
# is not concerned (the kernel's sync IPIs hold there); kprobe mode's own int3s are not covered.
HELD_EVENTS = ("sched/sched_switch", "sched/sched_wakeup", "sched/sched_wakeup_new", "sock/inet_sock_set_state",
               "sock/sk_data_ready", "sock/sock_recv_length", "sock/sock_send_length")
HOST_MARK = "qosagent-host: "
NICE = 15  # the host's CPUs are shared: the VM yields to everything else
# The guest's first line: its uptime when its command starts. The rest mounts what a systemd host would have.
PROLOGUE = f"""\
echo "{UP_MARK} $(cut -d' ' -f1 /proc/uptime)"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root CI=true QOSAGENT_IN_VM=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
grep -q ' /sys/fs/bpf bpf ' /proc/mounts || mount -t bpf bpf /sys/fs/bpf
grep -q ' /sys/kernel/tracing tracefs ' /proc/mounts || mount -t tracefs tracefs /sys/kernel/tracing
ip link set lo up
cd {shlex.quote(str(REPO))}
"""


@dataclass
class VmResult:
    kernel: str
    accel: str  # "kvm" or "tcg"
    rc: int  # the script's exit status; 124 when the VM was killed at the timeout
    output: str  # the guest's stdout and stderr, and virtme-ng's own messages
    boot_s: float | None  # from starting QEMU to the guest's first command (None: it never got there)
    wall_s: float  # from starting QEMU to its exit
    timed_out: bool
    kvm_failed: bool = False  # KVM stopped the guest before its command ran (then run() boots it again under TCG)

    def kept(self, log: Path, what: str = "") -> str:
        """The whole output written to log (what a failure names), and the run's one-line summary, printed."""
        log.write_text(self.output)
        summary = (f"kernel {self.kernel} ({self.accel}){what}: total {self.wall_s:.0f} s, exit {self.rc}; "
                   f"whole output in {log}")
        print(summary)
        return summary


def kernels() -> list[str]:
    """Kernel versions unpacked in the cache, oldest first."""
    root = CACHE / "kernels"
    found = [d.name for d in root.iterdir() if (d / ".complete").exists()] if root.is_dir() else []
    return sorted(found, key=lambda v: [int(x) if x.isdigit() else x for x in re.split(r"[.+-]", v)])


@dataclass(frozen=True)
class Series:
    suite: str  # the Debian suite its kernels come from (bullseye)
    series: str  # major.minor (5.10)
    release: str  # for people (Debian 11)


def matrix() -> list[Series]:
    """The kernel series of the matrix, as tests/vm/kernels.txt lists them (scripts/vm-kernel.sh reads it too)."""
    out = []
    for line in (REPO / "tests" / "vm" / "kernels.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            suite, series, release = line.split(None, 2)
            out.append(Series(suite, series, release))
    return out


def series_of(version: str) -> str:
    """5.10.0-35-amd64 -> 5.10, 6.12.48+deb13-amd64 -> 6.12."""
    m = re.match(r"(\d+\.\d+)", version)
    return m.group(1) if m else version


def newest(series: str) -> str | None:
    """The newest cached kernel of a series (major.minor), or None."""
    found = [k for k in kernels() if series_of(k) == series]
    return found[-1] if found else None


def cached_kernel(series: str) -> tuple[str | None, str]:
    """The newest cached kernel of series to boot, or None and why a VM cannot boot it here."""
    why = missing()
    if why is not None:
        return None, f"a VM cannot boot here: {why}"
    kernel = newest(series)
    return kernel, "" if kernel else f"no {series} kernel cached under {CACHE}/kernels (make setup-kernels)"


def kernel_image(version: str) -> Path:
    return CACHE / "kernels" / version / "boot" / f"vmlinuz-{version}"


def missing() -> str | None:
    """Why a VM cannot be started here, or None."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 not installed (make setup-kernels)"
    if not (VENV_BIN / "vng").exists():
        return "virtme-ng not installed in .venv (make setup-kernels)"
    if not kernels():
        return f"no kernel unpacked under {CACHE}/kernels (make setup-kernels)"
    return None


@functools.cache
def kvm_works() -> bool:
    """Whether QEMU can create a KVM vCPU here: nested KVM can exist and still fail at the vCPU's first MSR write,
    at once. A paused VM that is still alive after a second has passed that point."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK) or os.environ.get("QOSAGENT_VM_KVM") == "0":
        return False
    try:
        r = subprocess.run(["timeout", "1", "qemu-system-x86_64", "-accel", "kvm", "-machine", "q35", "-cpu", "max",
                            "-nodefaults", "-display", "none", "-S", "-m", "64"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 124


def run(script: str, kernel: str | None = None, cpus: int = 2, memory: str = "3G", timeout: float = 1200,
        numa: bool = False, echo: Callable[[str], None] | None = None, systemd: bool = False,
        rw: tuple[str, ...] = ()) -> VmResult:
    """Run `script` (bash) in the repository's directory inside a VM booted from `kernel` (default: the newest
    cached), as root with CI=true. numa: two NUMA nodes, half the memory and CPUs each. systemd: systemd is the
    guest's PID 1 and the script is the service it boots into (SYSTEMD_RUN below). rw: directories the guest may
    write (an overlay: the host's stay as they are)."""
    why = missing()
    if why:
        raise RuntimeError(f"cannot start a VM: {why}")
    kernel = kernel or kernels()[-1]
    if kvm_works() and not _KVM_FAILED:
        r = _boot(script, kernel, "kvm", cpus, memory, timeout, numa, echo, systemd, rw)
        if not r.kvm_failed:
            return r
        # Nested KVM that creates a vCPU and then fails to emulate an instruction stops the guest for good.
        _KVM_FAILED.append(r.output[-2000:])
        if echo:
            echo(f"qosagent-vm: the guest did not come up under KVM in {KVM_BOOT_S:.0f} s; again under TCG\n")
    return _boot(script, kernel, "tcg", cpus, memory, timeout, numa, echo, systemd, rw)


_KVM_FAILED: list[str] = []  # once KVM failed in a guest, this process boots the rest under TCG
KVM_ERROR = "KVM internal error"
KVM_BOOT_S = 60.0


# systemd as PID 1: virtme-ng's --systemd runs its command from a serial getty of the host's default target, which
# the guest never reached here (the host's own units in the way); instead the guest boots into the command itself
# (systemd-run-generator, systemd >= 240: `systemd.run=` makes it a oneshot service and the boot's target), which
# powers the VM off when it ends, either way. virtme-ng's guest set-up does not run then: the wrapper sends the
# output to the serial console, makes the rw directories writable (overlays on tmpfs) and prints the exit status,
# which virtme-ng cannot return from there.
# The host's root has a /.dockerenv (it was built in a container), so systemd takes the VM for a container, and a
# container's systemd and generators read their settings from PID 1's argv instead of /proc/cmdline: none of them
# took effect. `container=` (empty; the kernel passes it to init's environment) tells PID 1 it is in none. Its
# generators still see a container (PID 1 has the variable), so theirs come in SYSTEMD_PROC_CMDLINE, set for them by
# PID 1 (systemd.setenv=, quoted whole). Not systemd-tmpfiles-setup: with --remove at boot it empties the guest's
# view of the host's /tmp (gigabytes over 9p; the boot never got past it under emulation), and nothing the unit uses
# comes from it (RuntimeDirectory= and PrivateTmp= are systemd's own); nor timesyncd (no network: it fails, again and
# again). Status lines only on errors: the progress
# spinner is most of the output otherwise.
GENERATORS = ("systemd.run={wrapper}", "systemd.run_success_action=poweroff-force",
              "systemd.run_failure_action=poweroff-force", "systemd.mask=systemd-tmpfiles-setup.service",
              "systemd.mask=systemd-timesyncd.service")
SYSTEMD_RUN = ("container=", '"systemd.setenv=SYSTEMD_PROC_CMDLINE=' + " ".join(GENERATORS) + '"',
               "systemd.show_status=error")
EXIT_MARK = "qosagent-vm: exit "
SYSTEMD_WRAPPER = """#!/bin/bash
exec >/dev/console 2>&1
mkdir -p /run/qosagent-vm
for d in {rw}; do
  u=/run/qosagent-vm/$(echo "$d" | tr / _)
  mkdir -p "$u/upper" "$u/work"
  mount -t overlay overlay -o "lowerdir=$d,upperdir=$u/upper,workdir=$u/work" "$d" \\
    || echo "qosagent-vm: no overlay on $d"
done
bash {body}
echo "{mark}$?"
"""


def _boot(script: str, kernel: str, accel: str, cpus: int, memory: str, timeout: float, numa: bool,
          echo: Callable[[str], None] | None, systemd: bool, rw: tuple[str, ...]) -> VmResult:
    with tempfile.TemporaryDirectory(prefix="qosagent-vm-") as tmp:
        # The guest sees the host's /tmp (under an overlay), so the script travels as a file: no quoting.
        path = Path(tmp) / "run.sh"
        # Emulation is about ten times slower than the host at compiling BPF programs: waits for the agent scale.
        scale = 2 if accel == "kvm" else 10
        # systemd's guest: its console is the output, and its test checks what the agent leaves, so left as it is.
        kmsg_on = "" if systemd else (
            f"dmesg -n {KMSG_LEVEL}\necho 0 >/sys/kernel/tracing/tracing_on\n"
            f"for e in {' '.join(HELD_EVENTS)}; do\n"
            "  [ -e /sys/kernel/tracing/events/$e/enable ] && echo 1 >/sys/kernel/tracing/events/$e/enable\ndone\n")
        path.write_text(PROLOGUE + kmsg_on + f"export QOSAGENT_TEST_TIME_SCALE={scale}\n" + script + "\n")
        argv = ["nice", "-n", str(NICE), str(VENV_BIN / "vng"), "--run", str(kernel_image(kernel)),
                "--cpus", str(cpus), "--memory", memory, "--name", "qosagent-vm"]
        if accel == "tcg":
            argv.append("--disable-kvm")
        if systemd:
            os.chmod(tmp, 0o755)  # the guest's root reads it through the host's permissions
            wrapper = Path(tmp) / "systemd-run.sh"
            wrapper.write_text(SYSTEMD_WRAPPER.format(rw=" ".join(shlex.quote(d) for d in rw), body=path,
                                                      mark=EXIT_MARK))
            wrapper.chmod(0o755)
            argv.append("--systemd")
            for karg in SYSTEMD_RUN:
                argv += ["--append", karg.format(wrapper=wrapper)]
        else:
            argv += ["--exec", f"bash {path}"]
            argv += [f"--overlay-rwdir={d}" for d in rw]
            argv += ["--append", "console=hvc0"]
        if numa:
            mb = _megabytes(memory)
            half = cpus // 2
            argv += ["--numa", f"{mb // 2}M,cpus=0-{half - 1}", "--numa", f"{mb - mb // 2}M,cpus={half}-{cpus - 1}"]
        kmsg = Path(tmp) / "kmsg.log"
        if not systemd:  # systemd's guest keeps virtme-ng's console for itself
            # A console of its own (virtio, hvc0: 8250's one console is virtme-ng's ttyS0); last, as virtme-run
            # takes the rest of its arguments for QEMU.
            argv.append("--qemu-opts=-device virtio-serial-pci -chardev file,id=kmsg,path="
                        f"{kmsg} -device virtconsole,chardev=kmsg")
        env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
        lines: list[str] = []
        up: list[float] = []
        failed = threading.Event()
        load, cpu_before = os.getloadavg(), _cpu_seen()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True, errors="replace", start_new_session=True, cwd=REPO)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not up and line.startswith(UP_MARK):
                    up.append(time.monotonic() - t0)
                if accel == "kvm" and not up and line.startswith(KVM_ERROR):
                    failed.set()
                    _end_session(proc)
                lines.append(line)
                if echo:
                    echo(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            if accel == "kvm":
                # A guest under KVM is up in seconds; one that is not up by then was stopped by KVM (seen with
                # no message at all on 6.1's image, where 6.12's printed the error above).
                try:
                    proc.wait(timeout=KVM_BOOT_S)
                except subprocess.TimeoutExpired:
                    if not up:
                        failed.set()
                        _end_session(proc)
            rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = 124
        finally:
            _end_session(proc)
        reader.join(timeout=10)
        wall = time.monotonic() - t0
        for line in _kmsg(kmsg) + _host(load, cpu_before, wall):
            lines.append(line)
            if echo:
                echo(line)
    if systemd and not timed_out:
        # virtme-ng's own status says nothing of the command's there: the wrapper printed it (none: it never ended).
        marks = [line[len(EXIT_MARK):].strip() for line in lines if line.startswith(EXIT_MARK)]
        rc = int(marks[-1]) if marks and marks[-1].isdigit() else 1
    return VmResult(kernel=kernel, accel=accel, rc=rc, output="".join(lines), boot_s=up[0] if up else None,
                    wall_s=wall, timed_out=timed_out, kvm_failed=failed.is_set())


def _kmsg(path: Path) -> list[str]:
    """The guest kernel's messages from its own console's file, each line marked (none where it wrote none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return _kmsg_lines(text.replace("\r", "").splitlines())


def _kmsg_lines(text: list[str]) -> list[str]:
    """The kernel's lines as the output carries them: marked, at most the first KMSG_HEAD and the last KMSG_TAIL."""
    lines = [line for line in text if line.strip()]
    if len(lines) > KMSG_HEAD + KMSG_TAIL:  # a storm of stall reports would push the guest's own end out of a tail
        lines = lines[:KMSG_HEAD] + [f"({len(lines) - KMSG_HEAD - KMSG_TAIL} lines left out)"] + lines[-KMSG_TAIL:]
    return [f"{KMSG_MARK}{line}\n" for line in lines]


def _cpu_seen() -> dict[tuple[int, float], tuple[float, str, int | None]]:
    """Every host process's CPU seconds so far, by (pid, start time), with what names it (its executable and first
    argument, no more: other arguments may hold a secret) and its nice; empty where the scan fails (a diagnostic
    never costs the run its result)."""
    out = {}
    try:
        for p in psutil.process_iter(["pid", "nice", "cpu_times", "create_time", "cmdline", "name"]):
            i, t = p.info, p.info["cpu_times"]
            if t is not None:
                words = " ".join(i["cmdline"] or [i["name"] or "?"]).split()
                out[(i["pid"], i["create_time"] or 0.0)] = (t.user + t.system, " ".join(words[:2])[:100], i["nice"])
    except (psutil.Error, OSError):
        return {}
    return out


def _host(load: tuple[float, float, float], before: dict[tuple[int, float], tuple[float, str, int | None]],
          wall: float) -> list[str]:
    """The host's load over the run and the processes that took most CPU meanwhile, marked: QEMU runs niced, so a
    guest that crawled or timed out may have been starved by something else on the host (one an earlier test left)."""
    after = os.getloadavg()
    out = [f"{HOST_MARK}load average {load[0]:.2f} at start, {after[0]:.2f} {after[1]:.2f} {after[2]:.2f} at end\n"]
    used = sorted(((cpu - before.get(k, (0.0,))[0], cmd, nice) for k, (cpu, cmd, nice) in _cpu_seen().items()),
                  key=lambda u: u[0], reverse=True)
    for cpu, cmd, nice in used[:5]:
        out.append(f"{HOST_MARK}{cpu / max(wall, 1.0):.0%} of a CPU, nice {nice}: {cmd}\n")
    return out


def _end_session(proc: subprocess.Popen[str]) -> None:
    """Stop QEMU and virtme-ng (the session this run started, and nothing else) if they are still there."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; children (QEMU) may remain in the group a moment longer.
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)


CHECK = re.compile(r"^check (\w+): (ok|FAILED)(.*)$")


def checks(output: str) -> dict[str, str]:
    """NAME -> "ok" or the failure's text, from the `check NAME: ok|FAILED ...` lines a guest's script prints
    (tests/vm/*.sh)."""
    out = {}
    for line in output.splitlines():
        m = CHECK.match(line.strip())
        if m:
            out[m.group(1)] = "ok" if m.group(2) == "ok" else m.group(3).strip() or "FAILED"
    return out


def check_problems(output: str, expected: tuple[str, ...]) -> list[str]:
    """What is wrong with a guest script's checks: each expected one not ok (its failure text, or that it did not
    run), and any the test does not know."""
    got = checks(output)
    return ([f"{n}: {got.get(n, 'did not run')}" for n in expected if got.get(n) != "ok"]
            + [f"{n}: a check the test does not know" for n in got if n not in expected])


def _megabytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)([MG])?", size.upper())
    if not m:
        raise ValueError(f"memory size {size!r}: want N, NM or NG")
    return int(m.group(1)) * (1024 if m.group(2) == "G" else 1)


# Run in the guest when its command outlives its limit: what every process waits on (a hang under emulation has been
# a task stuck in the kernel as often as one in Python), the kernel's blocked tasks, the newest agent logs of the
# tests, then SIGABRT, on which Python's faulthandler (on in pytest) prints every thread's stack, and SIGKILL.
WATCHDOG = r"""
qosagent_watchdog() {
  since=$(mktemp)  # the guest's /tmp is the host's under an overlay: other runs' logs are there too
  sleep "$2" </dev/null >/dev/null 2>&1  # it outlives a killed watchdog: it must not hold the guest's output open
  kill -0 "$1" 2>/dev/null || return 0
  echo "qosagent-vm: watchdog: the guest's command still runs after $2 s; its processes:"
  ps -N --ppid 2 -p 2 -o pid,ppid,stat,wchan:32,etime,args  # all but kernel threads
  for pid in $(ps -eo pid=,stat= | awk '$2 ~ /^D/ {print $1}'); do
    echo "qosagent-vm: watchdog: $pid in uninterruptible sleep: $(tr '\0' ' ' </proc/$pid/cmdline)"
    cat "/proc/$pid/stack"
  done
  echo w >/proc/sysrq-trigger
  dmesg | tail -n 80
  for f in $(find /tmp/pytest-of-root -name agent.log -newer "$since" 2>/dev/null | tail -n 2); do
    echo "qosagent-vm: watchdog: $f"; tail -n 30 "$f"
  done
  kill -ABRT "$1"; sleep 10; kill -KILL "$1" 2>/dev/null
}
"""


def pytest_script(args: list[str], limit_s: float | None = None, test_limit_s: float | None = None) -> str:
    """The guest's command for a pytest selection (no cache writes: the checkout is read-only there). limit_s: the
    whole run's limit in the guest, past which the watchdog above reports and ends it; test_limit_s: one test's
    (pytest-timeout: that test fails with its traceback, the run goes on)."""
    argv = ".venv/bin/python -m pytest -p no:cacheprovider"
    if test_limit_s:
        argv += f" --timeout={test_limit_s:.0f}"
    argv += " " + " ".join(shlex.quote(a) for a in args)
    if not limit_s:
        return "exec " + argv
    return (WATCHDOG + f"{argv} &\npid=$!\nqosagent_watchdog $pid {limit_s:.0f} &\nwd=$!\n"
            "wait $pid\nrc=$?\nkill $wd 2>/dev/null\nexit $rc")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.vm.runner", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", help="a cached kernel version (default: the newest)")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--memory", default="3G")
    p.add_argument("--numa", action="store_true", help="two NUMA nodes")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--shell", help="run this bash command instead of pytest")
    p.add_argument("--systemd", action="store_true", help="systemd as the guest's PID 1")
    p.add_argument("--rw", action="append", default=[], help="a directory the guest may write (an overlay)")
    p.add_argument("pytest_args", nargs="*")
    a = p.parse_args(argv)
    script = a.shell if a.shell else pytest_script(a.pytest_args)
    r = run(script, kernel=a.kernel, cpus=a.cpus, memory=a.memory, timeout=a.timeout, numa=a.numa,
            echo=lambda line: (sys.stdout.write(line), sys.stdout.flush()), systemd=a.systemd, rw=tuple(a.rw))
    boot = f"{r.boot_s:.1f}" if r.boot_s is not None else "-"
    print(f"qosagent-vm: kernel {r.kernel} ({r.accel}): exit {r.rc}, boot {boot} s, total {r.wall_s:.1f} s"
          + (" (timed out)" if r.timed_out else ""), file=sys.stderr)
    return r.rc


if __name__ == "__main__":
    sys.exit(main())
