"""The fake GPU backend's file (gpu.fake_file), which tests rewrite while an agent runs: every new version is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qosagent.gpu.fake import FakeBackend


def write(path: Path, ratio: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"preset": "single", "gpus": {"0": {"memory_used_ratio": ratio}}}))
    os.replace(tmp, path)


def used(b: FakeBackend) -> float:
    (g,) = b.sample().gpus
    return g.memory_used / g.memory_total


def test_a_file_renamed_over_it_in_the_same_mtime_tick_is_read(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    write(path, 0.30)
    b = FakeBackend.from_file(str(path))
    b.open()
    assert used(b) == pytest.approx(0.30)
    mtime = path.stat().st_mtime_ns
    write(path, 0.80)  # the same size: only the inode tells it from the first
    os.utime(path, ns=(mtime, mtime))
    assert used(b) == pytest.approx(0.80)
