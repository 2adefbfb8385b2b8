"""features.probe on a fixture host tree: which kernel functions it finds where (vmlinux BTF's strings, /proc/kallsyms)
and what it makes of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qosagent.features import KPROBE_FUNCTIONS, TRACEPOINTS, probe
from qosagent.hostfs import HostFS

OLD_KERNEL_TPS = ("sock/inet_sock_set_state", "sched/sched_wakeup", "sched/sched_wakeup_new", "sched/sched_switch")


def host(root: Path, btf: tuple[str, ...] = (), kallsyms: tuple[str, ...] = (), kprobe_pmu: bool = True,
         tracepoints: tuple[str, ...] = TRACEPOINTS) -> HostFS:
    """A host tree: BTF strings (as in the blob's string section: NUL-separated), kallsyms lines ("name" or
    "name\\tmodule"), the kprobe PMU, tracefs events."""
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    (root / "sys/kernel/btf").mkdir(parents=True)
    blob = b"\x9f\xeb\x01\x00" + b"\0".join(n.encode() for n in ("", "int", *btf, ""))
    (root / "sys/kernel/btf/vmlinux").write_bytes(blob)
    (root / "proc/kallsyms").write_text("".join(f"ffffffff81000000 t {line}\n" for line in kallsyms))
    if kprobe_pmu:
        (root / "sys/bus/event_source/devices/kprobe").mkdir(parents=True)
    for tp in tracepoints:
        (root / "sys/kernel/tracing/events" / tp).mkdir(parents=True)
    return HostFS(root)


def test_a_function_in_btf_is_built_in_without_kallsyms(tmp_path: Path) -> None:
    f = probe(host(tmp_path, btf=("cls_bpf_classify", "tcx_prog_attach_extra")))
    assert f.cls_bpf
    assert not f.tcx, "a longer name in BTF is not the name"
    assert not f.clsact


def test_a_modules_function_is_found_in_kallsyms(tmp_path: Path) -> None:
    f = probe(host(tmp_path, kallsyms=("clsact_init\t[sch_ingress]", "tcp_sendmsg", "tcp_cleanup_rbuf\t[m]")))
    assert f.clsact and not f.cls_bpf
    assert f.kprobe_functions["tcp_sendmsg"] and f.kprobe_functions["tcp_cleanup_rbuf"]


@pytest.mark.parametrize("suffix", [".isra.0", ".constprop.0", "_locked"])
def test_a_kprobe_function_is_only_its_exact_name_in_kallsyms(tmp_path: Path, suffix: str) -> None:
    # pahole >= 1.25 can keep the plain name of a function the compiler left only as name.isra.0 in BTF; a kprobe
    # by the plain name finds nothing there, so BTF must not answer for kprobe functions.
    fs = host(tmp_path, btf=KPROBE_FUNCTIONS, tracepoints=OLD_KERNEL_TPS,
              kallsyms=("tcp_sendmsg", "sock_def_readable", f"tcp_cleanup_rbuf{suffix}"))
    f = probe(fs)
    assert dict(f.kprobe_functions) == {"tcp_cleanup_rbuf": False, "tcp_sendmsg": True, "sock_def_readable": True}
    from qosagent.capability import State
    from qosagent.config import parse
    from qosagent.latency import planning

    v = planning.verdict(parse({"latency": {"mode": "auto"}}, "t").latency, f)
    assert v.state is State.UNAVAILABLE and "no tcp_cleanup_rbuf to probe" in v.reason, v.reason


def test_kprobes_are_the_kprobe_pmu_alone(tmp_path: Path) -> None:
    f = probe(host(tmp_path, btf=("register_kprobe",), kallsyms=("register_kprobe", *KPROBE_FUNCTIONS),
                   kprobe_pmu=False))
    assert not f.kprobes
    assert probe(HostFS(tmp_path)).kprobes is False
    (tmp_path / "sys/bus/event_source/devices/kprobe").mkdir(parents=True)
    assert probe(HostFS(tmp_path)).kprobes


def test_kallsyms_is_read_only_when_kprobe_functions_are_asked_about(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fs = host(tmp_path, btf=("cls_bpf_classify", "clsact_init", "tcx_prog_attach"), kallsyms=KPROBE_FUNCTIONS)
    reads: list[str] = []
    real = HostFS.try_read

    def counting(self: HostFS, path: str) -> str | None:
        reads.append(path)
        return real(self, path)

    monkeypatch.setattr(HostFS, "try_read", counting)
    f = probe(fs)
    assert f.cls_bpf and f.clsact and f.tcx
    assert "/proc/kallsyms" not in reads, "a start in tracepoint or sock_ops mode never needs kallsyms"
    assert f.kprobe_functions["tcp_sendmsg"] and f.kprobe_functions.get("sock_def_readable")
    assert json.loads(json.dumps(f.as_dict()))["kprobe_functions"] == dict.fromkeys(KPROBE_FUNCTIONS, True)
    assert reads.count("/proc/kallsyms") == 1
