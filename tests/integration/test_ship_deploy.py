"""deploy/: the Kubernetes manifests build with kustomize, validate offline on every Kubernetes minor from 1.28, and
agree with each other, the unit and the agent; the alert rules pass promtool; the image's entrypoint picks kernel
headers like scripts/setup.sh; the Dockerfile passes hadolint."""

from __future__ import annotations

import ast
import copy
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from qosagent import config as config_mod
from tests.conftest import REPO, require
from tests.integration.test_ship_systemd import unit_settings

K8S = REPO / "deploy" / "kubernetes"
COMPONENTS = K8S / "components"
# Prometheus-operator kinds: kubernetes-validate carries only the core API's schemas, so these are checked by what
# consumes them (promtool for the rules; the Service they select, below).
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
# The oldest minor the manifests support: still in vendors' support windows (EKS, AKS, GKE extended).
OLDEST_MINOR = 28


def minors() -> list[str]:
    """Every minor from OLDEST_MINOR to the newest kubernetes-validate has schemas for."""
    newest = int(kubernetes_validate.utils.latest_version().split(".")[1])
    return [f"1.{m}" for m in range(OLDEST_MINOR, newest + 1)]


def kustomize(path: Path) -> list[dict[str, Any]]:
    require(shutil.which("kubectl") is not None, "kubectl not installed")
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def _built(path: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(Path(path)))


def manifests(path: Path = K8S) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_built(str(path))))


def with_components(tmp_path: Path, *components: str, base: Path = K8S) -> list[dict[str, Any]]:
    """The base with the named components, as an operator's overlay would compose them."""
    overlay = tmp_path / ("overlay-" + "-".join(components or ("none",)))
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(base, overlay)],
        "components": [os.path.relpath(COMPONENTS / c, overlay) for c in components]}))
    return kustomize(overlay)


def by_kind(kind: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (doc,) = [d for d in (manifests() if docs is None else docs) if d["kind"] == kind]
    return doc


def test_every_manifest_and_component_is_used() -> None:
    """No manifest lies beside the kustomizations unlisted (it would never be applied, nor validated here)."""
    for kust in K8S.rglob("kustomization.yaml"):
        listed = yaml.safe_load(kust.read_text())
        names = set(listed.get("resources", [])) | {f for g in listed.get("configMapGenerator", [])
                                                      for f in g.get("files", [])}
        here = {p.name for p in kust.parent.glob("*.yaml")} - {"kustomization.yaml"}
        assert here <= names, (kust, here - names)
    assert {p.name for p in COMPONENTS.iterdir()} == {
        "kubernetes-1.28", "kube-prometheus-stack", "placement", "writable-sys", "metrics-tls"}


def _core(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] not in CRD_KINDS]


