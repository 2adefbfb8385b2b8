"""A real Prometheus scrapes a real agent over HTTPS with basic auth, loads the alert rules, and returns the
agent's series through its HTTP API; promtool lints a live scrape."""

from __future__ import annotations

import base64
import http.server
import json
import re
import shutil
import ssl
import subprocess
import time
import urllib.request
from typing import Any, Iterator

import pytest
import yaml

from tests.conftest import REPO, require
from testkit.agent import AgentProcess
from tests.integration.latency_helpers import free_port, serving
from tests.integration.prometheus_helpers import DEADLINE_S, api, query, run_prometheus, wait_for
from tests.integration.test_ship_deploy import rules_file
from tests.integration.test_ship_metrics_tls import self_signed

PASSWORD = "scrape-me"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("agent")
    cert, key = self_signed(d)
    (d / "password").write_text(PASSWORD + "\n")
    port, tenant_port = free_port(), free_port()
    conf = d / "config.yaml"
    conf.write_text(yaml.safe_dump({
        "interval": "200ms",
        "tenants": [{"name": "shop", "tier": "gold", "match": {"ports": [tenant_port]}}],
        "metrics": {"listen": f"127.0.0.1:{port}", "tls": {"cert_file": str(cert), "key_file": str(key)},
                    "basic_auth": {"username": "prometheus", "password_file": str(d / "password")}},
        "status": {"socket": str(d / "status.sock")},
    }))
    with AgentProcess(conf, str(d / "status.sock"), d / "agent.log") as proc:
        info = {"port": port, "cert": cert, "dir": d, "proc": proc, "tenant_port": tenant_port}
        assert scrape(info, "/readyz")[0] == 200
        yield info


