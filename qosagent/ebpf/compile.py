"""The compile child: `python -m qosagent.ebpf.compile` reads one build request (JSON, qosagent/ebpf/pinned.py
writes it) on stdin, compiles and loads the program through BCC, pins its programs, its maps and a manifest in a
directory of bpffs, and exits. Clang and LLVM (~130 MB resident) live and die with this process: the agent opens
the pins and never maps them.

The pins are made in a directory of their own (`tmp`), renamed to `dir` only once all are there, so that a child
that dies half-way leaves nothing another agent could take for a finished build (the agent removes `tmp`).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

from qosagent.ebpf.loader import compile_program
from qosagent.ebpf.libbpf import map_create, map_info, obj_pin
from qosagent.ebpf.maps import Map
from qosagent.ebpf.pinned import AUTO_TYPES, MANIFEST, MANIFEST_MAP_TYPE, attach_of


def build(req: dict[str, Any]) -> dict[str, Any]:
    from bcc import lib

    tmp = req["tmp"]
    os.makedirs(tmp)
    t0 = time.monotonic()
    b = compile_program(req["sources"], req["defines"])
    t1 = time.monotonic()
    progs = []
    # bcc loads and attaches the TRACEPOINT_PROBE and RAW_TRACEPOINT_PROBE functions itself; the agent attaches
    # them again from the pins.
    for name, fn in b.funcs.items():
        attach = attach_of(name.decode())
        if attach:
            obj_pin(fn.fd, os.path.join(tmp, name.decode()))
            progs.append({"name": name.decode(), "type": AUTO_TYPES[attach.split(":")[0]], "attach": attach})
    for name, kind in req["programs"].items():
        fn_name = req["kprobes"].get(name)
        entry: dict[str, Any] = {"name": name, "type": kind, "attach": f"kprobe:{fn_name}" if fn_name else None}
        try:
            fn = b.load_func(name.encode(), kind)
            obj_pin(fn.fd, os.path.join(tmp, name))
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception; the agent decides what a refusal costs
            entry["error"] = " ".join(str(e).split())[-2000:]
        progs.append(entry)
    t2 = time.monotonic()
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    maps = []
    for i in range(lib.bpf_num_tables(b.module)):
        name = lib.bpf_table_name(b.module, i)
        fd = lib.bpf_table_fd(b.module, name)
        if fd < 0:
            continue
        info = map_info(fd)
        obj_pin(fd, os.path.join(tmp, name.decode()))
        maps.append({"name": name.decode(), "type": info.type, "key_size": info.key_size,
                     "value_size": info.value_size, "max_entries": info.max_entries,
                     "key": json.loads(lib.bpf_table_key_desc(b.module, name).decode() or "null"),
                     "value": json.loads(lib.bpf_table_leaf_desc(b.module, name).decode() or "null")})
    manifest = json.dumps({"digest": req["digest"], "programs": progs, "maps": maps}).encode()
    fd = map_create(MANIFEST_MAP_TYPE, "qos_manifest", 4, len(manifest), 1)
    try:
        Map(fd, ctypes.c_uint32, ctypes.c_char * len(manifest)).update(0, manifest)
        obj_pin(fd, os.path.join(tmp, MANIFEST))
    finally:
        os.close(fd)
    os.rename(tmp, req["dir"])
    # What the agent's log line says of the build: where a cold start's time goes (BCC's compile, with the
    # tracepoint functions it loads itself, against the verifier's loads of the others).
    return {"programs": len(progs), "maps": len(maps), "compile_s": round(t1 - t0, 3), "load_s": round(t2 - t1, 3)}


def main() -> None:
    req = json.load(sys.stdin)
    try:
        out = build(req)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the agent as one message
        print(" ".join(str(e).split()), file=sys.stderr, flush=True)
        os._exit(1)
    print(json.dumps(out), flush=True)
    # Straight out: bcc's exit handlers would detach and free what the pins now hold, for nothing.
    os._exit(0)


if __name__ == "__main__":
    main()
