"""The seam to the fleet's engine: etcd v3 through its JSON gateway (POST /v3/...), with httpx.

Why this client: the `etcd3` package is unmaintained (0.12, 2020) and pins an old protobuf that would clash with
grpcio's (already a dependency, for the container runtime); grpcio with etcd's protos would mean vendoring and
building etcd's .proto files and their gogoproto/googleapis imports. The JSON gateway is part of every etcd >= 3.4
server (no proxy to run), speaks the same KV, lease and txn API, and needs only an HTTP client the project
already uses and that is well kept (httpx). One stream: an agent watches the round record (the gateway's watch,
a long POST answered by a line of JSON per event), so it reads its grant when it is written; the watch gives up
after a silence and the agent polls while it is down, so a dead connection costs latency, never a hung agent.

The face is narrow so that another engine (a Kubernetes Lease) could stand behind it: leases (grant, keep alive,
revoke), put and get under a prefix, an election (campaign on one key under the candidate's lease), and writes
fenced by the election's revision (a deposed leader's writes fail instead of landing).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator


class EtcdError(Exception):
    """etcd could not be reached on any endpoint, or refused the request: the message says which and why."""


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def _range_end(prefix: str) -> str:
    """The key just past every key starting with prefix (etcd's prefix range)."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return _b64(bytes(b))


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _kv(d: dict[str, Any]) -> KV:
    return KV(_unb64(d.get("key")).decode(errors="replace"), _unb64(d.get("value")),
              int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)), int(d.get("lease", 0)))


@dataclass(frozen=True)
class Leadership:
    """Who holds the election key: value (the leader's id), and create_revision, the fencing token."""

    leader: str
    revision: int
    ours: bool


