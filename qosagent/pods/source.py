"""The node's pods, listed from the container runtime on a thread of its own, so that a slow or dead runtime never
delays a tick: the tick takes the latest list (PodSource.view), which holds for pods.stale_after and is then
unknown. Failures are logged once per streak and counted, never raised."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping

from qosagent.cgroups import KINDS, cgroup_paths
from qosagent.pods.cri import DEFAULT_SOCKETS, CriClient, CriError, connect
from qosagent.pods.model import Pod, PodsView, pod_of_cgroup

if TYPE_CHECKING:
    from qosagent.cgroups import HostCgroups
    from qosagent.hostfs import HostFS
    from qosagent.pods.config import PodsConfig

log = logging.getLogger("qosagent.pods")


class PodSource:
    """after: the source this one replaces (a reload's new pods settings, pods tenants back after none). Its last
    list is where this one starts, with its age, so pods never go unknown for a follow while this thread lists
    (stale_after still bounds it); its count of failed listings goes on, as a counter must within a process."""

    def __init__(self, cfg: "PodsConfig", fs: "HostFS", clock: Callable[[], float] = time.monotonic,
                 after: "PodSource | None" = None):
        self.cfg, self.fs, self.clock = cfg, fs, clock
        self._lock = threading.Lock()
        self._pods: dict[str, Pod] | None = None
        self._at: float | None = None
        self._runtime = ""
        self._errors = 0
        self._failing = ""  # the last error while a streak of them lasts
        self._client: CriClient | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if after is not None:
            with after._lock:
                self._errors = after._errors
                # Another socket's list is not this runtime's pods (runtime_socket needs a restart: a safeguard).
                if after.cfg.runtime_socket == cfg.runtime_socket:
                    self._pods, self._at, self._runtime, self._failing = \
                        after._pods, after._at, after._runtime, after._failing

    def start(self, listed: bool = False) -> None:
        """listed: the caller has just refreshed (a capability's start), so the thread's first listing is one
        refresh period away, not a second one at once."""
        self._thread = threading.Thread(target=self._run, args=(listed,), name="qosagent-pods", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = False) -> None:
        """Signals the thread, which closes its channel as it ends. Only wait (the agent's own stop) waits for it:
        a refresh in flight can take a runtime deadline per call, which no tick or reload commit may sit through."""
        self._stop.set()
        if self._thread is None:
            self._close()
        elif wait:
            # A refresh's longest: Version on each socket it may try, then the listing, each with its deadline.
            self._thread.join(self.cfg.timeout * (len(DEFAULT_SOCKETS) + 1) + 1)

    def _close(self) -> None:
        with self._lock:  # taken before closing: only one of two closers gets it
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _run(self, listed: bool) -> None:
        try:
            if listed:
                self._stop.wait(self.cfg.refresh)
            while not self._stop.is_set():
                self.refresh()
                self._stop.wait(self.cfg.refresh)
        finally:
            self._close()

    def refresh(self) -> None:
        """One listing: the thread's step (tests call it directly)."""
        self._list()
        if self._stop.is_set():  # a refresh that outlived stop()'s wait must not leave a client open
            self._close()

    def _list(self) -> None:
        try:
            if self._client is None:
                self._client, version = connect(self.fs, self.cfg.runtime_socket, self.cfg.timeout)
                self._runtime = f"{version} at {self._client.shown}"
                log.info("listing READY pod sandboxes from %s every %gs", self._runtime, self.cfg.refresh)
            pods = self._client.ready_pods()
        # Anything else too (grpc raises ValueError on a closed channel, its own errors are not all RpcError): an
        # exception out of here would end the thread, and the pods would go unknown for good with nothing counted.
        except Exception as e:  # noqa: BLE001
            why = str(e) if isinstance(e, CriError) else f"listing pods: {type(e).__name__}: {e}"
            with self._lock:
                self._errors += 1
                first, self._failing = not self._failing, why
            if first:
                log.warning("cannot list pods (%s); the last list holds for %gs, then pods are unknown",
                            why, self.cfg.stale_after)
            self._close()  # the runtime may come back elsewhere (a restart, another default)
            return
        with self._lock:
            self._pods, self._at = {p.uid: p for p in pods}, self.clock()
            if self._failing:
                log.info("%s answers again (%d pods READY)", self._runtime, len(pods))
            self._failing = ""

    def view(self) -> PodsView:
        with self._lock:
            pods, at, errors, failing = self._pods, self._at, self._errors, self._failing
        age = None if at is None else self.clock() - at
        if pods is None or age is None:
            return PodsView(None, self._runtime, None, errors, failing or "not listed yet")
        if age > self.cfg.stale_after:
            return PodsView(None, self._runtime, age, errors,
                            f"the last list is {age:.0f}s old (pods.stale_after {self.cfg.stale_after:g}s): "
                            f"{failing or 'no answer since'}")
        return PodsView(pods, self._runtime, age, errors, failing)


def pod_of_pid(fs: "HostFS", cgroups: "HostCgroups", pid: int, tokens: Mapping[str, Pod]) -> Pod | None:
    """The pod a process belongs to, by its cgroup paths as the host names them (tokens: by_cgroup_token)."""
    text = fs.try_read(f"/proc/{pid}/cgroup") or ""
    return pod_of_cgroup((cgroups.host(kind, path) for kind, path in zip(KINDS, cgroup_paths(text)) if path), tokens)
