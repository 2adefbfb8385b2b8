"""Metrics only Prometheus reads: a real agent serving /metrics over TLS that requires a client certificate and a
user from an exporter-toolkit web config, its probes on a plain health listener, and a real Prometheus scraping it
the way components/metrics-tls tells a ServiceMonitor to (scheme https, a client certificate, serverName)."""

from __future__ import annotations

import base64
import http.client
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from qosagent import config as config_mod
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.metrics import MetricsServer, health_server
from qosagent.weblisten import web_config
from testkit.agent import AgentProcess
from tests.conftest import require
from tests.integration.latency_helpers import free_port
from tests.integration.prometheus_helpers import DEADLINE_S, query, run_prometheus, wait_for

SERVER_NAME = "qosagent-metrics"  # the name the ServiceMonitor's tlsConfig.serverName asks for
ALL_OFF = {c: {"enabled": False} for c in ("latency", "quota", "admission", "dvfs", "placement")}


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and SERVER_NAME, and a client certificate (Prometheus')."""
    require(shutil.which("openssl") is not None, "openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=qosagent-test-ca",
            "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    for name, ext in (("server", f"subjectAltName=IP:127.0.0.1,DNS:{SERVER_NAME}"),
                      ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.crt"))
    return {"dir": d, "ca": d / "ca.crt", "server": d / "server.crt", "server_key": d / "server.key",
            "client": d / "client.crt", "client_key": d / "client.key"}


def write_web_config(pki: dict[str, Path], password: str = "scrape-me") -> Path:
    import bcrypt

    path = pki["dir"] / "web-config.yml"
    path.write_text(yaml.safe_dump({
        # Relative paths: exporter-toolkit reads them from the file's directory, so does the agent.
        "tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                              "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "ca.crt"},
        "basic_auth_users": {"prometheus": bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()},
    }))
    return path


def get(port: int, path: str, pki: dict[str, Path] | None, cert: bool = True,
        auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    if pki is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        if cert:
            ctx.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    headers = {"Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()} if auth else {}
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.fixture
def served(pki: dict[str, Path]) -> Iterator[tuple[MetricsServer, Any, Agent]]:
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0",
                                        "web_config_file": str(write_web_config(pki))}, **ALL_OFF}, "test")
    agent = Agent(cfg, HostFS("/"), gpu=NoGpu("test"))
    srv = MetricsServer(agent, cfg.metrics.listen, sec=web_config(cfg.metrics.web_config_file))
    health = health_server(agent, cfg.metrics.health_listen)
    for s in (srv, health):
        s.start()
    try:
        yield srv, health, agent
    finally:
        srv.close()
        health.close()


def test_metrics_need_a_client_certificate_and_a_user(served, pki) -> None:
    srv, _, _ = served
    port = srv.address[1]
    assert get(port, "/metrics", pki, auth=("prometheus", "scrape-me"))[0] == 200
    assert get(port, "/metrics", pki)[0] == 401
    assert get(port, "/metrics", pki, auth=("prometheus", "wrong"))[0] == 401
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        get(port, "/metrics", pki, cert=False, auth=("prometheus", "scrape-me"))
    assert get(port, "/metrics", pki, auth=("prometheus", "scrape-me"))[0] == 200  # the listener is unharmed


def test_probes_use_the_plain_health_listener(served) -> None:
    _, health, agent = served
    port = health.address[1]
    assert get(port, "/readyz", None) == (503, b"starting\n")
    agent.ready.set()
    agent.latest = type(agent.latest).build(1, __import__("time").monotonic(), 0.0, {})
    assert get(port, "/healthz", None) == (200, b"ok\n")
    assert get(port, "/readyz", None) == (200, b"ready\n")
    assert get(port, "/metrics", None)[0] == 404, "the health listener tells nothing but health"


@pytest.mark.parametrize("doc,why", [
    ({"http_server_config": {}}, "not supported"),
    ({"tls_server_config": {"cert_file": "server.crt"}}, "takes cert_file and key_file"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "client_auth_type": "RequestClientCert"}}, "RequestClientCert' is not supported"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "client_auth_type": "RequireAndVerifyClientCert"}}, "client_ca_file"),
    ({"tls_server_config": {"cert_file": "nope.crt", "key_file": "server.key"}}, "nope.crt"),
    ({"basic_auth_users": {"a:b": "$2b$04$x"}}, "bcrypt hashes"),
])
def test_a_bad_web_config_is_named(pki, doc, why) -> None:
    path = pki["dir"] / "bad-web-config.yml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(OSError, match=why.replace("$", r"\$")) as e:
        web_config(str(path))
    assert str(path) in str(e.value)


def test_web_config_replaces_tls_and_basic_auth() -> None:
    with pytest.raises(config_mod.ConfigError, match="web_config_file replaces tls and basic_auth"):
        config_mod.parse({"metrics": {"web_config_file": "/w.yml", "tls": {"cert_file": "/c", "key_file": "/k"}}},
                         "t")


def test_prometheus_scrapes_the_agent_as_the_service_monitor_says(pki, tmp_path) -> None:
    """The real agent with the command line the metrics-tls component gives it, and a real Prometheus with the
    scrape settings the component gives the ServiceMonitor."""
    port, health_port = free_port(), free_port()
    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump({"interval": "200ms", "status": {"socket": str(tmp_path / "status.sock")},
                                    **ALL_OFF}))
    (tmp_path / "password").write_text("scrape-me\n")
    args = ["--metrics-listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health_port}",
            "--web-config-file", str(write_web_config(pki))]
    with AgentProcess(conf, str(tmp_path / "status.sock"), tmp_path / "agent.log", args=args):
        assert get(health_port, "/readyz", None) == (200, b"ready\n")
        (tmp_path / "prom").mkdir()
        with run_prometheus(tmp_path / "prom", [{
            "job_name": "qosagent", "scheme": "https",
            "tls_config": {"ca_file": str(pki["ca"]), "cert_file": str(pki["client"]),
                           "key_file": str(pki["client_key"]), "server_name": SERVER_NAME},
            "basic_auth": {"username": "prometheus", "password_file": str(tmp_path / "password")},
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
        }]) as url:
            import time

            wait_for("Prometheus to scrape the agent over TLS",
                     lambda: [float(r["value"][1]) for r in query(url, 'up{job="qosagent"}')] == [1.0],
                     time.monotonic() + DEADLINE_S)
            assert query(url, 'qosagent_ticks_total{job="qosagent"}')
