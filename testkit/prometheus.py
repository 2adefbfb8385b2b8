"""A real Prometheus (Debian's /usr/bin/prometheus) for tests and benches: started on loopback in a temp dir, queried
through its HTTP API, stopped (and killed if it must be) when done. Tests reach it through
tests/integration/prometheus_helpers.py, which makes a missing prometheus a skip outside CI."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import yaml

DEADLINE_S = 90


def wait_for(what: str, probe: Any, deadline: float) -> Any:
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except OSError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: last answer {last!r}")


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read() if proc.stdout else ""


@contextlib.contextmanager
def run_prometheus(d: Path, scrape_configs: list[dict[str, Any]], *, native: bool = False,
                   rule_files: tuple[Path, ...] = (), scrape_interval: str = "1s") -> Iterator[str]:
    """Prometheus scraping `scrape_configs`, its data in d; yields its URL once ready. native=True turns native
    histograms on (--enable-feature=native-histograms): it then asks targets for protobuf first."""
    if shutil.which("prometheus") is None:
        raise FileNotFoundError("prometheus not installed (make setup-test)")
    cfg = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
           "rule_files": [str(r) for r in rule_files], "scrape_configs": scrape_configs}
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["prometheus", f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"]
    if native:
        argv.append("--enable-feature=native-histograms")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    with running(proc, "Prometheus to be ready",
                 lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=5).status == 200):
        yield url


@contextlib.contextmanager
def running(proc: subprocess.Popen[str], what: str, ready: Any) -> Iterator[None]:
    """proc, once ready() says so (within DEADLINE_S); stopped on exit, its output printed when it failed."""
    try:
        wait_for(what, ready, time.monotonic() + DEADLINE_S)
        yield
    finally:
        out = stop(proc)
        if proc.returncode not in (0, -15):
            print(out)


def api(url: str, path: str, **params: str) -> Any:
    q = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def query(url: str, promql: str) -> list[dict[str, Any]]:
    return api(url, "query", query=promql)["result"]