@pytest.mark.parametrize("minor", minors())
def test_manifests_validate_strictly_on_every_minor(minor: str, tmp_path: Path) -> None:
    """1.30 and later take the base as it is; 1.28 and 1.29 with components/kubernetes-1.28. Every shipped overlay
    and component is validated on every minor it is for."""
    old = int(minor.split(".")[1]) < 30
    variants = {"base": with_components(tmp_path, "kubernetes-1.28") if old else manifests(),
                "all components": with_components(tmp_path, *(["kubernetes-1.28"] if old else []), "placement",
                                                  "writable-sys", "kube-prometheus-stack", "metrics-tls")}
    if not old:
        variants["node pools"] = manifests(K8S / "overlays" / "node-pools")
    for name, docs in variants.items():
        for doc in _core(docs):
            try:
                kubernetes_validate.validate(doc, minor, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']} on {minor}: {e}") from e


def test_the_base_needs_the_old_minor_component_before_1_30() -> None:
    """The reason components/kubernetes-1.28 exists: 1.29's schema has no appArmorProfile field."""
    with pytest.raises(kubernetes_validate.ValidationError, match="appArmorProfile"):
        kubernetes_validate.validate(by_kind("DaemonSet"), "1.29", strict=True)


def test_old_minor_component_sets_apparmor_by_annotation(tmp_path: Path) -> None:
    pod = by_kind("DaemonSet", with_components(tmp_path, "kubernetes-1.28"))["spec"]["template"]
    assert "appArmorProfile" not in pod["spec"]["containers"][0]["securityContext"]
    assert pod["metadata"]["annotations"] == {"container.apparmor.security.beta.kubernetes.io/qosagent": "unconfined"}
    assert _container()["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}


def test_strict_validation_catches_a_misplaced_field() -> None:
    ds = copy.deepcopy(by_kind("DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, minors()[-1], strict=True)


def test_node_critical_priority_is_admitted_outside_kube_system() -> None:
    """GKE refuses system-node-critical pods outside kube-system unless a ResourceQuota there covers the class."""
    ds, quota = by_kind("DaemonSet"), by_kind("ResourceQuota")
    cls = ds["spec"]["template"]["spec"]["priorityClassName"]
    assert quota["metadata"]["namespace"] == ds["metadata"]["namespace"] != "kube-system"
    (expr,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert expr == {"scopeName": "PriorityClass", "operator": "In", "values": [cls]}


def test_kube_prometheus_stack_component_labels_what_its_selectors_pick(tmp_path: Path) -> None:
    docs = with_components(tmp_path, "kube-prometheus-stack")
    for kind in CRD_KINDS:
        assert by_kind(kind, docs)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert all("release" not in by_kind(k)["metadata"]["labels"] for k in CRD_KINDS)


def test_node_pools_each_get_their_own_config_and_nodes() -> None:
    docs = manifests(K8S / "overlays" / "node-pools")
    daemonsets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DaemonSet"}
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert set(daemonsets) == {"qosagent-gpu", "qosagent-cpu"}
    assert [d["kind"] for d in docs].count("Service") == 1  # one headless Service (and scrape) for every pool
    for name, ds in daemonsets.items():
        pod = ds["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "config"]
        cfg = config_mod.parse_text(maps[vol["configMap"]["name"]]["data"]["config.yaml"], name)
        caps = set(pod["containers"][0]["securityContext"]["capabilities"]["add"])
        assert ("SYS_NICE" in caps) == cfg.placement.enabled, name
        assert {"SYS_PTRACE", "DAC_READ_SEARCH"} <= caps, name  # every pool follows pods and finds servers
    gpu, cpu = (daemonsets[n]["spec"]["template"]["spec"] for n in ("qosagent-gpu", "qosagent-cpu"))
    assert gpu["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    (term,) = cpu["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}]


def _container() -> dict[str, Any]:
    return by_kind("DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def _configmap_config() -> config_mod.Config:
    return config_mod.parse_text(by_kind("ConfigMap")["data"]["config.yaml"], "configmap")


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_configmap_is_the_embedded_default_and_metrics_bind_the_nodes_own_ip() -> None:
    """Not 0.0.0.0: with hostNetwork that is every address of the node, public and storage interfaces included."""
    cm = _configmap_config()
    default = config_mod.load(None)
    assert cm.model_dump(exclude={"status"}) == default.model_dump(exclude={"status"})
    env = _env(_container())
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["QOSAGENT_METRICS_LISTEN"] == "$(POD_IP):9464"
    assert [e["name"] for e in _container()["env"]].index("POD_IP") == 0, "defined before the values using it"


def test_daemonset_holds_the_units_capabilities_and_no_more(tmp_path: Path) -> None:
    """The base grants what the unit's own bounding set does (an agent without placement), SYS_PTRACE and
    DAC_READ_SEARCH among it (other processes' /proc/PID/ns/net and fd); components/placement adds what the unit's
    placement drop-in adds (qosagent check --systemd), once each. No service-account token: the agent asks the API
    server nothing."""
    from qosagent import capabilities, sandbox

    unit_caps = {c.removeprefix("CAP_") for c in unit_settings()["CapabilityBoundingSet"][0].split()}
    placed_cfg = config_mod.parse({"placement": {"enabled": True, "mode": "enforce"}}, "t")
    dropin = sandbox.unit_settings(sandbox.dropin(capabilities.sandbox_needs(placed_cfg)))
    dropin_caps = {c.removeprefix("CAP_") for c in sandbox.granted_by(dropin, "CapabilityBoundingSet")}
    assert dropin_caps == {"SYS_NICE"}
    sc = _container()["securityContext"]
    assert set(sc["capabilities"]["add"]) == unit_caps and {"SYS_PTRACE", "DAC_READ_SEARCH"} <= unit_caps
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    placed = by_kind("DaemonSet", with_components(tmp_path, "placement"))["spec"]["template"]["spec"]
    added = placed["containers"][0]["securityContext"]["capabilities"]["add"]
    assert sorted(added) == sorted(unit_caps | dropin_caps)
    assert by_kind("DaemonSet")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_host_sys_is_writable_only_with_its_component(tmp_path: Path) -> None:
    def sys_mount(docs: list[dict[str, Any]]) -> dict[str, Any]:
        c = by_kind("DaemonSet", docs)["spec"]["template"]["spec"]["containers"][0]
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/host/sys"]
        return m
    assert sys_mount(manifests())["readOnly"] is True
    assert sys_mount(with_components(tmp_path, "writable-sys"))["readOnly"] is False


def test_header_mounts_never_hold_the_pod() -> None:
    """A node without /usr/src must still start the pod, so that the entrypoint's generic-headers fallback runs."""
    vols = {v["name"]: v for v in by_kind("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert vols["host-usr-src"]["hostPath"]["type"] == "DirectoryOrCreate"


def test_probes_ports_and_mounts_agree() -> None:
    c = _container()
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert port == int(_env(c)["QOSAGENT_METRICS_LISTEN"].rpartition(":")[2])
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    volumes = {v["name"] for v in by_kind("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} == volumes
    assert c["args"][c["args"].index("--host-root") + 1] == "/host"
    for path in ("/host/proc", "/host/sys", "/sys/fs/bpf", "/sys/kernel/tracing", "/usr/src", "/lib/modules",
                 "/host/lib/modules", "/run/qosagent", "/etc/qosagent"):
        assert path in mounts, path
    assert mounts["/host/lib/modules"]["readOnly"] and mounts["/usr/src"]["readOnly"]
    # A status socket where the node's `qosagent status` finds it.
    assert str(Path(_configmap_config().status.socket).parent) in mounts


ALLOCATOR = K8S / "allocator"


def test_the_allocator_reads_the_agents_config_and_probes_its_own_port() -> None:
    docs = manifests(ALLOCATOR)
    for doc in _core([d for d in docs if d["kind"] != "PodMonitor"]):
        kubernetes_validate.validate(doc, f"1.{OLDEST_MINOR}", strict=True)
    dep = by_kind("Deployment", docs)
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"][:3] == ["allocator", "--config", "/etc/qosagent/config.yaml"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert c["args"][c["args"].index("--metrics") + 1].rpartition(":")[2] == str(port)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert spec["volumes"][0]["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]} and spec["securityContext"]["runAsNonRoot"]
    assert dep["spec"]["replicas"] >= 2
    assert dep["metadata"]["namespace"] == by_kind("Namespace")["metadata"]["name"]
    pm = by_kind("PodMonitor", docs)
    assert pm["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= {p["name"] for p in c["ports"]}


def test_service_monitor_selects_the_service_port() -> None:
    svc, sm = by_kind("Service"), by_kind("ServiceMonitor")
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    pod_labels = by_kind("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())


def rules_file(tmp_path: Path) -> Path:
    rule = by_kind("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    require(shutil.which("promtool") is not None, "promtool not installed (make setup-test)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_alert_rules(tmp_path: Path) -> None:
    r = promtool("check", "rules", str(rules_file(tmp_path)))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alerts_fire_on_the_series_they_watch(tmp_path: Path) -> None:
    """promtool's rule unit tests: each alert fires on a synthetic series and stays quiet on a healthy one."""
    rules = rules_file(tmp_path)
    inst = 'instance="node-a:9464", job="qosagent"'
    tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f"{name}{{{inst}{labels}}}", "values": values} for name, labels, values in (
            ("up", "", "0x20"),
            ("qosagent_capability_state", ', capability="latency", state="unavailable"', "1x20"),
            ("qosagent_capability_state", ', capability="quota", state="unavailable"', "0x20"),
            ("qosagent_capability_state", ', capability="dvfs", state="degraded"', "0x5 1x20"),
            ("qosagent_capability_state", ', capability="servers", state="idle"', "1x20"),
            ("qosagent_dvfs_emergency", "", "0x5 1x20"),
            ("qosagent_collect_errors_total", ', capability="dvfs"', "0+5x30"),
            ("qosagent_apply_errors_total", ', capability="quota"', "0+1x30"),
            ("qosagent_apply_errors_total", ', capability="dvfs"', "0x30"),
            ("qosagent_tier_slo_p99_seconds", ', tier="gold"', "0.12x20"),
            ("qosagent_latency_slo_seconds", ', tenant="shop", tier="gold", signal="ttft", slo_quantile="0.95"',
             "0.2x20"),
            ("qosagent_latency_slo_seconds", ', tenant="blog", tier="gold", signal="ttft", slo_quantile="0.95"',
             "0.05x20"),
            ("qosagent_quota_limit_rps", ', tenant="hobby", tier="bronze"', "5x20"),
            ("qosagent_quota_baseline_rps", ', tenant="hobby", tier="bronze"', "10x20"),
            ("qosagent_quota_limit_rps", ', tenant="shop", tier="gold"', "10x20"),
            ("qosagent_quota_baseline_rps", ', tenant="shop", tier="gold"', "10x20"),
            ("qosagent_admission_enforcing", "", "1x30"),
            ("qosagent_config_reloads_total", ', result="failed"', "0x10 1x20"),
            ("qosagent_config_reloads_total", ', result="ok"', "0x10 1x20"),
            # A sandbox that refuses other processes' namespace links (every scan, from minute 10), never their fds.
            ("qosagent_proc_unreadable_total", ', what="ns_net"', "0x10 0+40x20"),
            ("qosagent_proc_unreadable_total", ', what="fd"', "0x30"),
            ("qosagent_admission_limited", ', tenant="hobby", tier="bronze", cause="server"', "1x30"),
            ("qosagent_server_reading_known", ', port="8000", kind="vllm"', "0x30"),
            ("qosagent_server_reading_known", ', port="8001", kind="sglang"', "1x30"),
            ("qosagent_fleet_on_safe_share", ', tenant="acme"', "0x3 1x20"),
            ("qosagent_fleet_on_safe_share", ', tenant="blog"', "0x30"),
            ("qosagent_admission_evidence_conflict", ', gpu="0"', "1x30"),
            ("qosagent_admission_evidence_conflict", ', gpu="1"', "0x30"),
        )] + [{"series": f'{name}{{instance="node-b:9464", job="qosagent"{labels}}}', "values": values}
              for name, labels, values in (
            ("qosagent_admission_enforcing", "", "0x30"),
            ("qosagent_admission_limited", ', tenant="hobby", tier="bronze", cause="gpu_memory"', "1x30"),
        )] + [{"series": f'qosagent_allocator_leader{{instance="alloc-{i}:9465", job="allocator"}}',
               "values": values} for i, values in ((1, "1x10 0x20"), (2, "0x30"))],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "QosagentDown", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent"}}]},
            {"eval_time": "15m", "alertname": "QosagentCapabilityUnavailable", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "latency", "state": "unavailable"}}]},
            # Degraded (what was asked did not work) alerts; idle (nothing to act on here) does not.
            {"eval_time": "10m", "alertname": "QosagentCapabilityDegraded", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "QosagentCapabilityDegraded", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "dvfs", "state": "degraded"}}]},
            {"eval_time": "5m", "alertname": "QosagentThermalEmergency", "exp_alerts": []},
            {"eval_time": "8m", "alertname": "QosagentThermalEmergency", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "instance": "node-a:9464", "job": "qosagent"}}]},
            {"eval_time": "25m", "alertname": "QosagentCollectErrors", "exp_alerts": [
                {"exp_labels": {"severity": "info", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "dvfs"}}]},
            {"eval_time": "25m", "alertname": "QosagentApplyErrors", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "quota"}}]},
            {"eval_time": "15m", "alertname": "QosagentLoopOverrunning", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "QosagentConfigReloadFailed", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "QosagentConfigReloadFailed", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "result": "failed"}}]},
            {"eval_time": "28m", "alertname": "QosagentConfigReloadFailed", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "QosagentProcUnreadable", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "QosagentProcUnreadable", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "what": "ns_net"}}]},
            {"eval_time": "15m", "alertname": "QosagentTenantShed", "exp_alerts": [
                {"exp_labels": {"severity": "info", "instance": "node-a:9464", "tenant": "hobby", "tier": "bronze"}}]},
            # Enforcing on node-a, dry-run on node-b: one alert each, never both for one node.
            {"eval_time": "5m", "alertname": "QosagentAdmissionShedding", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "tenant": "hobby", "tier": "bronze",
                                "cause": "server"}}]},
            {"eval_time": "20m", "alertname": "QosagentAdmissionWouldShed", "exp_alerts": [
                {"exp_labels": {"severity": "info", "instance": "node-b:9464", "tenant": "hobby", "tier": "bronze",
                                "cause": "gpu_memory"}}]},
            {"eval_time": "5m", "alertname": "QosagentAdmissionWouldShed", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "QosagentAdmissionEvidenceConflict", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "gpu": "0"}}]},
            {"eval_time": "5m", "alertname": "QosagentAdmissionEvidenceConflict", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "QosagentServerReadingUnknown", "exp_alerts": [
                {"exp_labels": {"severity": "info", "instance": "node-a:9464", "port": "8000", "kind": "vllm"}}]},
            {"eval_time": "4m", "alertname": "QosagentFleetSafeShare", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "QosagentFleetSafeShare", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "tenant": "acme"}}]},
            {"eval_time": "9m", "alertname": "QosagentAllocatorNoLeader", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "QosagentAllocatorNoLeader", "exp_alerts": [
                {"exp_labels": {"severity": "critical"}}]},
            {"eval_time": "10m", "alertname": "QosagentTenantSLOBreach", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "tenant": "shop", "tier": "gold",
                                "signal": "ttft", "slo_quantile": "0.95"}}]},
        ],
    }]}
    # promtool compares annotations too: expect each rule's own, with its label templates filled in.
    annotations = {r["alert"]: r.get("annotations", {}) for g in by_kind("PrometheusRule")["spec"]["groups"]
                   for r in g["rules"] if "alert" in r}
    for case in tests["tests"][0]["alert_rule_test"]:
        for exp in case["exp_alerts"]:
            exp["exp_annotations"] = {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: exp["exp_labels"][m[1]], v)
                                      for k, v in annotations[case["alertname"]].items()}
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    r = promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr



