"""What the BPF C in bpf/ declares, read from the source: integer #defines, struct layouts and map declarations.

Enough of C for our headers and programs (fixed-width UAPI integer types, arrays, nested structs, packed), computed
with the C ABI's rules for x86-64 and arm64 alike (natural alignment). Anything a checked struct holds that this
does not understand fails loudly rather than being guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

BPF = Path(__file__).resolve().parents[1] / "bpf"
SOURCES = sorted((BPF / "include").glob("*.h")) + sorted(BPF.glob("*.c"))

_SCALARS = {"__u8": 1, "__s8": 1, "char": 1, "__u16": 2, "__s16": 2, "__u32": 4, "__s32": 4, "int": 4,
            "__u64": 8, "__s64": 8, "__be16": 2, "__be32": 4}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    size: int
    type: str  # "__u32", "struct qos_bucket_limit", with "[N]" per array dimension


@dataclass(frozen=True)
class Struct:
    name: str
    size: int
    align: int
    fields: tuple[Field, ...]


@dataclass(frozen=True)
class MapDecl:
    kind: str  # "array", "hash", "percpu_array", "lru_hash", "lpm_trie", "prog"
    key: str
    value: str
    name: str
    max_entries: str  # the C expression: some are the agent's -D defines (Headers.eval with them set)


class Headers:
    def __init__(self, sources: list[Path] = SOURCES):
        self.defines: dict[str, set[str]] = {}
        self._struct_src: dict[str, tuple[str, bool]] = {}
        self._map_src: list[tuple[str, str, str]] = []
        for path in sources:
            self._scan(_strip_comments(path.read_text()), path.stem)
        self._structs: dict[str, Struct] = {}

    def _scan(self, text: str, origin: str) -> None:
        text = re.sub(r"\\\n", " ", text)
        for m in re.finditer(r"^\s*#\s*define\s+(\w+)\b(?!\()[ \t]*([^\n]*)$", text, re.M):
            self.defines.setdefault(m.group(1), set()).add(m.group(2).strip())
        for m in re.finditer(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}\s*(__attribute__\s*\(\(\s*packed\s*\)\))?\s*;", text):
            self._struct_src[m.group(1)] = (m.group(2), bool(m.group(3)))
        for m in re.finditer(r"\b(BPF_\w+)\s*\(([^;]*?)\)\s*;", text, re.S):
            self._map_src.append((origin, m.group(1), m.group(2)))

    def define(self, name: str) -> int:
        """The integer a #define names, its references to other defines resolved; defined twice, both the same."""
        bodies = self.defines.get(name)
        if not bodies:
            raise KeyError(f"#define {name} not found in bpf/")
        values = {self.eval(b) for b in bodies}
        if len(values) != 1:
            raise ValueError(f"#define {name} has several values: {sorted(values)}")
        return values.pop()

    def eval(self, expr: str) -> int:
        expr = re.sub(r"\(\s*(?:__u\d+|__s\d+|int|unsigned|long|\s)+\)", "", expr)  # casts
        expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)(?:[uUlL]+)\b", r"\1", expr)  # suffixes
        expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(self.define(m.group(0))), expr)
        if not re.fullmatch(r"[0-9a-fA-FxX\s()+\-*/<>|&~^]*", expr):
            raise ValueError(f"not an integer expression: {expr!r}")
        return int(eval(expr.replace("/", "//")))  # noqa: S307 - digits and operators only, checked above

    def struct(self, name: str) -> Struct:
        if name not in self._structs:
            self._structs[name] = self._layout(name)
        return self._structs[name]

    def _type(self, t: str) -> tuple[int, int]:
        """(size, alignment) of a scalar or struct type."""
        t = " ".join(t.split())
        if t in _SCALARS:
            return _SCALARS[t], _SCALARS[t]
        m = re.fullmatch(r"struct (\w+)", t)
        if m:
            s = self.struct(m.group(1))
            return s.size, s.align
        raise ValueError(f"type {t!r} not understood")

    def _layout(self, name: str) -> Struct:
        if name not in self._struct_src:
            raise KeyError(f"struct {name} not found in bpf/")
        body, packed = self._struct_src[name]
        fields, off, align = [], 0, 1
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = re.fullmatch(r"((?:struct\s+)?\w+)\s+(.+)", decl, re.S)
            if not m:
                raise ValueError(f"struct {name}: field {decl!r} not understood")
            size, al = self._type(m.group(1))
            al = 1 if packed else al
            for d in m.group(2).split(","):
                dm = re.fullmatch(r"\s*(\w+)((?:\s*\[[^\]]+\])*)\s*", d)
                if not dm:
                    raise ValueError(f"struct {name}: declarator {d!r} not understood")
                dims = [self.eval(x) for x in re.findall(r"\[([^\]]+)\]", dm.group(2))]
                n = 1
                for x in dims:
                    n *= x
                off = (off + al - 1) // al * al
                typ = " ".join(m.group(1).split()) + "".join(f"[{x}]" for x in dims)
                fields.append(Field(dm.group(1), off, size * n, typ))
                off += size * n
                align = max(align, al)
        size = (off + align - 1) // align * align
        return Struct(name, size, align, tuple(fields))

    def sizeof(self, t: str) -> int:
        return self._type(t)[0]

    def maps(self, program: str) -> dict[str, MapDecl]:
        """Every map bpf/<program>.c declares with bcc's macros, by name."""
        out = {}
        for origin, macro, args in self._map_src:
            if origin != program:
                continue
            a = [x.strip() for x in args.replace("\n", " ").split(",")]
            if macro in ("BPF_TABLE", "BPF_TABLE_PINNED", "BPF_TABLE_PINNED7", "BPF_F_TABLE"):
                kind, key, value, name, n = a[0].strip('"'), a[1], a[2], a[3], a[4]
            elif macro in ("BPF_HASH", "BPF_ARRAY", "BPF_PERCPU_ARRAY"):
                kind = {"BPF_HASH": "hash", "BPF_ARRAY": "array", "BPF_PERCPU_ARRAY": "percpu_array"}[macro]
                if kind == "hash":
                    name, key, value, n = a[0], a[1], a[2], a[3]
                else:
                    name, key, value, n = a[0], "__u32", a[1], a[2]
            elif macro == "BPF_PROG_ARRAY":
                kind, name, key, value, n = "prog", a[0], "__u32", "__u32", a[1]
            else:
                continue
            out[name] = MapDecl(kind, key, value, name, n)
        return out
