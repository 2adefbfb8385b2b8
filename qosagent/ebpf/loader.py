"""Compiling and loading the BPF C in bpf/ through BCC, with errors an operator can act on."""

from __future__ import annotations

import logging
import os
import platform
import re
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("qosagent.ebpf")


class BpfError(Exception):
    pass


def bpf_dir() -> Path:
    """Where the BPF C lives: $QOSAGENT_BPF_DIR, the source checkout, or the system install."""
    candidates = [os.environ.get("QOSAGENT_BPF_DIR"), Path(__file__).resolve().parents[2] / "bpf",
                  "/usr/share/qosagent/bpf"]
    for c in candidates:
        if c and (Path(c) / "include").is_dir():
            return Path(c)
    raise BpfError("BPF sources not found (set QOSAGENT_BPF_DIR to the folder holding bpf/*.c)")


def headers_present() -> bool:
    return os.path.isdir(f"/lib/modules/{platform.release()}/build/include")


# bcc rewrites map calls (tenant_ports.lookup(...)) only in the main source: a shared header that uses maps is
# marked `#include "x.h" // bcc:inline` and pasted in place.
_INLINE = re.compile(r'^#include "([^"]+)"\s*// bcc:inline\s*$', re.M)


def inline_map_headers(text: str, include_dir: Path) -> str:
    return _INLINE.sub(lambda m: (include_dir / m.group(1)).read_text(), text)


def compile_program(name: str, defines: dict[str, Any] | None = None, extra_cflags: Iterable[str] = ()) -> Any:
    """Compile and load bpf/<name>.c; returns the bcc.BPF object. Raises BpfError with the likely cause."""
    if not headers_present():
        raise BpfError(f"no kernel headers at /lib/modules/{platform.release()}/build: run `make setup` "
                       "(or install linux-headers and link them there)")
    try:
        from bcc import BPF
    except ImportError as e:
        raise BpfError(f"bcc is not importable ({e}): install python3-bpfcc and use a venv with "
                       "--system-site-packages") from e
    d = bpf_dir()
    cflags = [f"-I{d / 'include'}", "-Wno-macro-redefined", "-Wno-unused-value"]
    for k, v in (defines or {}).items():
        cflags.append(f"-D{k}={v}")
    cflags += list(extra_cflags)
    src = d / f"{name}.c"
    try:
        return BPF(text=inline_map_headers(src.read_text(), d / "include").encode(), cflags=cflags)
    except Exception as e:  # bcc raises plain Exception for compile and load failures
        raise BpfError(f"loading {src.name} failed: {e}") from e
