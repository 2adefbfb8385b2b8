"""The metrics listener over real HTTPS on loopback, with basic auth by password file or bcrypt hash."""

from __future__ import annotations

import base64
import http.client
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from qosagent import config as config_mod
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.metrics import MetricsServer
from tests.conftest import require

ALL_OFF = {c: {"enabled": False} for c in ("latency", "quota", "admission", "dvfs", "placement")}


def self_signed(dirpath: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (openssl, else the cryptography package)."""
    cert, key = dirpath / "tls.crt", dirpath / "tls.key"
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                        "/CN=qosagent-test", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                        "-out", str(cert)], check=True, capture_output=True, timeout=60)
        return cert, key
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        require(False, "neither openssl nor cryptography is available")
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qosagent-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now)
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .sign(k, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def serve(metrics: dict) -> Iterator[tuple[MetricsServer, Agent]]:
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0", **metrics}, **ALL_OFF}, "test")
    agent = Agent(cfg, HostFS("/"), gpu=NoGpu("test"))
    srv = MetricsServer(agent, cfg.metrics.listen, cfg.metrics.tls, cfg.metrics.basic_auth)
    srv.start()
    try:
        yield srv, agent
    finally:
        srv.close()


def get(srv: MetricsServer, path: str, cert: Path | None, user: str | None = None,
        password: str | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = srv.address[:2]
    if cert:
        ctx = ssl.create_default_context(cafile=str(cert))
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, context=ctx, timeout=10)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {}
    if user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.fixture
def tls_and_password_file(certs: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[MetricsServer, Agent]]:
    pw = tmp_path / "password"
    pw.write_text("s3cret\n")
    yield from serve({"tls": {"cert_file": str(certs[0]), "key_file": str(certs[1])},
                      "basic_auth": {"username": "prometheus", "password_file": str(pw)}})


def test_https_with_basic_auth_serves_metrics(tls_and_password_file, certs) -> None:
    srv, _ = tls_and_password_file
    code, headers, body = get(srv, "/metrics", certs[0], "prometheus", "s3cret")
    assert code == 200 and b"qosagent_ticks_total" in body
    assert headers["Content-Type"].startswith("text/plain")


@pytest.mark.parametrize("user,password", [(None, None), ("prometheus", "wrong"), ("other", "s3cret"),
                                           ("prometheus", "s3cret\n"), ("prometheus", "")])
def test_wrong_or_missing_credentials_get_401(tls_and_password_file, certs, user, password) -> None:
    srv, _ = tls_and_password_file
    code, headers, body = get(srv, "/metrics", certs[0], user, password)
    assert code == 401 and headers["WWW-Authenticate"].startswith("Basic") and body == b""


def test_health_routes_need_no_credentials(tls_and_password_file, certs) -> None:
    srv, agent = tls_and_password_file
    # Not 401: answered without credentials (503 while the loop has not ticked, so a hung start fails its probe).
    assert get(srv, "/healthz", certs[0])[::2] == (503, b"starting\n")
    assert get(srv, "/readyz", certs[0])[::2] == (503, b"starting\n")
    agent.ready.set()
    agent.latest = type(agent.latest).build(1, __import__("time").monotonic(), 0.0, {})
    assert get(srv, "/healthz", certs[0])[0] == 200
    assert get(srv, "/readyz", certs[0])[0] == 200


def test_plain_http_to_a_tls_listener_gets_nothing(tls_and_password_file, certs) -> None:
    srv, _ = tls_and_password_file
    with pytest.raises((http.client.HTTPException, OSError)):
        get(srv, "/metrics", None, "prometheus", "s3cret")
    assert get(srv, "/metrics", certs[0], "prometheus", "s3cret")[0] == 200  # the listener is unharmed


def test_a_certificate_the_client_does_not_trust_is_refused(tls_and_password_file, tmp_path) -> None:
    srv, _ = tls_and_password_file
    other_cert, _ = self_signed(tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        get(srv, "/metrics", other_cert, "prometheus", "s3cret")


def test_bcrypt_hash(certs) -> None:
    import bcrypt

    hashed = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=4)).decode()
    for srv, _ in serve({"basic_auth": {"username": "scraper", "password_hash": hashed}}):
        assert get(srv, "/metrics", None, "scraper", "hunter2")[0] == 200
        assert get(srv, "/metrics", None, "scraper", "hunter2")[0] == 200  # the remembered credential
        assert get(srv, "/metrics", None, "scraper", "hunter3")[0] == 401


def test_unusable_files_are_named(certs, tmp_path) -> None:
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0", "tls": {"cert_file": str(tmp_path / "nope.crt"),
                                                                           "key_file": str(certs[1])}}}, "t")
    agent = Agent(cfg, HostFS("/"), gpu=NoGpu("test"))
    with pytest.raises(OSError, match="nope.crt"):
        MetricsServer(agent, cfg.metrics.listen, cfg.metrics.tls)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cfg = config_mod.parse({"metrics": {"basic_auth": {"username": "u", "password_file": str(empty)}}}, "t")
    with pytest.raises(OSError, match="empty"):
        MetricsServer(agent, "127.0.0.1:0", None, cfg.metrics.basic_auth)


@pytest.mark.parametrize("auth,why", [
    ({"username": "u"}, "exactly one of"),
    ({"username": "u", "password_file": "/p", "password_hash": "$2b$04$" + "a" * 53}, "exactly one of"),
    ({"username": "u", "password_hash": "plaintext"}, "not a bcrypt hash"),
    ({"username": "a:b", "password_file": "/p"}, "metrics.basic_auth.username"),
])
def test_config_refuses_bad_auth(auth, why) -> None:
    with pytest.raises(config_mod.ConfigError, match=why.replace("$", r"\$")):
        config_mod.parse({"metrics": {"basic_auth": auth}}, "t")
