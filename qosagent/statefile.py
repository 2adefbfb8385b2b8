"""Files under state_dir that must survive the agent (saved originals): written whole or not at all."""

from __future__ import annotations

import json
import os
from typing import Any


def save_json(path: str, data: Any) -> None:
    """Replace path with data, fsynced before the rename, so a crash leaves the old file or the new one."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