class Etcd:
    def __init__(self, endpoints: Iterable[str], timeout: float = 1.0):
        # Imported here, as pyroute2 and pynvml are where they are used: an agent without fleet never loads it.
        import httpx

        self._http_error = httpx.HTTPError
        self._stream_error = (httpx.HTTPError, httpx.StreamError)  # StreamClosed: closed by close() meanwhile
        self._timeout = httpx.Timeout
        self.endpoints = list(endpoints)
        self._at = 0  # the endpoint that answered last: tried first
        self.client = httpx.Client(timeout=timeout)
        # The watch's own: a stream holds its connection, and closing this client ends a watch from another thread.
        self.stream_client = httpx.Client(timeout=timeout)
        # httpx logs every request at info: several a second per node would bury the agent's own log.
        logging.getLogger("httpx").setLevel(logging.WARNING)

    def close(self) -> None:
        self.client.close()
        self.stream_client.close()

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for i in range(len(self.endpoints)):
            at = (self._at + i) % len(self.endpoints)
            url = self.endpoints[at] + path
            try:
                r = self.client.post(url, json=body)
            except self._http_error as e:
                errors.append(f"{url}: {type(e).__name__} {e}")
                continue
            try:
                doc = r.json()
            except ValueError:
                doc = {}
            if r.status_code != 200 or not isinstance(doc, dict):
                # A refusal (bad request, lease not found, no leader): the next endpoint would say the same
                # unless this one has no quorum (503), which another member may have.
                msg = f"{url}: HTTP {r.status_code} {doc.get('message') or doc.get('error') or r.text[:200]}"
                if r.status_code in (502, 503, 504):
                    errors.append(msg)
                    continue
                raise EtcdError(msg)
            self._at = at
            return doc
        raise EtcdError("; ".join(errors) or "no endpoints")

    # ---- leases ------------------------------------------------------------------------------------------
    def grant(self, ttl: float) -> int:
        doc = self._call("/v3/lease/grant", {"TTL": max(int(round(ttl)), 1)})
        return int(doc["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL after the refresh; 0 when it has expired (a new one is needed)."""
        doc = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((doc.get("result") or {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    # ---- keys --------------------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._call("/v3/kv/put", body)

    def get_prefix(self, prefix: str) -> list[KV]:
        return self.range_prefix(prefix)[0]

    def range_prefix(self, prefix: str, keys_only: bool = False, min_mod_revision: int = 0,
                     revision: int = 0) -> tuple[list[KV], int]:
        """The keys under prefix (without values when keys_only; only those written after min_mod_revision - 1
        when given; as of revision when given) and the store's revision the answer is from."""
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _range_end(prefix)}
        if keys_only:
            body["keys_only"] = True
        if min_mod_revision:
            body["min_mod_revision"] = str(min_mod_revision)
        if revision:
            body["revision"] = str(revision)
        doc = self._call("/v3/kv/range", body)
        return [_kv(d) for d in doc.get("kvs") or []], int((doc.get("header") or {}).get("revision", 0))

    def get_many(self, keys: Iterable[str]) -> list[KV | None]:
        """Several keys read at one revision (one transaction), in keys' order."""
        doc = self._call("/v3/kv/txn", {"success": [{"request_range": {"key": _b64(k)}} for k in keys]})
        out: list[KV | None] = []
        for r in doc.get("responses") or []:
            kvs = (r.get("response_range") or {}).get("kvs") or []
            out.append(_kv(kvs[0]) if kvs else None)
        return out

    def get(self, key: str) -> KV | None:
        doc = self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = doc.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def watch(self, key: str, idle: float) -> Iterator[int]:
        """Until the stream breaks: the store's revision when the watch is set up, then the mod revision of each
        change of key, as etcd sends them. Raises EtcdError when the stream breaks, is refused or cancelled, or
        stays silent for idle seconds (a healthy writer of key writes more often: see the caller)."""
        url = self.endpoints[self._at] + "/v3/watch"
        try:
            with self.stream_client.stream("POST", url, json={"create_request": {"key": _b64(key)}},
                                           timeout=self._timeout(self.client.timeout.connect, read=idle)) as r:
                if r.status_code != 200:
                    raise EtcdError(f"{url}: HTTP {r.status_code}")
                for line in r.iter_lines():
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                        res = doc["result"]
                        if res.get("canceled"):
                            raise EtcdError(f"{url}: watch cancelled ({res.get('cancel_reason', 'no reason')})")
                        if res.get("created"):
                            yield int(res["header"]["revision"])
                        for ev in res.get("events") or []:
                            yield int(ev["kv"]["mod_revision"])
                    except (ValueError, KeyError, TypeError) as e:
                        raise EtcdError(f"{url}: unexpected watch answer {line[:200]!r} ({e})") from None
        except self._stream_error as e:
            raise EtcdError(f"{url}: watch: {type(e).__name__} {e}") from None
        raise EtcdError(f"{url}: the watch stream ended")

    # ---- election and fenced writes ----------------------------------------------------------------------
    def campaign(self, key: str, me: str, lease: int) -> Leadership:
        """Take key for me under lease if nobody holds it; either way, who holds it now. The key goes with the
        holder's lease, so a dead leader is replaced within one lease TTL."""
        doc = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(me), "lease": str(lease)}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })
        if doc.get("succeeded"):
            rev = int(doc["header"]["revision"])
            return Leadership(me, rev, True)
        kvs = (doc.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:  # released between the compare and the read: the next round campaigns again
            return Leadership("", 0, False)
        kv = _kv(kvs[0])
        who = kv.value.decode(errors="replace")
        return Leadership(who, kv.create_revision, who == me and kv.lease == lease)

    def fenced(self, key: str, revision: int, puts: Iterable[tuple[str, bytes, int]],
               deletes: Iterable[str] = ()) -> bool:
        """Apply puts (key, value, lease) and deletes in one transaction, only while key's create revision is
        revision (we still lead). False: deposed, nothing written."""
        ops: list[dict[str, Any]] = []
        for k, v, lease in puts:
            put: dict[str, Any] = {"key": _b64(k), "value": _b64(v)}
            if lease:
                put["lease"] = str(lease)
            ops.append({"request_put": put})
        ops += [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        doc = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}],
            "success": ops,
        })
        return bool(doc.get("succeeded"))

    def delete(self, key: str) -> None:
        self._call("/v3/kv/deleterange", {"key": _b64(key)})
