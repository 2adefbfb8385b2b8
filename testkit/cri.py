"""CRI in tests: a runtime of our own that serves Version and ListPodSandbox on a unix socket (with the failures a
real one shows: an error status, a hang, bytes that are not protobuf), and the requests a kubelet sends to make and
remove a pod sandbox, for the tests that drive a real containerd."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import grpc

from qosagent.pods import wire
from qosagent.pods.cri import SERVICE


@dataclass
class FakePod:
    uid: str
    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True


def field_map(number: int, entries: Mapping[str, str]) -> bytes:
    """map<string, string>: a repeated message of key = 1, value = 2. The agent only reads maps (wire.map_entry)."""
    return b"".join(wire.field_bytes(number, wire.field_str(1, k) + wire.field_str(2, v))
                    for k, v in sorted(entries.items()))


def pod_sandbox(p: FakePod) -> bytes:
    meta = wire.field_str(1, p.name) + wire.field_str(2, p.uid) + wire.field_str(3, p.namespace) + \
        wire.field_varint(4, 1)
    return (wire.field_str(1, f"sb-{p.uid}") + wire.field_bytes(2, meta) +
            wire.field_varint(3, 0 if p.ready else 1) +
            wire.varint(4 << 3 | wire.VARINT) + wire.varint(1_700_000_000_000_000_000) +  # created_at (int64)
            field_map(5, p.labels) + field_map(6, {"note": "annotations are not read"}))


class FakeRuntime:
    """A CRI runtime service on socket. mode: "ok", "error" (UNAVAILABLE), "hang" (answers after `hang` s),
    "garbage" (a reply that is not protobuf). filtered: whether it applies the READY filter (real ones do)."""

    def __init__(self, socket: str, pods: list[FakePod], filtered: bool = True):
        self.socket, self.pods, self.filtered = socket, pods, filtered
        self.mode = "ok"
        self.hang = 2.0
        self.requests: list[tuple[str, bytes]] = []
        self._release = threading.Event()
        self.server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(4))
        handlers = {"Version": self._version, "ListPodSandbox": self._list}
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            SERVICE.strip("/"), {k: grpc.unary_unary_rpc_method_handler(self._wrap(k, f))
                                 for k, f in handlers.items()})])
        self.server.add_insecure_port(f"unix:{socket}")

    def __enter__(self) -> "FakeRuntime":
        self.server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release.set()
        self.server.stop(0).wait()

    def _wrap(self, name: str, f: Callable[[bytes], bytes]) -> Callable[[bytes, Any], bytes]:
        def handler(req: bytes, ctx: Any) -> bytes:
            self.requests.append((name, req))
            if self.mode == "error":
                ctx.abort(grpc.StatusCode.UNAVAILABLE, "runtime restarting")
            if self.mode == "hang":
                self._release.wait(self.hang)
            if self.mode == "garbage":
                return b"\x0a\xff\xff"  # field 1, a length longer than the message
            return f(req)
        return handler

    def _version(self, req: bytes) -> bytes:
        return wire.field_str(1, "0.1.0") + wire.field_str(2, "fakeruntime") + wire.field_str(3, "9.9") + \
            wire.field_str(4, "v1")

    def _list(self, req: bytes) -> bytes:
        return b"".join(wire.field_bytes(1, pod_sandbox(p)) for p in self.pods if p.ready or not self.filtered)


# ---- what a kubelet sends to make a pod (real-runtime tests) ------------------------------------------------
def run_pod_sandbox_request(name: str, uid: str, namespace: str, labels: Mapping[str, str], cgroup_parent: str,
                            log_dir: str) -> bytes:
    meta = wire.field_str(1, name) + wire.field_str(2, uid) + wire.field_str(3, namespace)
    linux = wire.field_str(1, cgroup_parent)  # LinuxPodSandboxConfig.cgroup_parent
    config = (wire.field_bytes(1, meta) + wire.field_str(2, name) + wire.field_str(3, log_dir) +
              field_map(6, labels) + wire.field_bytes(8, linux))
    return wire.field_bytes(1, config)  # RunPodSandboxRequest.config


def sandbox_id(response: bytes) -> str:
    return next(wire.text(v) for n, v in wire.fields(response) if n == 1)


def by_sandbox_id(sandbox: str) -> bytes:
    """StopPodSandboxRequest and RemovePodSandboxRequest: pod_sandbox_id = 1."""
    return wire.field_str(1, sandbox)
