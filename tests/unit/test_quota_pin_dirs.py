"""Which pin directories under the pin root belong to agents of another layout."""

from __future__ import annotations

from qosagent.ebpf import pins
from qosagent.quota.datapath import other_layouts


def test_other_layouts_are_the_quota_dirs_of_other_versions_only(tmp_path) -> None:
    older, newer = f"quota-v{pins.QUOTA_LAYOUT - 1}", f"quota-v{pins.QUOTA_LAYOUT + 10}"
    for name in (f"quota-v{pins.QUOTA_LAYOUT}", older, newer, "quota-vx", f"{older}.bak", "latency"):
        (tmp_path / name).mkdir()
    (tmp_path / f"quota-v{pins.QUOTA_LAYOUT + 1}").write_text("a file, not a pin directory")
    assert other_layouts(str(tmp_path)) == sorted([str(tmp_path / older), str(tmp_path / newer)])
    assert other_layouts(str(tmp_path / "absent")) == []
