"""What TLS and basic auth cost a scrape: time per /metrics request over loopback, each scrape on a new connection
(the endpoint answers HTTP/1.0, as Prometheus then sees it), against plain HTTP in the same run, plus one bcrypt
check to show why the endpoint remembers the credential that passed.

Run from the checkout: python bench/ship_metrics.py. Prints a Markdown section for docs/PERFORMANCE.md
("Metrics endpoint")."""

from __future__ import annotations

import base64
import http.client
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qosagent import config as config_mod  # noqa: E402
from qosagent.daemon import Agent  # noqa: E402
from qosagent.gpu.backend import NoGpu  # noqa: E402
from qosagent.hostfs import HostFS  # noqa: E402
from qosagent.metrics import MetricsServer  # noqa: E402

SCRAPES = 200
ROUNDS = 3
OFF = {c: {"enabled": False} for c in ("latency", "quota", "admission", "dvfs", "placement")}


def per_scrape(metrics: dict, cafile: Path | None, auth: str | None) -> float:
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0", **metrics}, **OFF}, "bench")
    srv = MetricsServer(Agent(cfg, HostFS("/"), gpu=NoGpu("bench")), cfg.metrics.listen, cfg.metrics.tls,
                        cfg.metrics.basic_auth)
    srv.start()
    host, port = srv.address[:2]
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    headers = {"Authorization": auth} if auth else {}
    try:
        t0 = time.perf_counter()
        for _ in range(SCRAPES):
            conn = (http.client.HTTPSConnection(host, port, context=ctx, timeout=10) if ctx
                    else http.client.HTTPConnection(host, port, timeout=10))
            conn.request("GET", "/metrics", headers=headers)
            r = conn.getresponse()
            assert r.status == 200, r.status
            r.read()
            conn.close()
        return (time.perf_counter() - t0) / SCRAPES
    finally:
        srv.close()


def main() -> None:
    import bcrypt

    d = Path(tempfile.mkdtemp(prefix="qosagent-bench-"))
    cert, key = d / "tls.crt", d / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=bench", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    (d / "password").write_text("secret\n")
    auth = "Basic " + base64.b64encode(b"prom:secret").decode()
    tls = {"tls": {"cert_file": str(cert), "key_file": str(key)}}
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=10)).decode()
    cases = {
        "plain HTTP (baseline)": ({}, None, None),
        "HTTPS": (tls, cert, None),
        "HTTPS + basic auth, password_file": (
            {**tls, "basic_auth": {"username": "prom", "password_file": str(d / "password")}}, cert, auth),
        "HTTPS + basic auth, bcrypt hash (cost 10)": (
            {**tls, "basic_auth": {"username": "prom", "password_hash": hashed}}, cert, auth),
    }
    results: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(ROUNDS):  # interleaved, so drift on a shared machine hits every case alike
        for name, (metrics, cafile, a) in cases.items():
            results[name].append(per_scrape(metrics, cafile, a))
    t0 = time.perf_counter()
    bcrypt.checkpw(b"secret", hashed.encode())
    one_bcrypt = time.perf_counter() - t0
    base = statistics.median(results["plain HTTP (baseline)"])
    print("## Metrics endpoint (bench/ship_metrics.py)\n")
    print(f"{SCRAPES} scrapes of an agent's /metrics on loopback per case, each on a new connection, {ROUNDS} "
          f"interleaved rounds (median). {platform.node()}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}.\n")
    print("| case | per scrape | ratio to plain |\n|---|---|---|")
    for name, xs in results.items():
        m = statistics.median(xs)
        print(f"| {name} | {m * 1e3:.2f} ms | {m / base:.1f} |")
    print(f"\nOne bcrypt check (cost 10) takes {one_bcrypt * 1e3:.0f} ms ({one_bcrypt / base:.0f}x a plain scrape): "
          "the endpoint checks the hash once and then compares a SHA-256 of the credential that passed.")


if __name__ == "__main__":
    main()
