"""bench/latency_overhead.py's --empty-programs baseline: the copy of bpf/ it makes has every probe of every file a
latency build is made of returning at once (BCC compiles it in the bench; here only the text is checked)."""

from __future__ import annotations

import itertools
from pathlib import Path

from bench.latency_overhead import _EMPTIED, empty_programs

from qosagent.latency.datapath import sources
from qosagent.latency.model import Plan


def test_every_file_of_every_mode_is_emptied(tmp_path: Path) -> None:
    built = {f"{name}.c" for mode, arrival, egress, runq in itertools.product(
        ("sockops", "tracepoint", "kprobe"), (False, True), (False, True), (False, True))
        for name in sources(Plan(mode, arrival, egress, runq))}
    assert built == set(_EMPTIED), "a file of a latency build that the bench does not empty, or one gone"
    out = Path(empty_programs(tmp_path / "bpf"))
    repo = Path(__file__).resolve().parents[2] / "bpf"
    for name in built:
        before, after = (repo / name).read_text(), (out / name).read_text()
        added = after.count("    if (1)\n") - before.count("    if (1)\n")
        assert added == sum(want for _, _, want in _EMPTIED[name]), name
