"""A BPF program built in a compile child (qosagent/ebpf/compile.py) and opened from its pins: the agent's only way
to load BPF, so that no compiler is ever mapped into it.

A build is named by the digest of everything that shapes its bytecode (the C with its includes, the defines, the
programs asked for, the kernel), `<dir>/<name>-<digest>`, with a manifest pinned beside its programs and maps (their
types, and the C types of each map's key and value as BCC described them). Opening checks every pin against the
manifest, and the manifest against the digest: a build of other source, settings or kernel, or one whose pins were
replaced, is never opened.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from qosagent.ebpf import perf
from qosagent.ebpf.libbpf import (RingBuffer, map_info, obj_get, pinned_map_info, possible_cpus, prog_type,
                                  raw_tracepoint_open)
from qosagent.ebpf.loader import BpfError, headers_present, program_text, require_headers
from qosagent.ebpf.maps import Map, percpu

if TYPE_CHECKING:
    from qosagent.hostfs import HostFS

log = logging.getLogger("qosagent.ebpf")

FORMAT = 1  # of the manifest and the directory: part of the digest
MANIFEST = "manifest"
MANIFEST_MAP_TYPE = 2  # BPF_MAP_TYPE_ARRAY: one entry, the manifest's JSON
# enum bpf_prog_type (UAPI), as BCC's BPF.<TYPE> has them
KPROBE, SCHED_CLS, TRACEPOINT, CGROUP_SKB, SOCK_OPS, RAW_TRACEPOINT = 2, 3, 5, 8, 13, 17
AUTO_TYPES = {"tracepoint": TRACEPOINT, "raw_tracepoint": RAW_TRACEPOINT}
_PERCPU_MAPS = (5, 6, 10)  # BPF_MAP_TYPE_PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
_ARRAYS = (2, 6)  # BPF_MAP_TYPE_ARRAY, PERCPU_ARRAY
_HASHES = (1, 5, 9, 10, 11)  # HASH, PERCPU_HASH, LRU_HASH, LRU_PERCPU_HASH, LPM_TRIE


class StaleBuild(BpfError):
    """Pins that are not the build they are named for."""


def attach_of(func: str) -> str | None:
    """How BCC attaches a function by its name (TRACEPOINT_PROBE, RAW_TRACEPOINT_PROBE), as `kind:target`."""
    if func.startswith("tracepoint__"):
        _, category, event = func.split("__", 2)
        return f"tracepoint:{category}:{event}"
    if func.startswith("raw_tracepoint__"):
        return f"raw_tracepoint:{func[len('raw_tracepoint__'):]}"
    return None


@dataclass(frozen=True)
class Spec:
    """What to build: the entry files bpf/<name>.c, compiled with `defines`; `programs` (function -> program
    type) loaded beside the tracepoint functions BCC loads itself, `kprobes` (function -> kernel function) of those
    attached by kprobe. The build's pins stay after the agent opened them, for the next agent to open."""

    name: str
    sources: tuple[str, ...]
    defines: dict[str, Any]
    programs: dict[str, int] = field(default_factory=dict)
    kprobes: dict[str, str] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)  # map -> the pin of another owner it must still be

    def digest(self) -> str:
        u = os.uname()
        what = [FORMAT, program_text(list(self.sources)), sorted((k, str(v)) for k, v in self.defines.items()),
                sorted(self.programs.items()), sorted(self.kprobes.items()), sorted(self.shared.items()),
                u.release, u.version, u.machine]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:20]


_CTYPES = {"_Bool": ctypes.c_bool, "char": ctypes.c_char, "unsigned char": ctypes.c_ubyte,
           "short": ctypes.c_short, "unsigned short": ctypes.c_ushort, "int": ctypes.c_int,
           "unsigned int": ctypes.c_uint, "long": ctypes.c_long, "unsigned long": ctypes.c_ulong,
           "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong,
           "__int128": ctypes.c_int64 * 2, "unsigned __int128": ctypes.c_uint64 * 2}


