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


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"[^\n]*$', re.M)


def inline_includes(path: Path, include_dir: Path, seen: set[Path] | None = None) -> str:
    """The source with its quoted includes from bpf/include pasted in.

    BCC rewrites map calls (`m.lookup(&k)`) only in the main file, so a shared header that declares maps and
    helpers using them (qos_tenant.h) must reach the compiler as part of it."""
    seen = set() if seen is None else seen
    text = path.read_text()

    def paste(m: re.Match[str]) -> str:
        inc = (include_dir / m.group(1)).resolve()
        if not inc.is_file():
            return m.group(0)
        if inc in seen:
            return ""
        seen.add(inc)
        return inline_includes(inc, include_dir, seen)

    return _LOCAL_INCLUDE.sub(paste, text)


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
        b = BPF(text=inline_includes(src, d / "include").encode(), cflags=cflags)
    except Exception as e:  # bcc raises plain Exception for compile and load failures
        raise BpfError(f"loading {src.name} failed: {e}") from e
    _return_compiler_heap()
    return b


def _return_compiler_heap() -> None:
    """Clang runs inside the agent; its freed heap (~35 MB per compile) stays mapped until glibc is asked to trim."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