def scrape(agent: dict[str, Any], path: str = "/metrics") -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=str(agent["cert"]))
    req = urllib.request.Request(f"https://127.0.0.1:{agent['port']}{path}", headers={
        "Authorization": "Basic " + base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@pytest.fixture(scope="module")
def prometheus(agent: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("prometheus")
    with run_prometheus(d, [{
        "job_name": "qosagent",
        "scheme": "https",
        "tls_config": {"ca_file": str(agent["cert"])},
        "basic_auth": {"username": "prometheus", "password_file": str(agent["dir"] / "password")},
        "static_configs": [{"targets": [f"127.0.0.1:{agent['port']}"]}],
    }], rule_files=(rules_file(d),)) as url:
        yield url


def test_prometheus_scrapes_the_agent(prometheus: str, agent: dict[str, Any]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    up = wait_for("a successful scrape", lambda: query(prometheus, 'up{job="qosagent"} == 1'), deadline)
    assert up[0]["metric"]["instance"] == f"127.0.0.1:{agent['port']}"
    # Several scrapes, and the loop ticked between them.
    ticks = wait_for("ticks over several scrapes",
                     lambda: query(prometheus, "increase(qosagent_ticks_total[10s]) > 0"), deadline)
    assert float(ticks[0]["value"][1]) > 0
    states = query(prometheus, "qosagent_capability_state == 1")
    # Every capability there is, one state each (disabled included).
    from qosagent.capabilities import CAPABILITIES

    assert {s["metric"]["capability"] for s in states} == {c.name for c in CAPABILITIES}
    slo = query(prometheus, "qosagent_tier_slo_p99_seconds")
    assert {s["metric"]["tier"]: float(s["value"][1]) for s in slo} == pytest.approx({"gold": 0.12, "silver": 0.35,
                                                                                   "bronze": 1.2})


class Completion(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(0.005)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *_args: object) -> None:
        pass


def test_prometheus_returns_the_tenant_series(prometheus: str, agent: dict[str, Any], bpf: None) -> None:
    """Requests to a tenant's port, measured by the latency programs, reach Prometheus per tenant and tier."""
    n = 20
    with serving((agent["tenant_port"],), Completion):
        for _ in range(n):
            with urllib.request.urlopen(f"http://127.0.0.1:{agent['tenant_port']}/", timeout=10) as r:
                assert r.read() == b"ok"
        deadline = time.monotonic() + DEADLINE_S
        got = wait_for("the tenant's requests in Prometheus",
                       lambda: query(prometheus, f'qosagent_latency_requests_total{{tenant="shop"}} >= {n}'), deadline)
    assert got[0]["metric"]["tier"] == "gold" and float(got[0]["value"][1]) == n
    p99 = query(prometheus, 'qosagent_latency_response_window_seconds{tenant="shop", quantile="0.99"}')
    assert p99 and 0.005 <= float(p99[0]["value"][1]) < 1.0
    buckets = query(prometheus, 'qosagent_latency_headers_seconds_bucket{tenant="shop", le="+Inf"}')
    assert float(buckets[0]["value"][1]) == n


def test_prometheus_loads_the_alert_rules(prometheus: str) -> None:
    groups = api(prometheus, "rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert rules and all(r["health"] in ("ok", "unknown") for r in rules), rules
    wait_for("a rule evaluation", lambda: all(r["health"] == "ok" for g in api(prometheus, "rules")["groups"]
                                                for r in g["rules"]), time.monotonic() + DEADLINE_S)
    # The agent is up and nothing it does is failing, so nothing fires.
    assert query(prometheus, 'ALERTS{alertstate="firing", alertname="QosagentDown"}') == []


def test_promtool_lints_a_live_scrape(agent: dict[str, Any]) -> None:
    require(shutil.which("promtool") is not None, "promtool not installed (make setup-test)")
    code, body = scrape(agent)
    assert code == 200 and "qosagent_ticks_total" in body
    r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr


DASHBOARD = REPO / "deploy" / "grafana" / "qosagent.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    rule = yaml.safe_load((REPO / "deploy" / "kubernetes" / "common" / "prometheusrule.yaml").read_text())
    return [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


def referenced_names() -> set[str]:
    return {n for e in dashboard_exprs() + rule_exprs() for n in re.findall(r"\b(qosagent_[a-z0-9_]+)", e)}


def known_names(scrape_text: str) -> set[str]:
    """Every family and sample name in a live scrape, and every metric family the code defines (for capabilities
    that cannot run on this host: no cpufreq, no GPU, one NUMA node)."""
    names = set(re.findall(r"^# TYPE (\w+)", scrape_text, flags=re.M))
    names |= set(re.findall(r"^(qosagent_\w+)", scrape_text, flags=re.M))
    for src in (REPO / "qosagent").rglob("*.py"):
        # Hand-built families, the capabilities' tables (exposition.Family rows) and their helpers (_gpu_family).
        names |= set(re.findall(r"[Ff]amily\(\s*\"(qosagent_[a-z0-9_]+)\"", src.read_text()))
    return names


def test_dashboard_and_rules_use_only_metric_names_that_exist(agent: dict[str, Any]) -> None:
    code, body = scrape(agent)
    assert code == 200
    known = known_names(body)
    unknown = sorted(n for n in referenced_names()
                     if n not in known and not any(n.endswith(s) and n[: -len(s)] in known for s in SUFFIXES))
    assert not unknown, f"referenced by deploy/grafana or the alert rules but neither scraped nor defined: {unknown}"


def test_dashboard_and_rules_use_no_deprecated_name() -> None:
    """The old latency names are exposed one release more for others' dashboards; ours read the new ones."""
    from qosagent.latency.export import RENAMED, RUNQ_OLD

    old = set(RENAMED.values()) | {RUNQ_OLD.name}  # the run queue's old name is a family of its own, not a renaming
    used = sorted(n for n in referenced_names()
                  if n in old or any(n.endswith(s) and n[: -len(s)] in old for s in SUFFIXES))
    assert not used, f"deploy/grafana or the alert rules read deprecated names: {used}"


def test_every_dashboard_query_is_valid_promql(prometheus: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for expr in dashboard_exprs():
        # Grafana substitutes its variables before Prometheus sees the query.
        concrete = expr.replace("$instance", ".*").replace("$tenant", ".*").replace("$__rate_interval", "1m")
        api(prometheus, "query", query=concrete)