def ctype(desc: Any) -> Any:
    """The ctypes type of a C type as BCC describes it in JSON: a scalar's name, or [name, fields, kind] with each
    field [name, type], [name, type, [length]] (an array), [name, type, bits] or a nested struct or union."""
    if isinstance(desc, str):
        if desc not in _CTYPES:
            raise StaleBuild(f"unknown C type {desc!r} in a map's description")
        return _CTYPES[desc]
    name, members = desc[0], desc[1]
    kind = desc[2] if len(desc) > 2 else "struct"
    fields: list[tuple[Any, ...]] = []
    anonymous = []
    for m in members:
        if len(m) == 2:
            fields.append((m[0], ctype(m[1])))
        elif isinstance(m[2], list):
            fields.append((m[0], ctype(m[1]) * m[2][0]))
        elif isinstance(m[2], int):
            fields.append((m[0], ctype(m[1]), m[2]))
        else:  # a nested struct or union, described in place
            member = m[0] or f"__anon{len(anonymous)}"
            if not m[0]:
                anonymous.append(member)
            fields.append((member, ctype(m)))
    attrs: dict[str, Any] = {"_fields_": fields, "_anonymous_": anonymous}
    if kind == "struct_packed":
        attrs["_pack_"] = 1
    return type(str(name) or "anon", (ctypes.Union if kind == "union" else ctypes.Structure,), attrs)


def _leaf(desc: Any, map_type: int) -> Any:
    leaf = ctype(desc)
    if map_type not in _PERCPU_MAPS:
        return leaf
    # One copy per possible CPU, each at an 8-byte boundary: structs that keep it stay structs to the reader.
    return percpu(leaf) if ctypes.sizeof(leaf) % 8 else leaf * possible_cpus()