def test_fleet_alerts_fire_when_agents_or_gpu_data_are_missing(tmp_path: Path) -> None:
    """The alerts that need no agent to speak: none scraped at all, nodes the DaemonSet misses, GPU nodes (from
    kube-state-metrics) whose agent has no GPU data."""
    ksm = 'job="kube-state-metrics", namespace="qosagent", daemonset="qosagent-gpu"'
    tests = {"rule_files": [str(rules_file(tmp_path))], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f"kube_daemonset_status_desired_number_scheduled{{{ksm}}}", "values": "4x30"},
            {"series": f"kube_daemonset_status_number_available{{{ksm}}}", "values": "4x5 3x25"},
            {"series": 'kube_node_status_capacity{job="kube-state-metrics", node="gpu-1", resource="nvidia_com_gpu"}',
             "values": "8x30"},
            {"series": 'kube_node_status_capacity{job="kube-state-metrics", node="gpu-2", resource="nvidia_com_gpu"}',
             "values": "8x30"},
            {"series": 'kube_node_status_capacity{job="kube-state-metrics", node="cpu-1", resource="cpu"}',
             "values": "64x30"},
            {"series": 'qosagent_gpu_data_available{job="qosagent", instance="a:9464", node="gpu-1"}',
             "values": "0x30"},
            {"series": 'qosagent_gpu_data_available{job="qosagent", instance="b:9464", node="gpu-2"}',
             "values": "1x30"},
            {"series": 'qosagent_gpu_data_available{job="qosagent", instance="c:9464", node="cpu-1"}',
             "values": "0x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "QosagentAbsent",
             "exp_alerts": [{"exp_labels": {"severity": "warning", "job": "qosagent"}}]},
            {"eval_time": "10m", "alertname": "QosagentNotOnEveryNode", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "QosagentNotOnEveryNode", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "qosagent", "daemonset": "qosagent-gpu"}}]},
            {"eval_time": "20m", "alertname": "QosagentGpuNodeWithoutGpuData", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "node": "gpu-1"}}]},
        ],
    }]}
    annotations = {r["alert"]: r.get("annotations", {}) for g in by_kind("PrometheusRule")["spec"]["groups"]
                   for r in g["rules"] if "alert" in r}
    for case in tests["tests"][0]["alert_rule_test"]:
        for exp in case["exp_alerts"]:
            exp["exp_annotations"] = {
                k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: exp["exp_labels"][m[1]],
                          v.replace("{{ $value }}", "1")) for k, v in annotations[case["alertname"]].items()}
    path = tmp_path / "fleet_rules_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    r = promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr

