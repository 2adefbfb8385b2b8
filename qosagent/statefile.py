"""Files under state_dir that must survive the agent (saved originals): written whole or not at all, and never
forgotten: one that cannot be read is kept, and the capability that owns it refuses to start until an operator
has looked (a file dropped would leave a crashed agent's changes with no way back)."""

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


class StateFileError(ValueError):
    """A state file that exists but cannot be read as ours; it is kept as it is."""


def load_json(path: str) -> Any:
    """The data at path, or None when there is no file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StateFileError(f"{path}: unreadable: {e}") from None


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
