"""A client of the container runtime's CRI API (Kubernetes `runtime.v1.RuntimeService`) over its unix socket:
containerd and CRI-O both serve it to the kubelet on the node, so the agent learns the node's pods where they run,
never from the API server.

Only two calls: Version (is this socket a CRI runtime?) and ListPodSandbox (the READY sandboxes: uid, namespace,
name, labels). Messages are encoded by hand (qosagent/pods/wire.py); the field numbers below are the CRI API's.
grpc is imported only when a client is made, that is only when a tenant matches pods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qosagent.pods import wire
from qosagent.pods.model import Pod

if TYPE_CHECKING:
    from qosagent.hostfs import HostFS

SERVICE = "/runtime.v1.RuntimeService/"
API = "v1"
DEFAULT_SOCKETS = ("/run/containerd/containerd.sock", "/run/crio/crio.sock")
SANDBOX_READY = 0  # PodSandboxState
# A node's pod list with labels runs to a few hundred kB; the kubelet allows its runtime 16 MiB.
MAX_MESSAGE = 16 << 20


class CriError(Exception):
    """A runtime that cannot be reached or answers with an error: what, and where."""


# ---- messages ----------------------------------------------------------------------------------------------
def version_request() -> bytes:
    return wire.field_str(1, API)  # VersionRequest.version


@dataclass(frozen=True)
class Version:
    runtime_name: str
    runtime_version: str
    runtime_api_version: str

    def __str__(self) -> str:
        return f"{self.runtime_name} {self.runtime_version} (CRI {self.runtime_api_version})"


def parse_version(buf: bytes) -> Version:
    got = {2: "", 3: "", 4: ""}  # runtime_name, runtime_version, runtime_api_version
    for n, v in wire.fields(buf):
        if n in got:
            got[n] = wire.text(v)
    return Version(got[2], got[3], got[4])


def list_ready_request() -> bytes:
    """ListPodSandboxRequest{filter: {state: {state: SANDBOX_READY}}}. READY is the enum's zero, which proto3 leaves
    out: the state message is sent empty, and its presence is what asks for the filter."""
    return wire.field_bytes(1, wire.field_bytes(2, wire.field_varint(1, SANDBOX_READY)))


def _pod(buf: bytes) -> tuple[Pod, int]:
    """(the pod, its state) from a PodSandbox message."""
    name = uid = namespace = ""
    state = SANDBOX_READY
    labels: dict[str, str] = {}
    for n, v in wire.fields(buf):
        if n == 2 and isinstance(v, bytes):  # PodSandboxMetadata
            for m, x in wire.fields(v):
                if m == 1:
                    name = wire.text(x)
                elif m == 2:
                    uid = wire.text(x)
                elif m == 3:
                    namespace = wire.text(x)
        elif n == 3 and isinstance(v, int):
            state = v
        elif n == 5:
            k, val = wire.map_entry(v)
            labels[k] = val
    return Pod(uid=uid, namespace=namespace, name=name, labels=labels), state


def parse_ready_pods(buf: bytes) -> list[Pod]:
    """The READY sandboxes of a ListPodSandboxResponse (the filter asked for them; a runtime that ignored it is
    filtered here), those without a uid left out."""
    out = []
    for n, v in wire.fields(buf):
        if n == 1 and isinstance(v, bytes):
            pod, state = _pod(v)
            if state == SANDBOX_READY and pod.uid:
                out.append(pod)
    return out


# ---- the client --------------------------------------------------------------------------------------------
def grpc_module() -> Any:
    try:
        import grpc
    except ImportError:
        raise CriError("tenants that match pods need the grpcio package (pip install 'qosagent[pods]', or "
                       "Debian's python3-grpcio)") from None
    return grpc


class CriClient:
    """One runtime socket. Every call has a deadline; every failure is a CriError."""

    def __init__(self, socket: str, timeout: float, shown: str | None = None):
        grpc = grpc_module()
        self._rpc_error = grpc.RpcError
        self.socket = socket
        self.shown = shown or socket  # the path as the host names it (socket may be under --host-root)
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix:{os.path.abspath(socket)}", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE)])

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: bytes) -> bytes:
        fn = self.channel.unary_unary(SERVICE + method)  # no (de)serializers: bytes in, bytes out
        try:
            return fn(request, timeout=self.timeout)
        except self._rpc_error as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            raise CriError(f"{method} on {self.shown}: {getattr(code, 'name', code)}: {details}") from None

    def version(self) -> Version:
        try:
            return parse_version(self._call("Version", version_request()))
        except wire.WireError as e:
            raise CriError(f"Version on {self.shown}: not a CRI answer: {e}") from None

    def ready_pods(self) -> list[Pod]:
        try:
            return parse_ready_pods(self._call("ListPodSandbox", list_ready_request()))
        except wire.WireError as e:
            raise CriError(f"ListPodSandbox on {self.shown}: not a CRI answer: {e}") from None


def connect(fs: "HostFS", configured: str | None, timeout: float) -> tuple[CriClient, Version]:
    """A client of the configured socket, or of the first default one that answers Version; CriError naming
    every socket tried and why when none does."""
    tried = []
    for shown in (configured,) if configured else DEFAULT_SOCKETS:
        path = str(fs.path(shown))
        if not os.path.exists(path):
            tried.append(f"{shown}: absent")
            continue
        client = CriClient(path, timeout, shown)
        try:
            return client, client.version()
        except CriError as e:
            client.close()
            tried.append(str(e))
    raise CriError("no container runtime answers: " + "; ".join(tried))


def find_runtime(fs: "HostFS", configured: str | None, timeout: float) -> tuple[str | None, str]:
    """(what answers, e.g. "containerd 1.6.20 (CRI v1) at /run/containerd/containerd.sock", None) or (None, why
    none does), for `qosagent check` and quota's probe; the client is closed again."""
    try:
        client, version = connect(fs, configured, timeout)
    except CriError as e:
        return None, str(e)
    client.close()
    return f"{version} at {client.shown}", ""
