"""A small etcd v3 client over etcd's documented JSON gateway (``/v3/...``).

Only what the rendezvous needs: put, range, delete, txn, leases (grant,
keep-alive, revoke), watch (a streamed POST read on its own thread) and
authentication (user/password -> token). Keys and values are bytes on our side
and base64 on the wire; int64 fields arrive as JSON strings. Standard library only
(``http.client``, ``ssl``): see docs/DECISIONS.md, "etcd client", for why no PyPI
client.

Every call has a deadline (``timeout_s``); a member that does not answer, refuses
the connection or answers "no leader" is left for the next endpoint, and when
every endpoint failed the call raises :class:`EtcdError` (a
:class:`~dtrain.errors.RendezvousError`: a site keeps training and retries).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from dtrain.errors import RejectCode, RendezvousError

__all__ = ["EtcdError", "EtcdAuth", "EtcdTls", "KeyValue", "WatchEvent", "EtcdClient", "EtcdWatch", "prefix_end"]

log = logging.getLogger(__name__)


class EtcdError(RendezvousError):
    """etcd could not be reached or refused a request; the message names the endpoint(s) and etcd's words.

    Attributes:
        code: the gRPC status etcd answered with (its JSON gateway's numeric ``code``, as a
            :class:`~dtrain.errors.RejectCode`), or None when no member answered.
    """

    def __init__(self, message: str, code: RejectCode | None = None) -> None:
        super().__init__(message)
        self.code = code


#: gRPC status numbers (etcd's JSON gateway answers ``{"code": 5, ...}``) by name.
_GRPC_CODES = (
    "OK CANCELLED UNKNOWN INVALID_ARGUMENT DEADLINE_EXCEEDED NOT_FOUND ALREADY_EXISTS PERMISSION_DENIED "
    "RESOURCE_EXHAUSTED FAILED_PRECONDITION ABORTED OUT_OF_RANGE UNIMPLEMENTED INTERNAL UNAVAILABLE DATA_LOSS "
    "UNAUTHENTICATED"
).split()


def _reject_code(number: object) -> RejectCode:
    """The :class:`RejectCode` of gRPC status ``number`` (UNKNOWN for anything else)."""
    if isinstance(number, int) and not isinstance(number, bool) and 0 < number < len(_GRPC_CODES):
        return RejectCode.parse(_GRPC_CODES[number])
    return RejectCode.UNKNOWN


@dataclass(frozen=True, kw_only=True)
class EtcdAuth:
    """etcd's own user and password (``etcdctl user add``)."""

    username: str
    password: str


