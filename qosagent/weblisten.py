"""The agent's HTTP listeners (metrics, health): routes served on one address, optionally over TLS with client
certificates, with basic auth on the routes that carry data.

The security settings come from the config (metrics.tls, metrics.basic_auth) or from a web config file in the
shape Prometheus' exporter-toolkit reads (node_exporter's --web.config.file), so one file serves a fleet's
exporters alike.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Mapping

import yaml

from qosagent.serveloop import ServeLoop

if TYPE_CHECKING:
    from qosagent.config import MetricsBasicAuth, MetricsConfig, MetricsTls

log = logging.getLogger("qosagent.weblisten")

# (status, body, content type)
Reply = tuple[int, bytes, str]
Route = Callable[[Mapping[str, str]], Reply]
Authorizer = Callable[[str], bool]

_VERIFY = {"none": ssl.CERT_NONE, "verify_if_given": ssl.CERT_OPTIONAL, "require": ssl.CERT_REQUIRED}
# exporter-toolkit's client_auth_type values that Python's ssl can honour (it cannot ask for a certificate without
# verifying it, so RequestClientCert and RequireAnyClientCert are refused by name).
_TOOLKIT_CLIENT_AUTH = {"NoClientCert": "none", "VerifyClientCertIfGiven": "verify_if_given",
                        "RequireAndVerifyClientCert": "require"}
_TOOLKIT_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}


@dataclass(frozen=True)
class Security:
    tls: ssl.SSLContext | None = None
    authorized: Authorizer | None = None


def tls_context(cert_file: str, key_file: str, client_ca_file: str | None = None, client_auth: str = "none",
                min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2, what: str = "metrics.tls") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = min_version
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise OSError(f"{what}: cannot use cert_file {cert_file} with key_file {key_file}: {e}") from e
    if client_auth != "none":
        if not client_ca_file:
            raise OSError(f"{what}: client certificates are verified against client_ca_file, which is not set")
        try:
            ctx.load_verify_locations(cafile=client_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise OSError(f"{what}: cannot use client_ca_file {client_ca_file}: {e}") from e
        ctx.verify_mode = _VERIFY[client_auth]
    return ctx


def _bcrypt_matcher(hashed: bytes) -> Callable[[bytes], bool]:
    import bcrypt

    # bcrypt costs tens of milliseconds by design; remember the one credential that passed, as a digest.
    passed: list[bytes] = []

    def matches(given: bytes) -> bool:
        digest = hashlib.sha256(given).digest()
        if passed and hmac.compare_digest(passed[0], digest):
            return True
        if bcrypt.checkpw(given, hashed):
            passed[:] = [digest]
            return True
        return False

    return matches


def _password_matcher(auth: "MetricsBasicAuth") -> Callable[[bytes], bool]:
    if auth.password_hash is not None:
        return _bcrypt_matcher(auth.password_hash.encode())
    try:
        with open(auth.password_file, encoding="utf-8") as f:  # type: ignore[arg-type]
            password = f.read().rstrip("\r\n").encode()
    except OSError as e:
        raise OSError(f"metrics.basic_auth.password_file {auth.password_file}: {e.strerror}") from e
    if not password:
        raise OSError(f"metrics.basic_auth.password_file {auth.password_file}: empty")
    return lambda given: hmac.compare_digest(given, password)


def basic_auth(users: Mapping[str, Callable[[bytes], bool]]) -> Authorizer:
    """A check of an Authorization header against users and their password matchers."""
    known = {u.encode(): m for u, m in users.items()}

    def authorized(header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            raw = base64.b64decode(value.strip(), validate=True)
        except ValueError:
            return False
        given_user, sep, given_password = raw.partition(b":")
        matches = known.get(given_user)
        # An unknown user is checked against a known user's matcher too, so it takes as long as a wrong password.
        check = matches or next(iter(known.values()))
        ok = check(given_password)
        return bool(sep) and matches is not None and ok

    return authorized


def web_config(path: str) -> Security:
    """exporter-toolkit's web config: tls_server_config (cert_file, key_file, client_auth_type, client_ca_file,
    min_version) and basic_auth_users (name: bcrypt hash). Paths are relative to the file, as there."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise OSError(f"web config {path}: {e}") from e
    if not isinstance(data, dict) or set(data) - {"tls_server_config", "basic_auth_users"}:
        raise OSError(f"web config {path}: expected the keys tls_server_config and basic_auth_users only "
                      "(http_server_config and others are not supported)")
    here = os.path.dirname(os.path.abspath(path))

    def rel(p: Any) -> str:
        return os.path.join(here, str(p))

    tls_cfg = data.get("tls_server_config")
    ctx = None
    if tls_cfg is not None:
        known = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version"}
        if not isinstance(tls_cfg, dict) or set(tls_cfg) - known or not {"cert_file", "key_file"} <= set(tls_cfg):
            raise OSError(f"web config {path}: tls_server_config takes cert_file and key_file, and optionally "
                          f"{', '.join(sorted(known - {'cert_file', 'key_file'}))}")
        auth_type = tls_cfg.get("client_auth_type", "NoClientCert")
        if auth_type not in _TOOLKIT_CLIENT_AUTH:
            raise OSError(f"web config {path}: client_auth_type {auth_type!r} is not supported; expected one of "
                          f"{', '.join(_TOOLKIT_CLIENT_AUTH)}")
        version = tls_cfg.get("min_version", "TLS12")
        if version not in _TOOLKIT_VERSIONS:
            raise OSError(f"web config {path}: min_version {version!r}; expected TLS12 or TLS13")
        ca = tls_cfg.get("client_ca_file")
        ctx = tls_context(rel(tls_cfg["cert_file"]), rel(tls_cfg["key_file"]), rel(ca) if ca else None,
                          _TOOLKIT_CLIENT_AUTH[auth_type], _TOOLKIT_VERSIONS[version], what=f"web config {path}")
    users = data.get("basic_auth_users")
    authorized = None
    if users is not None:
        if not isinstance(users, dict) or not users or not all(
                isinstance(u, str) and ":" not in u and isinstance(h, str) and h.startswith("$2") for u, h in
                users.items()):
            raise OSError(f"web config {path}: basic_auth_users maps user names (no ':') to bcrypt hashes")
        authorized = basic_auth({u: _bcrypt_matcher(h.encode()) for u, h in users.items()})
    return Security(ctx, authorized)


