"""A kept build is reused only for the source it was built from: its name's digest covers the headers the C includes,
however deep, so a change to a shared map's declaration (the generations in qos_common.h) makes a new build rather
than opening an older one that lacks the map."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qosagent.config import parse
from qosagent.ebpf.loader import bpf_dir
from qosagent.latency import datapath as latency
from qosagent.latency.model import Plan
from qosagent.quota import datapath as quota


def digests() -> tuple[str, str]:
    cfg = parse({"quota": {"enabled": True}}, "test")
    plan = Plan("tracepoint", arrival=False, egress=False, runq=False)
    return (latency.spec(plan, {"LAT_SLOTS": 64}).digest(),
            quota.spec(cfg, "/sys/fs/bpf/qosagent-test", 2).digest())


def test_a_change_to_an_included_header_makes_another_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "bpf"
    shutil.copytree(bpf_dir(), src)
    monkeypatch.setenv("QOSAGENT_BPF_DIR", str(src))
    before = digests()
    assert digests() == before  # nothing changed, the same builds
    common = src / "include" / "qos_common.h"
    text = common.read_text()
    assert "struct qos_gen {" in text
    common.write_text(text.replace("struct qos_gen {", "struct qos_gen {\n    __u64 spare;", 1))
    after = digests()
    assert after[0] != before[0] and after[1] != before[1]
