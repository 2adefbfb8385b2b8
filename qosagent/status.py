"""The agent's state over a root-only unix socket, and the client side of `qosagent status` / `reload`.

One JSON request per connection ({"cmd": "status" | "reload", ...}), one JSON answer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import time
from typing import TYPE_CHECKING, Any

from qosagent import capabilities
from qosagent.capability import Attention
from qosagent.serveloop import ServeLoop

if TYPE_CHECKING:
    from qosagent.daemon import Agent

log = logging.getLogger("qosagent.status")


class NoAgent(Exception):
    """No agent answers on the socket."""


class StatusServer:
    def __init__(self, agent: "Agent", path: str):
        self.path = path
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        if os.path.exists(path):
            # A socket left by a crashed agent; one that still answers means another agent runs here.
            try:
                request(path, {"cmd": "ping"}, timeout=0.5)
            except NoAgent:
                os.unlink(path)
            else:
                raise OSError(f"another agent answers on {path}")

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    req = json.loads(self.rfile.readline(65536) or b"{}")
                    cmd = req.get("cmd", "status")
                    if cmd == "status":
                        resp: dict[str, Any] = agent.status(decisions=bool(req.get("decisions")))
                    elif cmd == "reload":
                        ok, message = agent.reload_and_wait()
                        resp = {"ok": ok, "message": message}
                    elif cmd == "ping":
                        resp = {"ok": True}
                    else:
                        resp = {"error": f"unknown command {cmd!r}"}
                except Exception as e:  # noqa: BLE001 - a bad request gets an answer, never kills the server
                    resp = {"error": str(e)}
                self.wfile.write(json.dumps(resp, default=str).encode() + b"\n")

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        old = os.umask(0o177)  # the socket is created 0600: state and reload are for root only
        try:
            self.server = Server(path, Handler)
        finally:
            os.umask(old)
        self.loop = ServeLoop(self.server, "status")

    def start(self) -> None:
        self.loop.start()

    def close(self) -> None:
        self.loop.stop()
        self.server.server_close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def request(path: str, req: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise NoAgent(f"no agent running (nothing answers on {path}: {e.strerror})") from None
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    if not buf:
        raise NoAgent(f"the agent on {path} closed the connection without answering")
    return json.loads(buf)


def ranked(status: dict[str, Any]) -> list[str]:
    """Every tenant of the status' capability parts, those that need it most first: in breach of an SLO, then
    throttled, then by requests per second (each capability's Capability.attention), then by name."""
    seen: dict[str, Attention] = {}
    for cls in capabilities.CAPABILITIES:
        part = status.get(cls.name)
        if not isinstance(part, dict):
            continue
        for row in part.get("tenants") or []:
            seen.setdefault(row["tenant"], Attention())
        for tenant, a in cls.attention(part).items():
            seen[tenant] = seen.get(tenant, Attention()) | a
    return sorted(seen, key=lambda t: (not seen[t].breaching, not seen[t].throttled, -seen[t].rps, t))


def select(status: dict[str, Any], tenants: list[str]) -> dict[str, Any]:
    """The status with each capability's tenant rows cut to `tenants`, in their order."""
    order = {t: i for i, t in enumerate(tenants)}
    out = dict(status)
    for cls in capabilities.CAPABILITIES:
        part = status.get(cls.name)
        if isinstance(part, dict) and part.get("tenants"):
            rows = sorted((r for r in part["tenants"] if r["tenant"] in order), key=lambda r: order[r["tenant"]])
            out[cls.name] = {**part, "tenants": rows}
    return out


def render(status: dict[str, Any], top: int = 0, tenant: str | None = None) -> str:
    """The human view: agent line, capabilities, the services', each capability's own table, recent decisions.
    Tenants most in need first, at most `top` of them (0: all), or only `tenant`, with a line saying how many were
    left out."""
    everyone = ranked(status)
    shown = [tenant] if tenant is not None else everyone[:top] if top > 0 else everyone
    left_out = len(everyone) - len([t for t in shown if t in everyone])
    status = select(status, shown)
    age = time.time() - float(status.get("time", 0))
    resting = status.get("self", {}).get("resting")
    lines = [
        f"qosagent {status.get('version')}  config {status.get('config')}  tick {status.get('seq')} "
        f"({age:.1f}s ago)  interval {status.get('interval_s', 0) * 1000:.0f}ms"
        + (f", resting {status.get('rest_interval_s', 0) * 1000:.0f}ms" if resting else ""),
        "",
        "CAPABILITY   STATE        REASON",
    ]
    for name, v in status.get("capabilities", {}).items():
        lines.append(f"{name:<12} {v['state']:<12} {v.get('reason', '')}")
    err = status.get("self", {}).get("last_reload_error")
    if err:
        lines.append(f"\nlast reload refused: {err}")
    for svc in capabilities.services(capabilities.CAPABILITIES):
        part = status.get(svc.name)
        if part:
            lines.append("\n" + svc.render(part))
    if left_out:
        lines.append(f"\nTENANTS: {len(everyone) - left_out} of {len(everyone)} shown (SLO breach, then throttled, "
                     f"then busiest first); {left_out} left out: --top N, --tenant NAME, --json for all")
    for cls in capabilities.CAPABILITIES:
        part = status.get(cls.name)
        if part:
            text = cls.render(part)
            if text:
                lines += ["", text.rstrip()]
    decisions = status.get("decisions") or []
    if decisions:
        lines += ["", "RECENT DECISIONS"]
        for d in decisions[-10:]:
            when = time.strftime("%H:%M:%S", time.localtime(d["time"]))
            flag = "" if d.get("applied", True) else " [dry-run]"
            lines.append(f"{when} {d['capability']:<10} {d['target']:<14} {d['action']:<10} "
                         f"{d['change']}  {d['reason']}{flag}")
    return "\n".join(lines)