def security(metrics: "MetricsConfig") -> Security:
    """What the metrics listener asks of its clients, from the web config file or the config's own keys."""
    if metrics.web_config_file:
        return web_config(metrics.web_config_file)
    t: "MetricsTls | None" = metrics.tls
    ctx = tls_context(t.cert_file, t.key_file, t.client_ca_file, t.client_auth) if t else None
    auth = metrics.basic_auth
    return Security(ctx, basic_auth({auth.username: _password_matcher(auth)}) if auth else None)


class Listener:
    """`routes` served on `listen` (HOST:PORT); the paths in `protected` need `security.authorized`. Raises OSError
    when the address cannot be bound."""

    def __init__(self, listen: str, routes: Mapping[str, Route], security: Security = Security(),
                 protected: frozenset[str] = frozenset(), name: str = "http"):
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        ssl_ctx, authorized = security.tls, security.authorized

        class Handler(BaseHTTPRequestHandler):
            # A client that stalls (or never finishes a TLS handshake) holds only its own thread, and not for long.
            timeout = 10

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                route = routes.get(path)
                if route is None:
                    return self._send(404, b"not found\n", "text/plain")
                if path in protected and authorized and not authorized(self.headers.get("Authorization", "")):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="qosagent", charset="UTF-8"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return self._send(*route(self.headers))

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

            def finish_request(self, request, client_address):  # type: ignore[no-untyped-def]
                if ssl_ctx is None:
                    return super().finish_request(request, client_address)
                # The handshake runs here, in the request's thread, so a slow client cannot stall accept().
                request.settimeout(Handler.timeout)
                with ssl_ctx.wrap_socket(request, server_side=True) as tls_sock:
                    super().finish_request(tls_sock, client_address)

            def handle_error(self, request, client_address):  # type: ignore[no-untyped-def]
                # Failed handshakes and dropped clients are the client's problem, not the agent's.
                log.debug("%s request from %s failed", name, client_address, exc_info=True)

        self.tls = ssl_ctx is not None
        self.httpd = Server((host, int(port)), Handler)
        self.address = self.httpd.server_address
        self.loop = ServeLoop(self.httpd, name)

    def start(self) -> None:
        self.loop.start()

    def close(self) -> None:
        """Stop serving and close the socket; safe on a listener never started."""
        self.loop.stop()
        self.httpd.server_close()