@dataclass(frozen=True, kw_only=True)
class EtcdTls:
    """TLS to etcd: the CA that signed etcd's certificate, and an optional client certificate (PEM files)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """``kind`` is ``"PUT"`` or ``"DELETE"``."""

    kind: str
    kv: KeyValue


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\0"
    p[-1] += 1
    return bytes(p)


def _kv(d: dict) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(d.get("key", "")),
        value=base64.b64decode(d.get("value", "")),
        create_revision=int(d.get("create_revision", 0)),
        mod_revision=int(d.get("mod_revision", 0)),
        lease=int(d.get("lease", 0)),
    )


MAX_SWEEPS = 1000  # bound on the sweeps over the members within one call's deadline
MIN_ATTEMPT_S = 0.5  # shortest deadline of one attempt on one member (seconds)
SWEEP_PAUSE_S = 0.1  # pause between two sweeps over every member (seconds)


class _Retryable(Exception):
    pass


class EtcdClient:
    """A thread-safe client of one etcd cluster.

    Args:
        endpoints: ``host:port`` of the members' client ports (any order; calls go to
            the last one that answered, and move on when it fails).
        timeout_s: deadline of one call on one endpoint, seconds.
        auth: user/password; the token is fetched on first use and again when etcd
            says it expired.
        tls: https with this CA / client certificate; None: plain http.

    Raises:
        ValueError: no endpoints.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 5.0,
        auth: EtcdAuth | None = None,
        tls: EtcdTls | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints must name at least one etcd member host:port")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._auth = auth
        self._ssl = tls.context() if tls is not None else None
        self._token: str | None = None
        self._lock = threading.Lock()
        self._current = 0
        self._local = threading.local()  # one keep-alive connection per thread and endpoint

    # ------------------------------------------------------------------ transport
    def connection(self, endpoint: str, timeout_s: float | None) -> http.client.HTTPConnection:
        host, _, port = endpoint.rpartition(":")
        if self._ssl is not None:
            return http.client.HTTPSConnection(host, int(port), timeout=timeout_s, context=self._ssl)
        return http.client.HTTPConnection(host, int(port), timeout=timeout_s)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._auth is not None:
            if self._token is None:
                self._authenticate()
            h["Authorization"] = self._token or ""
        return h

    def _authenticate(self) -> None:
        assert self._auth is not None
        body = {"name": self._auth.username, "password": self._auth.password}
        reply = self._post("/v3/auth/authenticate", body, authed=False)
        self._token = reply.get("token")

    def _post_once(self, endpoint: str, path: str, body: dict, authed: bool, timeout_s: float) -> dict:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(endpoint)
        if conn is None:
            conn = conns[endpoint] = self.connection(endpoint, timeout_s)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        headers = self.headers() if authed else {"Content-Type": "application/json"}
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            conns.pop(endpoint, None)
            raise _Retryable(f"{endpoint}: {type(e).__name__}: {e}") from None
        try:
            reply = json.loads(data) if data else {}
        except ValueError:
            raise _Retryable(f"{endpoint}: HTTP {resp.status}: not JSON: {data[:200]!r}") from None
        if resp.status == 200:
            return reply
        msg = reply.get("error") or reply.get("message") or data[:200].decode("utf-8", "replace")
        if authed and self._auth is not None and ("token" in msg or resp.status == 401):
            self._token = None
            raise _Retryable(f"{endpoint}: {msg} (authenticating again)")
        if resp.status >= 500 or "leader" in msg or "timed out" in msg or "unavailable" in msg:
            raise _Retryable(f"{endpoint}: HTTP {resp.status}: {msg}")
        raise EtcdError(
            f"etcd {path} refused at {endpoint}: HTTP {resp.status}: {msg}", _reject_code(reply.get("code"))
        )

    def _post(self, path: str, body: dict, authed: bool = True) -> dict:
        """POST to the current endpoint, then to the others in turn, sweep after sweep,
        until one answers or ``timeout_s`` passed (an election takes ~1 s: callers do not
        see it); raises EtcdError naming every member's last failure. A write whose answer
        was lost may be sent twice: the rendezvous's writes are idempotent or guarded by
        a transaction's compare."""
        deadline = time.monotonic() + self.timeout_s
        n = len(self.endpoints)
        errors: dict[str, str] = {}
        for sweep in range(MAX_SWEEPS):
            with self._lock:
                start = self._current
            for k in range(n):
                i = (start + k) % n
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # one member that hangs (a follower holding a proposal through an election)
                # must not use up the whole deadline: each attempt gets a share of it
                attempt_s = min(remaining, max(MIN_ATTEMPT_S, self.timeout_s / n))
                try:
                    reply = self._post_once(self.endpoints[i], path, body, authed, attempt_s)
                except _Retryable as e:
                    errors[self.endpoints[i]] = str(e)
                    continue
                if sweep or k:
                    with self._lock:
                        self._current = i
                    log.info("etcd: now talking to %s (%s)", self.endpoints[i], "; ".join(errors.values()))
                return reply
            if time.monotonic() + SWEEP_PAUSE_S >= deadline:
                break
            time.sleep(SWEEP_PAUSE_S)
        raise EtcdError(f"etcd {path}: no member answered within {self.timeout_s}s: " + "; ".join(errors.values()))

    # ------------------------------------------------------------------ kv
    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Set ``key``; returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def range(
        self, key: bytes, *, prefix: bool = False, keys_only: bool = False, count_only: bool = False
    ) -> tuple[list[KeyValue], int, int]:
        """``(kvs, count, revision)`` of ``key`` or of every key under the prefix ``key``."""
        body: dict[str, Any] = {"key": _b64(key), "keys_only": keys_only, "count_only": count_only}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        r = self._post("/v3/kv/range", body)
        return [_kv(d) for d in r.get("kvs", [])], int(r.get("count", 0)), int(r["header"]["revision"])

    def get(self, key: bytes) -> KeyValue | None:
        kvs, _, _ = self.range(key)
        return kvs[0] if kvs else None

    def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); returns how many went."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        return int(self._post("/v3/kv/deleterange", body).get("deleted", 0))

    def txn(self, compare: list[dict], success: list[dict], failure: Sequence[dict] = ()) -> tuple[bool, list[dict]]:
        """One transaction (build its parts with :func:`cmp_absent`, :func:`op_put`, ...).
        Returns ``(succeeded, responses)``."""
        r = self._post("/v3/kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        return bool(r.get("succeeded", False)), r.get("responses", [])

    # ------------------------------------------------------------------ leases
    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self._post("/v3/lease/grant", {"TTL": str(int(ttl_s)), "ID": "0"})["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its TTL in seconds, 0 when it expired (or never existed)."""
        r = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(r.get("result", r).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """Revoke ``lease``, deleting its keys (an unknown lease is not an error)."""
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if e.code is not RejectCode.NOT_FOUND:
                raise

    # ------------------------------------------------------------------ watch
    def watch(
        self,
        key: bytes,
        on_events: Callable[[list[WatchEvent], int], None],
        *,
        prefix: bool = False,
        start_revision: int = 0,
    ) -> "EtcdWatch":
        """Call ``on_events(events, revision)`` on a thread for every change of ``key``
        (or keys under it) from ``start_revision`` (0: from now). Stop with ``.stop()``."""
        return EtcdWatch(self, key, on_events, prefix=prefix, start_revision=start_revision)


def cmp_absent(key: bytes) -> dict:
    """Compare: ``key`` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def cmp_lease(key: bytes, lease: int) -> dict:
    """Compare: ``key`` is attached to ``lease``."""
    return {"key": _b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}


def op_put(key: bytes, value: bytes, lease: int = 0) -> dict:
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def op_range(key: bytes, *, prefix: bool = False) -> dict:
    req: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        req["range_end"] = _b64(prefix_end(key))
    return {"request_range": req}


def op_delete(key: bytes, *, prefix: bool = False, end: bytes | None = None) -> dict:
    req: dict[str, Any] = {"key": _b64(key)}
    if prefix or end is not None:
        req["range_end"] = _b64(end if end is not None else prefix_end(key))
    return {"request_delete_range": req}


def txn_range_kvs(response: dict) -> list[KeyValue]:
    """The key-values of one ``op_range`` answer in a txn's responses."""
    return [_kv(d) for d in response.get("response_range", {}).get("kvs", [])]


__all__ += ["cmp_absent", "cmp_lease", "op_put", "op_range", "op_delete", "txn_range_kvs"]

WATCH_IDLE_S = 10.0  # a watch stream silent this long is opened again (a member may be gone)


class EtcdWatch:
    """A watch on its own daemon thread; it re-opens the stream on another endpoint
    (from the next revision, so no event is lost or repeated) when its member fails.
    If etcd compacted that revision away, it goes on from the oldest one kept (the
    events between are lost: the rendezvous's waiters read the plan on their next wake)."""

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        on_events: Callable[[list[WatchEvent], int], None],
        *,
        prefix: bool,
        start_revision: int,
    ) -> None:
        self._client = client
        self._key = key
        self._prefix = prefix
        self._on_events = on_events
        self.next_revision = start_revision
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5.0)

    def _run(self) -> None:
        n = len(self._client.endpoints)
        attempt = 0
        while not self._stop.is_set():
            endpoint = self._client.endpoints[(self._client._current + attempt) % n]
            try:
                self._stream(endpoint)
                attempt = 0
            except (OSError, http.client.HTTPException, ValueError, EtcdError) as e:
                if self._stop.is_set():
                    return
                log.debug("etcd watch on %s ended: %s", endpoint, e)
                attempt += 1
                self._stop.wait(min(1.0, 0.05 * attempt))

    def _stream(self, endpoint: str) -> None:
        create: dict[str, Any] = {"key": _b64(self._key), "start_revision": str(self.next_revision)}
        if self._prefix:
            create["range_end"] = _b64(prefix_end(self._key))
        conn = self._client.connection(endpoint, WATCH_IDLE_S)
        self._conn = conn
        try:
            conn.request("POST", "/v3/watch", json.dumps({"create_request": create}), self._client.headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise EtcdError(f"etcd watch at {endpoint}: HTTP {resp.status}: {resp.read()[:200]!r}")
            while not self._stop.is_set():
                line = resp.readline()
                if not line:
                    return
                self._handle(json.loads(line))
        except TimeoutError:
            return  # idle: open it again
        finally:
            conn.close()
            self._conn = None

    def _handle(self, msg: dict) -> None:
        if "error" in msg:
            raise EtcdError(f"etcd watch: {msg['error']}")
        r = msg.get("result", {})
        if r.get("canceled"):
            compacted = int(r.get("compact_revision", 0))
            if compacted > self.next_revision:  # history gone: go on from the oldest kept revision
                log.warning(
                    "etcd watch: revisions %d..%d were compacted; events between are lost",
                    self.next_revision,
                    compacted - 1,
                )
                self.next_revision = compacted
            raise EtcdError(f"etcd watch canceled: {r.get('cancel_reason', '')}")
        rev = int(r.get("header", {}).get("revision", 0))
        events = [WatchEvent(kind=e.get("type", "PUT"), kv=_kv(e.get("kv", {}))) for e in r.get("events", [])]
        if events:
            self.next_revision = max(e.kv.mod_revision for e in events) + 1
            self._on_events(events, rev)
        elif rev and not self.next_revision:
            self.next_revision = rev + 1  # the created answer: later streams resume from here
