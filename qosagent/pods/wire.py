"""The protobuf wire format, for the few CRI messages the agent exchanges (qosagent/pods/cri.py).

Hand-written rather than generated: the agent needs a handful of string, varint, map and nested-message fields,
and this keeps protoc and the protobuf runtime out of its dependencies. Only what those messages use is here
(varint and length-delimited fields); fields of other wire types are skipped when read, as protobuf's own parsers
do, so a runtime that sends fields this does not know is still understood.
"""

from __future__ import annotations

from typing import Iterator

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a protobuf message (truncated, or a wire type the format does not have)."""


def varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1  # negative int32/int64 go out as ten-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than ten bytes")


def field_bytes(number: int, value: bytes) -> bytes:
    return varint(number << 3 | LEN) + varint(len(value)) + value


def field_str(number: int, value: str) -> bytes:
    """A string field; proto3 leaves the default (empty) out."""
    return field_bytes(number, value.encode()) if value else b""


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3 | VARINT) + varint(value) if value else b""


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) in order: an int for varints, the bytes for length-delimited fields; fixed-width
    fields are skipped."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wt = key >> 3, key & 7
        if wt == VARINT:
            v, i = _read_varint(buf, i)
            yield number, v
        elif wt == LEN:
            n, i = _read_varint(buf, i)
            if i + n > len(buf):
                raise WireError(f"field {number}: {n} bytes announced, {len(buf) - i} left")
            yield number, buf[i:i + n]
            i += n
        elif wt in (I64, I32):
            i += 8 if wt == I64 else 4
            if i > len(buf):
                raise WireError(f"field {number}: truncated fixed-width value")
        else:
            raise WireError(f"field {number}: wire type {wt} (groups or invalid)")


def text(v: int | bytes) -> str:
    if not isinstance(v, bytes):
        raise WireError("expected a length-delimited field, got a varint")
    return v.decode("utf-8", errors="replace")


def map_entry(v: int | bytes) -> tuple[str, str]:
    if not isinstance(v, bytes):
        raise WireError("expected a map entry, got a varint")
    key = value = ""
    for n, x in fields(v):
        if n == 1:
            key = text(x)
        elif n == 2:
            value = text(x)
    return key, value
