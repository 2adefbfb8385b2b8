"""Files under state_dir that must survive the agent (saved originals): written whole or not at all, and never
forgotten: one that cannot be read is kept, and the capability that owns it refuses to start until an operator
has looked (a file dropped would leave a crashed agent's changes with no way back)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, TypeVar

T = TypeVar("T")


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


class Kept:
    """One capability's originals file under state_dir (none without a state_dir): read once at start, written whole
    after each change, removed when nothing is left to put back, and never written over or removed once it could not
    be read (the operator must look first)."""

    def __init__(self, state_dir: str | None, name: str, what: str):
        self.path = os.path.join(state_dir, name) if state_dir else None
        self.what = what  # "placement originals": what a file that is not one is called in the error
        self.unreadable = False

    def read(self, parse: Callable[[Any], T], empty: T) -> T:
        """parse(the file's data), `empty` without a file; raises StateFileError for a file that cannot be ours."""
        if not self.path:
            return empty
        try:
            data = load_json(self.path)
            if data is None:
                return empty
            try:
                return parse(data)
            except (AttributeError, ValueError, KeyError, TypeError, IndexError, AssertionError) as e:
                raise StateFileError(f"{self.path}: not a {self.what} file ({e})") from None
        except StateFileError:
            self.unreadable = True
            raise

    def write(self, data: Any) -> None:
        """The file replaced by data; removed for None (nothing left to put back)."""
        if not self.path or self.unreadable:
            return
        if data is None:
            remove(self.path)
        else:
            save_json(self.path, data)