def test_metrics_tls_component_moves_probes_to_the_health_port_and_scrapes_over_tls(tmp_path: Path) -> None:
    """What components/metrics-tls gives the agent and the ServiceMonitor is what test_ship_web_config.py runs for
    real (a web config requiring a client certificate, a plain health listener, Prometheus with serverName)."""
    from tests.integration.test_ship_web_config import SERVER_NAME

    docs = with_components(tmp_path, "metrics-tls")
    c = by_kind("DaemonSet", docs)["spec"]["template"]["spec"]["containers"][0]
    env = _env(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert env["QOSAGENT_HEALTH_LISTEN"] == f"$(POD_IP):{ports['health']}"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == "health", probe
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    web = env["QOSAGENT_WEB_CONFIG_FILE"]
    assert mounts[str(Path(web).parent)] == "metrics-tls"
    vols = {v["name"]: v for v in by_kind("DaemonSet", docs)["spec"]["template"]["spec"]["volumes"]}
    assert vols["metrics-tls"]["secret"]["secretName"] == "qosagent-metrics-tls"
    (ep,) = by_kind("ServiceMonitor", docs)["spec"]["endpoints"]
    assert ep["scheme"] == "https" and ep["tlsConfig"]["serverName"] == SERVER_NAME
    assert {"ca", "cert", "keySecret"} <= set(ep["tlsConfig"]) and set(ep["basicAuth"]) == {"username", "password"}


ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"


def headers(tmp_path: Path, node_headers: bool, image_headers: bool) -> subprocess.CompletedProcess[str]:
    host_modules, modules, fallback, usr_src = (tmp_path / d for d in ("host-modules", "modules", "fallback",
                                                                       "usr-src"))
    for d in (host_modules / "6.9.0-test", modules, fallback):
        d.mkdir(parents=True)
    if node_headers:
        (usr_src / "linux-headers-6.9.0-test" / "include").mkdir(parents=True)
        (host_modules / "6.9.0-test" / "build").symlink_to(usr_src / "linux-headers-6.9.0-test")
    if image_headers:
        for d in ("linux-headers-6.1.0-9-amd64/include", "linux-headers-6.1.0-9-common/include"):
            (fallback / d).mkdir(parents=True)
    env = dict(os.environ, QOSAGENT_KERNEL_RELEASE="6.9.0-test", QOSAGENT_HOST_MODULES=str(host_modules),
               QOSAGENT_MODULES_DIR=str(modules), QOSAGENT_FALLBACK_HEADERS=str(fallback), QOSAGENT_HEADERS_ONLY="1")
    return subprocess.run(["sh", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=30)


def test_entrypoint_prefers_the_nodes_headers(tmp_path: Path) -> None:
    r = headers(tmp_path, node_headers=True, image_headers=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    build = tmp_path / "modules/6.9.0-test/build"
    assert build.resolve() == (tmp_path / "usr-src/linux-headers-6.9.0-test").resolve()


def test_entrypoint_falls_back_to_the_images_headers_with_a_warning(tmp_path: Path) -> None:
    r = headers(tmp_path, node_headers=False, image_headers=True)
    assert r.returncode == 0 and "WARNING" in r.stderr
    assert os.readlink(tmp_path / "modules/6.9.0-test/build").endswith("linux-headers-6.1.0-9-amd64")
    assert os.readlink(tmp_path / "modules/6.9.0-test/source").endswith("linux-headers-6.1.0-9-common")


def test_entrypoint_without_any_headers_says_so(tmp_path: Path) -> None:
    r = headers(tmp_path, node_headers=False, image_headers=False)
    assert r.returncode == 1 and "cannot compile" in r.stderr


def test_dockerfile_passes_hadolint() -> None:
    """The image is not built here (no container engine): the Dockerfile is linted instead."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    require(Path(hadolint).exists(), "hadolint not installed (make setup-test)")
    r = subprocess.run([hadolint, "--no-color", str(REPO / "deploy" / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _third_party_imports() -> dict[str, str]:
    """Top-level third-party module the package imports -> one file that imports it."""
    out: dict[str, str] = {}
    for f in sorted((REPO / "qosagent").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "qosagent" and top not in sys.stdlib_module_names:
                    out.setdefault(top, str(f.relative_to(REPO)))
    return out


def test_every_module_the_package_imports_is_a_declared_dependency() -> None:
    """What the package imports, pyproject declares (runtime or the pods extra), so the image pins it: a module
    imported only under one command (numpy, by `qosagent allocator`) is still in the image that command runs from.
    The suite's venv holds the test extras, so a missing declaration shows nowhere else before a user's ImportError.
    bcc is Debian's python3-bpfcc (no wheel exists): scripts/setup.sh and the Dockerfile install it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(r).name)
                for r in project["dependencies"] + project["optional-dependencies"]["pods"]}
    dists = importlib.metadata.packages_distributions()
    missing = {module: (where, dists.get(module)) for module, where in _third_party_imports().items()
               if module != "bcc" and not {canonicalize_name(d) for d in dists.get(module, [module])} & declared}
    assert not missing, f"imported but not declared in pyproject (dependencies or the pods extra): {missing}"


def test_image_requirements_pin_every_dependency_with_hashes() -> None:
    """deploy/requirements.txt (scripts/pin-image-requirements.sh) covers pyproject's runtime and pods dependencies,
    each at a version the project accepts, each with a hash: a dependency added to pyproject alone fails here."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["pods"]]
    pinned: dict[str, str] = {}
    for line in (REPO / "deploy" / "requirements.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        spec, *hashes = line.split()
        name, _, version = spec.partition("==")
        assert version and hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), line
        pinned[canonicalize_name(name)] = version
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned in deploy/requirements.txt"
        assert req.specifier.contains(pinned[name]), f"{req.name}=={pinned[name]} does not satisfy {req.specifier}"
