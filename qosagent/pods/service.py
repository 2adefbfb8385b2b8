"""The node's pods as one agent-wide service (qosagent/services.py), beside the serving-namespace Follower: one
PodSource asks the runtime, and a namespace's pod is matched by its cgroup once per listing, for quota's classifier
and latency's attribution alike, whichever of them runs. The agent stops it when it stops."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

from qosagent import exposition
from qosagent.exposition import Family, one
from qosagent.cgroups import HostCgroups
from qosagent.pods.cri import find_runtime
from qosagent.pods.model import Pod, PodsView, by_cgroup_token
from qosagent.pods.source import PodSource, pod_of_pid
from qosagent.services import Service

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.hostfs import HostFS
    from qosagent.netns import ServingNs
    from qosagent.pods.config import PodsConfig

log = logging.getLogger("qosagent.pods")

# The families' names while quota listed the pods, exposed as deprecated copies while metrics.deprecated_names is on
# (off by default; a dashboard on the old name can go on working; the pods are no longer quota's, so neither is the
# name).
# The pods' families; `old`: their names while quota listed the pods (before the agent's pods service), kept as
# deprecated copies.
FAMILIES: tuple[Family[dict[str, Any]], ...] = (
    Family("qosagent_pods_list_errors", "counter", "Failed listings of the container runtime's pods (pods tenants)",
           (), one(lambda st: st["errors"]), old="qosagent_quota_pods_list_errors"),
    Family("qosagent_pods_list_age_seconds", "gauge", "Age of the pods tenants' list of pods (unknown past "
           "pods.stale_after)", (), one(lambda st: st["age_s"]), shown=lambda st: st["age_s"] is not None,
           old="qosagent_quota_pods_list_age_seconds"),
)
RENAMED = exposition.renamed(FAMILIES)


def problem(cfg: "Config", fs: "HostFS", found: list[str] | None = None) -> str | None:
    """Why the tenants that match pods cannot learn them here (no runtime answers), or None; found gets what
    answers."""
    wanted = [f"tenants[{i}]" for i, t in enumerate(cfg.tenants) if t.match.pods is not None]
    if not wanted:
        return None
    runtime, why = find_runtime(fs, cfg.pods.runtime_socket, cfg.pods.timeout)
    if runtime is None:
        return (f"{', '.join(wanted)} match pods, which the agent learns from the container runtime's CRI socket: "
                f"{why} (set pods.runtime_socket, or mount the runtime's socket into the agent)")
    if found is not None:
        found.append(runtime)
    return None


class Pods(Service):
    """The runtime's pods while a tenant matches pods: their source started with the first such tenant (at start,
    or by a reload) and stopped with the last, or replaced when the pods settings change (it starts from the last
    one's list: PodSource `after`). Only a capability's start lists before its first follow; in a tick a new source
    lists on its thread (a dead runtime must not hold the tick). Its Snapshot part is collect()'s dict, None while
    no tenant matches pods."""

    name = "pods"

    @classmethod
    def make(cls, fs: "HostFS", clock: Callable[[], float]) -> "Pods":
        return cls(fs, clock)

    @classmethod
    def problem(cls, config: "Config", fs: "HostFS") -> str | None:
        return problem(config, fs)

    def __init__(self, fs: "HostFS", clock: Callable[[], float]):
        self.fs, self.clock = fs, clock
        self.source: "PodSource | None" = None
        self._before: "PodSource | None" = None  # the last one stopped: where the next one starts from
        self.view: PodsView | None = None
        self._cgroups: "HostCgroups | None" = None
        # Per listing (the view's own mapping): its cgroup tokens, and each namespace's pod as its process showed it.
        self._listing: Any = None
        self._tokens: dict[str, Pod] = {}
        self._matched: dict[int, tuple[int, Pod | None]] = {}

    def current(self, wanted: bool, cfg: "PodsConfig", starting: bool = False) -> PodsView | None:
        """The pods now, for the caller's rules (wanted: one matches pods) and pods settings."""
        if self.source is not None and (not wanted or self.source.cfg != cfg):
            self.stop(wait=False)
        if not wanted:
            return None
        if self.source is None:
            self.source = PodSource(cfg, self.fs, self.clock, self._before)
            self._before = None
            if starting:
                self.source.refresh()
            self.source.start(listed=starting)
            self._cgroups = self._cgroups or HostCgroups(self.fs)
        self.view = self.source.view()
        return self.view

    def pod_of(self, ns: "ServingNs") -> Pod | None:
        """ns's pod among those of the last view (None while they are unknown). Every process of a pod shares its
        network namespace and lies in its cgroup: one is read, once per listing however many capabilities ask."""
        view = self.view
        if view is None or view.pods is None or self._cgroups is None:
            return None
        if view.pods is not self._listing:
            self._listing, self._tokens, self._matched = view.pods, by_cgroup_token(view.pods.values()), {}
        hit = self._matched.get(ns.ino)
        if hit is None or hit[0] != ns.pid:
            hit = self._matched[ns.ino] = (ns.pid, pod_of_pid(self.fs, self._cgroups, ns.pid, self._tokens))
        return hit[1]

    def stop(self, wait: bool = True) -> None:
        """Stop the source; with wait (the agent's stop) until its thread is out of any call to the runtime."""
        src, self.source, self.view = self.source, None, None
        self._listing, self._tokens, self._matched = None, {}, {}
        if src is not None:
            src.stop(wait)
            self._before = src

    def collect(self) -> dict[str, Any] | None:
        """The pods as the capabilities' last follow saw them."""
        v = self.view
        if v is None:
            return None
        return {"runtime": v.runtime, "known": v.pods is not None,
                "ready": None if v.pods is None else len(v.pods), "age_s": v.age, "errors": v.errors,
                "reason": v.reason}

    def status(self, part: dict[str, Any] | None) -> dict[str, Any] | None:
        return part

    def metrics(self, part: dict[str, Any] | None, config: "Config") -> Iterable["Metric"]:
        return metrics(part, config.metrics.deprecated_names)

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        st = status
        return f"pods from {st['runtime'] or 'no runtime yet'}: " + (
            f"{st['ready']} READY, listed {st['age_s']:.1f}s ago" if st["known"] else
            f"unknown ({st['reason']})") + (f"; {st['errors']} failed listings" if st["errors"] else "")


def metrics(st: dict[str, Any] | None, deprecated: bool) -> Iterable["Metric"]:
    if st is None:
        return ()
    fams = exposition.families(FAMILIES, st)
    return exposition.with_deprecated(fams, RENAMED, "while quota listed the pods") if deprecated else fams
