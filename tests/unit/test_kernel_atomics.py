"""A kernel older than 5.12 (Debian 11's 5.10) refuses every latency and quota program at the verifier, after seconds
of compiling each: the agent and `qosagent check` ask the kernel first (qosagent/ebpf/atomics.py) and refuse in one
line, with an exit status of their own. The kernel's answer is faked here; on this host the real probe runs too."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from qosagent import cli
from qosagent.ebpf import atomics


def test_the_verifier_refusing_the_probe_means_no_atomics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomics, "_load", lambda program: -errno.EINVAL)
    assert atomics.supported() == "no"


@pytest.mark.parametrize("err", [errno.EPERM, errno.EACCES, errno.ENOSYS])
def test_a_kernel_that_will_not_say_is_unknown(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    monkeypatch.setattr(atomics, "_load", lambda program: -err)
    assert atomics.supported() == "unknown"


def test_a_loaded_probe_is_closed_and_means_atomics(monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    monkeypatch.setattr(atomics, "_load", lambda program: fd)
    assert atomics.supported() == "yes"
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_probe_is_a_compare_and_exchange() -> None:
    """What the BPF C compiles `__sync_val_compare_and_swap` to: BPF_STX | BPF_ATOMIC | BPF_DW with BPF_CMPXCHG,
    the operation 5.10's verifier calls a reserved field."""
    insns = [atomics.PROGRAM[i:i + 8] for i in range(0, len(atomics.PROGRAM), 8)]
    assert insns[-1][0] == 0x95  # exit
    atomic = [i for i in insns if i[0] == 0xDB]
    assert len(atomic) == 1 and int.from_bytes(atomic[0][4:], "little") == 0xF1


def test_the_real_kernel_answers_or_says_it_will_not() -> None:
    # Root on a kernel of 5.12 or newer (CI's) answers yes; without the privilege to load a program, unknown.
    assert atomics.supported() == ("yes" if os.geteuid() == 0 else "unknown")


def _config(tmp_path: Path, body: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(body)
    return str(path)


@pytest.mark.parametrize("command", ["run", "check"])
def test_without_atomics_the_agent_and_check_refuse_in_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str) -> None:
    monkeypatch.setattr(atomics, "supported", lambda: "no")
    cfg = _config(tmp_path, "latency: {enabled: true, ports: [18040]}\nquota: {enabled: true, interfaces: [lo]}\n")
    r = CliRunner().invoke(cli.main, [command, "--config", cfg, "--host-root", str(tmp_path)])
    assert r.exit_code == cli.EXIT_KERNEL, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "BPF atomic operations" in lines[0] and "5.12" in lines[0] and "quota and latency" in lines[0]
    assert r.stdout == ""


@pytest.mark.parametrize("answer", ["yes", "unknown"])
def test_check_goes_on_when_the_kernel_has_them_or_will_not_say(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answer: str) -> None:
    monkeypatch.setattr(atomics, "supported", lambda: answer)
    r = CliRunner().invoke(cli.main, ["check", "--host-root", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "BPF atomic" not in r.output


def test_a_config_that_loads_no_bpf_runs_on_any_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(atomics, "supported", lambda: "no")
    cfg = _config(tmp_path, "latency: {enabled: false}\ndvfs: {enabled: true, mode: dry-run}\n")
    r = CliRunner().invoke(cli.main, ["check", "--config", cfg, "--host-root", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "BPF atomic" not in r.output
