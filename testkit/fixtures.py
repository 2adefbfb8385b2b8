"""The fixture trees in tests/fixtures (tests/fixtures/README.md says where each comes from)."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def sysfs_snapshot(dst: Path) -> Path:
    """A private, writable copy of the real host snapshot at dst (its symlinks kept as links, as sysfs has them)."""
    shutil.copytree(FIXTURES / "sysfs" / "node-exporter-host", dst, symlinks=True)
    return dst
