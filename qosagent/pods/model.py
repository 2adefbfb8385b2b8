"""Pods as the container runtime lists them, and which pod a process belongs to by its cgroup. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping


@dataclass(frozen=True)
class Pod:
    uid: str
    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PodsView:
    """The pods known at one moment. pods is None while they are unknown (never listed, or the last list is older
    than pods.stale_after); reason says why, runtime what answered."""

    pods: Mapping[str, Pod] | None  # by uid
    runtime: str = ""
    age: float | None = None  # seconds since the list was taken
    errors: int = 0  # failed listings since start
    reason: str = ""


def selects(pod: Pod, namespace: str | None, labels: Mapping[str, str]) -> bool:
    """match.pods: the namespace is equal (when given) and every label given is equal."""
    return (namespace is None or pod.namespace == namespace) and all(pod.labels.get(k) == v
                                                                     for k, v in labels.items())


def by_cgroup_token(pods: Iterable[Pod]) -> dict[str, Pod]:
    """The name each pod's cgroup has under the kubelet's tree: `pod<uid>` (cgroupfs driver) and
    `pod<uid with _ for ->` (systemd driver, as the last part of `kubepods-<qos>-pod<uid>.slice`)."""
    out = {}
    for p in pods:
        out[f"pod{p.uid}"] = p
        out[f"pod{p.uid.replace('-', '_')}"] = p
    return out


def pod_of_cgroup(paths: Iterable[str], tokens: Mapping[str, Pod]) -> Pod | None:
    """The pod whose cgroup one of paths (host-view cgroup paths of one process) lies in."""
    for path in paths:
        for part in path.split("/"):
            if not part.startswith("pod") and "-pod" not in part:
                continue
            if part.endswith(".slice"):
                part = part[:-len(".slice")].rsplit("-", 1)[-1]
            pod = tokens.get(part)
            if pod is not None:
                return pod
    return None
