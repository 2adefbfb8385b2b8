"""Compiling and loading the BPF C in bpf/ through BCC, with errors an operator can act on. Only the compile child
(qosagent/ebpf/compile.py) and tests call compile_program: the agent opens what the child pinned
(qosagent/ebpf/pinned.py)."""

from __future__ import annotations

import logging
import os
import platform
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

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


def require_headers() -> None:
    """BCC compiles against the running kernel's headers: BpfError saying how to get them when they are missing."""
    if not headers_present():
        raise BpfError(f"no kernel headers at /lib/modules/{platform.release()}/build: run `make setup` "
                       "(or install linux-headers and link them there)")


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"[^\n]*$', re.M)


def inline_includes(path: Path, include_dir: Path, within: tuple[Path, ...] = ()) -> str:
    """The source with its quoted includes from bpf/include pasted in, each where it is included.

    BCC rewrites map calls (`m.lookup(&k)`) only in the main file, so a shared header that declares maps and
    helpers using them (qos_tenant.h, lat_state.h) must reach the compiler as part of it. Every header has an
    include guard, which keeps a second paste empty as the preprocessor would; pasting at every include (rather
    than at the first only) keeps a header included under an #ifdef from going missing where a later file needs
    it unconditionally. `within` (the files being pasted) stops an include cycle."""
    text = path.read_text()

    def paste(m: re.Match[str]) -> str:
        inc = (include_dir / m.group(1)).resolve()
        if not inc.is_file():
            return m.group(0)
        if inc in within:
            return ""
        return inline_includes(inc, include_dir, (*within, inc))

    return _LOCAL_INCLUDE.sub(paste, text)


def program_text(sources: str | Sequence[str]) -> str:
    """One program's C from its entry files (bpf/<name>.c each, in order), compiled as one unit so that they share
    their maps, with the quoted includes pasted in."""
    d = bpf_dir()
    names = [sources] if isinstance(sources, str) else list(sources)
    return "\n".join(inline_includes(d / f"{n}.c", d / "include") for n in names)


def compile_program(sources: str | Sequence[str], defines: dict[str, Any] | None = None,
                    extra_cflags: Iterable[str] = ()) -> Any:
    """Compile and load the entry files bpf/<name>.c of `sources` as one program; returns the bcc.BPF object.
    Raises BpfError with the likely cause."""
    require_headers()
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
    names = [sources] if isinstance(sources, str) else list(sources)
    try:
        b = BPF(text=program_text(names).encode(), cflags=cflags)
    except Exception as e:  # bcc raises plain Exception for compile and load failures
        raise BpfError(f"loading {' + '.join(f'{n}.c' for n in names)} failed: {e}") from e
    return b
