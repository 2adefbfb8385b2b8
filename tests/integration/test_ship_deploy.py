"""deploy/: the Kubernetes manifests validate offline and agree with each other, the unit and the agent; the alert
rules pass promtool; the image's entrypoint picks kernel headers like scripts/setup.sh."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from qosagent import config as config_mod
from tests.conftest import REPO, require
from tests.integration.test_ship_systemd import unit_settings

K8S = REPO / "deploy" / "kubernetes"
# Prometheus-operator kinds: kubernetes-validate carries only the core API's schemas, so these are checked by what
# consumes them (promtool for the rules; the Service they select, below).
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def manifests() -> list[dict[str, Any]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    return doc


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("doc", [d for d in manifests() if d["kind"] not in CRD_KINDS],
                         ids=lambda d: d["kind"])
def test_core_manifests_validate_strictly(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, "1.30", strict=True)


def test_strict_validation_catches_a_misplaced_field() -> None:
    ds = copy.deepcopy(by_kind("DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, "1.30", strict=True)


def test_kustomize_builds_the_base() -> None:
    require(shutil.which("kubectl") is not None, "kubectl not installed")
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True)
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout) if d)
    assert kinds == sorted(d["kind"] for d in manifests())


def _container() -> dict[str, Any]:
    return by_kind("DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def _configmap_config() -> config_mod.Config:
    return config_mod.parse_text(by_kind("ConfigMap")["data"]["config.yaml"], "configmap")


def test_configmap_is_the_embedded_default_listening_on_the_node() -> None:
    cm = _configmap_config()
    default = config_mod.load(None)
    assert cm.model_dump(exclude={"metrics"}) == default.model_dump(exclude={"metrics"})
    assert cm.metrics.listen == "0.0.0.0:9464"


def test_daemonset_holds_the_units_capabilities_and_no_more() -> None:
    sc = _container()["securityContext"]
    unit_caps = {c.removeprefix("CAP_") for c in unit_settings()["CapabilityBoundingSet"][0].split()}
    assert set(sc["capabilities"]["add"]) == unit_caps and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False


def test_probes_ports_and_mounts_agree() -> None:
    c = _container()
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert port == int(_configmap_config().metrics.listen.rpartition(":")[2])
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
            ("qosagent_admission_limited", ', tenant="hobby", tier="bronze", cause="server"', "1x30"),
            ("qosagent_server_reading_known", ', port="8000", kind="vllm"', "0x30"),
            ("qosagent_server_reading_known", ', port="8001", kind="sglang"', "1x30"),
        )] + [{"series": f'{name}{{instance="node-b:9464", job="qosagent"{labels}}}', "values": values}
              for name, labels, values in (
            ("qosagent_admission_enforcing", "", "0x30"),
            ("qosagent_admission_limited", ', tenant="hobby", tier="bronze", cause="gpu_memory"', "1x30"),
        )],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "QosagentDown", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent"}}]},
            {"eval_time": "15m", "alertname": "QosagentCapabilityUnavailable", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "latency", "state": "unavailable"}}]},
            {"eval_time": "25m", "alertname": "QosagentCollectErrors", "exp_alerts": [
                {"exp_labels": {"severity": "info", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "dvfs"}}]},
            {"eval_time": "25m", "alertname": "QosagentApplyErrors", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "instance": "node-a:9464", "job": "qosagent",
                                "capability": "quota"}}]},
            {"eval_time": "15m", "alertname": "QosagentLoopOverrunning", "exp_alerts": []},
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
            {"eval_time": "15m", "alertname": "QosagentServerReadingUnknown", "exp_alerts": [
                {"exp_labels": {"severity": "info", "instance": "node-a:9464", "port": "8000", "kind": "vllm"}}]},
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
