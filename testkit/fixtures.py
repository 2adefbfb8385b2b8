"""The fixture trees in tests/fixtures (tests/fixtures/README.md says where each comes from)."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def sysfs_snapshot(dst: Path) -> Path:
    """A private, writable copy of the real host snapshot at dst, its link files turned back into symlinks.

    The repository stores each sysfs symlink as a small file holding its relative target ("../../devices/..."):
    sysfs links point back up the tree, and a tool that walks the checkout following links (setuptools' package
    finder does) would loop through them. Sysfs code must see real links (class/hwmon/hwmonN -> devices/...,
    node/nodeN/cpuM -> cpu/cpuM), so the copy has them."""
    shutil.copytree(FIXTURES / "sysfs" / "node-exporter-host", dst)
    for f in sorted(dst.rglob("*")):
        if f.is_file() and not f.is_symlink() and f.stat().st_size < 256:
            text = f.read_text(errors="replace").strip()
            if text.startswith("../") and "\n" not in text and (f.parent / text).exists():
                f.unlink()
                f.symlink_to(text)
    return dst