class Program:
    """The programs and maps of one build, opened from its pins, and the attachments the agent made of them."""

    def __init__(self, path: str, manifest: dict[str, Any]):
        self.path = path
        self.digest = manifest["digest"]
        self.reused = False  # opened from an earlier agent's build
        self._progs: dict[str, int] = {}
        self._errors: dict[str, str] = {}
        self._attach: dict[str, str] = {}
        self._maps: dict[str, Map] = {}
        self.attached: dict[str, int] = {}  # program -> the fd holding its tracepoint or kprobe
        self._rings: list[RingBuffer] = []
        try:
            self._open(manifest)
        except BaseException:
            self.close()
            raise

    def _open(self, manifest: dict[str, Any]) -> None:
        for p in manifest["programs"]:
            if "error" in p:
                self._errors[p["name"]] = p["error"]
                continue
            fd = _get(os.path.join(self.path, p["name"]))
            self._progs[p["name"]] = fd
            got = _prog_type(fd)
            if got != p["type"]:
                raise StaleBuild(f"{self.path}/{p['name']} is a program of type {got}, the build made {p['type']}")
            if p.get("attach"):
                self._attach[p["name"]] = p["attach"]
        for m in manifest["maps"]:
            fd = _get(os.path.join(self.path, m["name"]))
            self._maps[m["name"]] = Map(fd, ctype(m["key"]) if m["key"] is not None else ctypes.c_uint32,
                                        _leaf(m["value"], m["type"]), m["name"], owned=True)
            i = map_info(fd)
            got = (i.type, i.key_size, i.value_size, i.max_entries)
            want = (m["type"], m["key_size"], m["value_size"], m["max_entries"])
            if got != want:
                raise StaleBuild(f"{self.path}/{m['name']}: type/key/value/entries {got}, the build made {want}")

    @classmethod
    def open(cls, path: str, digest: str, shared: dict[str, str] | None = None) -> "Program":
        """The build pinned at path; StaleBuild where it is not the build of `digest`, its pins are not what its
        manifest says, or a map of `shared` is no longer the one pinned there (its owner made a new one)."""
        try:
            info = pinned_map_info(os.path.join(path, MANIFEST))
            if info.type != MANIFEST_MAP_TYPE or info.key_size != 4 or info.max_entries != 1:
                raise StaleBuild(f"{path}/{MANIFEST} is no manifest")
            with Map.pinned(os.path.join(path, MANIFEST), ctypes.c_uint32, ctypes.c_char * info.value_size) as m:
                raw = bytes(m.lookup(0) or b"")
            manifest = json.loads(raw.rstrip(b"\0"))
        except (OSError, ValueError) as e:
            raise StaleBuild(f"{path}: no readable manifest ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("digest") != digest:
            raise StaleBuild(f"{path}: its manifest is of another build")
        try:
            prog = cls(path, manifest)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise StaleBuild(f"{path}: {e}") from None
        for name, pin in (shared or {}).items():
            if not prog.has_map(name) or not os.path.exists(pin):
                continue
            try:
                same = pinned_map_info(pin).id == map_info(prog.map(name).fd).id
            except OSError:
                same = False
            if not same:
                prog.close()
                raise StaleBuild(f"{path}: its {name} is not the map pinned at {pin}")
        return prog

    # ---- what the agent uses ------------------------------------------------------------------------------
    def map(self, name: str) -> Map:
        """The map `name` (KeyError when the build has none)."""
        return self._maps[name]

    def has_map(self, name: str) -> bool:
        return name in self._maps

    def fd(self, name: str) -> int:
        """The program `name`; BpfError with the verifier's words where it was refused."""
        if name in self._errors:
            raise BpfError(f"loading {name} failed: {self._errors[name]}")
        if name not in self._progs:
            raise BpfError(f"the build at {self.path} has no program {name}")
        return self._progs[name]

    @property
    def programs(self) -> list[str]:
        return sorted(self._progs)

    def attach(self, fs: "HostFS", names: Iterable[str] | None = None) -> int:
        """Attach every program (or those of `names`) with a tracepoint, raw tracepoint or kprobe; BpfError naming
        the first that fails (those attached stay, close() detaches them). Returns how many are attached."""
        for name, how in sorted(self._attach.items()):
            if name in self.attached or (names is not None and name not in names):
                continue
            kind, _, target = how.partition(":")
            try:
                if kind == "tracepoint":
                    category, _, event = target.partition(":")
                    self.attached[name] = perf.tracepoint(fs, category, event, self._progs[name])
                elif kind == "raw_tracepoint":
                    self.attached[name] = raw_tracepoint_open(target, self._progs[name])
                else:
                    self.attached[name] = perf.kprobe(fs, target, self._progs[name])
            except OSError as e:
                raise BpfError(f"attaching {name} to {how} failed: {e.strerror or e}") from None
        return len(self.attached)

    def reset(self, keep: Iterable[str] = ()) -> None:
        """Every array and hash-like map of the build emptied, but those of `keep`: a reused build made like a new
        one. Program arrays, ring buffers and socket storage are left as they are (socket storage cannot be
        listed: the program tells an earlier run's state from the current one's itself)."""
        for name, m in self._maps.items():
            if name in keep:
                continue
            info = map_info(m.fd)
            if info.type in _ARRAYS:
                m.zero_all(info.max_entries)
            elif info.type in _HASHES:
                m.clear()

    def detach(self, name: str) -> None:
        fd = self.attached.pop(name, None)
        if fd is not None:
            os.close(fd)

    def ring_buffer(self, name: str, on_sample: Callable[[Any, int], None]) -> RingBuffer:
        rb = RingBuffer(self.map(name).fd, on_sample)
        self._rings.append(rb)
        return rb

    def close(self) -> None:
        for rb in self._rings:
            rb.close()
        self._rings = []
        for fd in [*self.attached.values(), *self._progs.values()]:
            os.close(fd)
        self.attached, self._progs = {}, {}
        for m in self._maps.values():
            m.close()
        self._maps = {}


def _get(path: str) -> int:
    try:
        return obj_get(path)
    except OSError as e:
        raise StaleBuild(f"{path}: {e.strerror}") from None


def _prog_type(fd: int) -> int:
    try:
        return prog_type(fd)
    except OSError as e:
        raise StaleBuild(f"a pin is not a program ({e.strerror})") from None


def remove(path: str) -> None:
    """A build's pins (unpinning: whatever the agent holds open stays loaded)."""
    shutil.rmtree(path, ignore_errors=True)


def _building(path: str) -> bool:
    """Whether path is where a live compile child of another agent is pinning (`<name>-<digest>-tmp<agent pid>`)."""
    m = re.search(r"-tmp(\d+)$", path)
    if m is None or int(m.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_builds(pin_dir: str, name: str) -> list[str]:
    """Every build of `name` under pin_dir, and pin_dir itself when nothing else is left in it."""
    done = []
    for path in builds(pin_dir, name):
        remove(path)
        done.append(f"removed the {name} build {path}")
    try:
        os.rmdir(pin_dir)
        done.append(f"removed {pin_dir}")
    except OSError:
        pass
    return done


def builds(pin_dir: str, name: str) -> list[str]:
    """The builds of `name` under pin_dir, finished or not (a compile child's directory)."""
    try:
        entries = os.listdir(pin_dir)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(pin_dir, e) for e in entries if e.startswith(f"{name}-"))


# Compile children begun ahead of their load (begin): final directory -> the child and when it began.
_ahead: dict[str, tuple[subprocess.Popen[bytes], float]] = {}


def begin(spec: Spec, pin_dir: str) -> None:
    """Start spec's compile child now, in the background, where no finished build is there and a CPU is left for
    it beside one compile in the foreground: load() of the same spec then waits for it instead of starting its own.
    So a build that needs nothing of another capability's start runs beside that start's compile."""
    digest = spec.digest()
    final = os.path.join(pin_dir, f"{spec.name}-{digest}")
    if final in _ahead or os.path.isdir(final) or len(_ahead) + 2 > len(os.sched_getaffinity(0)):
        return
    if not headers_present():
        return  # load says why
    for other in builds(pin_dir, spec.name):
        if not _building(other):
            remove(other)
    try:
        _ahead[final] = (_spawn(spec, digest, _tmp(pin_dir, spec, digest), final), time.monotonic())
    except BpfError as e:
        log.warning("%s: building it at start instead", e)


def load(spec: Spec, pin_dir: str) -> Program:
    """The build of spec: opened from its pins under pin_dir when a finished one is there, else made by a compile
    child (one begun ahead, or one started now) and opened. Other builds of the same name are removed. BpfError
    with the cause."""
    digest = spec.digest()
    final = os.path.join(pin_dir, f"{spec.name}-{digest}")
    tmp = _tmp(pin_dir, spec, digest)
    if final in _ahead:
        _finish(spec, *_ahead.pop(final), tmp, final)
        return _open_new(final, digest)
    prog = None
    if os.path.isdir(final):
        try:
            prog = Program.open(final, digest, spec.shared)
            prog.reused = True
        except StaleBuild as e:
            log.warning("not reusing the %s build (%s): building it again", spec.name, e)
    for other in builds(pin_dir, spec.name):
        if (prog is None or other != final) and not _building(other):
            remove(other)
    if prog is not None:
        log.info("opened the kept %s build %s", spec.name, final)
        return prog
    require_headers()
    _finish(spec, _spawn(spec, digest, tmp, final), time.monotonic(), tmp, final)
    return _open_new(final, digest)


def _tmp(pin_dir: str, spec: Spec, digest: str) -> str:
    return os.path.join(pin_dir, f"{spec.name}-{digest}-tmp{os.getpid()}")  # bpffs refuses names with a dot


def _open_new(final: str, digest: str) -> Program:
    try:
        return Program.open(final, digest)
    except BpfError:
        remove(final)
        raise


def _spawn(spec: Spec, digest: str, tmp: str, final: str) -> subprocess.Popen[bytes]:
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    req = {"sources": list(spec.sources), "defines": {k: str(v) for k, v in spec.defines.items()},
           "programs": spec.programs, "kprobes": spec.kprobes, "digest": digest, "tmp": tmp, "dir": final}
    env = dict(os.environ)
    # The child imports this package from where the agent did: `-m` puts the working directory first on its path,
    # so it runs there.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        child = subprocess.Popen([sys.executable, "-m", "qosagent.ebpf.compile"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=root)
    except OSError as e:
        raise BpfError(f"the compile child for {spec.name} could not start: {e}") from None
    # The request is far below a pipe's buffer: written whole now, the child reads it when it is up.
    assert child.stdin is not None
    child.stdin.write(json.dumps(req).encode())
    child.stdin.close()
    child.stdin = None  # so communicate() does not flush it
    return child


def _finish(spec: Spec, child: subprocess.Popen[bytes], t0: float, tmp: str, final: str) -> None:
    """Wait for the compile child and say how it ended; what a failed one left is removed."""
    try:
        out, err = child.communicate()
    finally:
        if os.path.isdir(tmp):
            remove(tmp)
    if child.returncode:  # a child killed after its rename leaves a whole build, reported failed all the same
        remove(final)
    if child.returncode < 0:
        raise BpfError(f"the compile child for {spec.name} was killed by signal {-child.returncode}")
    if child.returncode:
        lines = err.decode(errors="replace").strip().splitlines()
        raise BpfError(lines[-1] if lines else f"the compile child for {spec.name} exited with {child.returncode}")
    log.info("built %s in a compile child in %.2f s (%s)", spec.name, time.monotonic() - t0,
             out.decode(errors="replace").strip())
