"""The rendezvous's read-only status page over HTTP, beside its gRPC port.

Routes (GET/HEAD only; anything else is 404/405):

* ``/`` the page (``dtrain.status.page``): sites, rounds, validation-loss and
  sync-time charts (inline SVG), refreshing itself every ``refresh_s`` seconds;
* ``/fragment`` the page's live part (what the refresh swaps in);
* ``/api/status`` the same data as JSON (:func:`dtrain.status.build_status`);
* ``/metrics`` Prometheus text exposition (prometheus-client), for existing
  monitoring stacks.

Served by the standard library's :class:`http.server.ThreadingHTTPServer` on
its own daemon thread (one thread per request), so it never runs on, or waits
for, a gRPC server thread. Each request copies the rendezvous state with
``RendezvousCore.snapshot()``, which holds the core's lock only while copying
(microseconds for tens of sites and 200 rounds); formatting happens after the
lock is released. Nothing secret is shown: the core never sees the token, and
the sites' round reports are reduced to whitelisted fields
(``dtrain.status.REPORT_FIELDS``). There is no authentication: bind it to
127.0.0.1 or a private address (``dtrain rendezvous --http-bind``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, StateSetMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from dtrain.options import HostPort
from dtrain.status import SITE_STATES, build_status
from dtrain.status.page import csp_header, render_fragment, render_page

__all__ = ["StatusServer", "serve_status", "StatusCollector"]

log = logging.getLogger(__name__)

#: Seconds a connection may stay idle (a slow or stuck client cannot hold a thread longer).
_SOCKET_TIMEOUT_S = 10.0


#: The per-site families that copy one field of the site's status entry (absent or None: no sample):
#: (family class, metric name, help text, status key).
_PER_SITE_FAMILIES: tuple[tuple[type, str, str, str], ...] = (
    (GaugeMetricFamily, "dtrain_site_heartbeat_age_seconds", "Seconds since the last heartbeat.", "heartbeat_age_s"),
    (CounterMetricFamily, "dtrain_site_rounds_joined", "Rounds whose quorum admitted the site.", "rounds_joined"),
    (GaugeMetricFamily, "dtrain_site_inner_step", "Inner steps done (from heartbeats).", "inner_step"),
    (
        GaugeMetricFamily,
        "dtrain_site_train_loss",
        "Mean inner-step loss of the last round (nats/token).",
        "train_loss",
    ),
    (
        GaugeMetricFamily,
        "dtrain_site_val_loss",
        "Validation loss after the last reported round (nats/token).",
        "val_loss",
    ),
    (GaugeMetricFamily, "dtrain_site_last_round", "Round of the site's last report.", "last_reported_round"),
    (GaugeMetricFamily, "dtrain_site_round_sync_seconds", "Sync time of the last reported round.", "last_sync_s"),
    (
        GaugeMetricFamily,
        "dtrain_site_round_reduce_arrived_ratio",
        "Of expected contribution chunks that reached the site's buckets, last round.",
        "reduce_arrived_fraction",
    ),
    (
        GaugeMetricFamily,
        "dtrain_site_round_broadcast_arrived_ratio",
        "Of buckets whose mean the site got, last round.",
        "broadcast_arrived_fraction",
    ),
    (
        GaugeMetricFamily,
        "dtrain_site_round_steps",
        "Inner steps of the last reported round (time-based rounds: as many as fit the window).",
        "round_steps",
    ),
    (
        GaugeMetricFamily,
        "dtrain_site_tokens_per_second",
        "Tokens trained per second in the last reported round's inner steps.",
        "tokens_per_s",
    ),
    (
        GaugeMetricFamily,
        "dtrain_site_round_weight_tokens",
        "The site's token claim in the last reported round (its weight where token-weighted).",
        "weight",
    ),
    (CounterMetricFamily, "dtrain_site_round_reports", "Round reports received.", "num_reports"),
    (
        CounterMetricFamily,
        "dtrain_site_sent_bytes",
        "Payload bytes sent, summed over reported rounds.",
        "bytes_sent_total",
    ),
    (
        CounterMetricFamily,
        "dtrain_site_received_bytes",
        "Payload bytes received, summed over reported rounds.",
        "bytes_received_total",
    ),
    (
        CounterMetricFamily,
        "dtrain_site_stale_buckets",
        "Stale buckets, summed over reported rounds.",
        "stale_buckets_total",
    ),
    (
        CounterMetricFamily,
        "dtrain_site_repaired_buckets",
        "Repaired buckets, summed over reported rounds.",
        "repaired_buckets_total",
    ),
)


class StatusCollector(Collector):
    """Prometheus collector over a status source (collected on each scrape).

    Args:
        status: returns the status document (:func:`dtrain.status.build_status`).
    """

    def __init__(self, status: Callable[[], Mapping[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator:
        st = self._status()
        sites = st["sites"]
        yield from self._rendezvous_families(st)
        yield from self._site_state_families(sites)
        yield from self._per_site_families(sites)
        yield self._rejected_family(sites)

    @staticmethod
    def _rendezvous_families(st: Mapping[str, Any]) -> Iterator:
        """The rendezvous's own figures: rounds formed, sites per state, reports dropped."""
        g = GaugeMetricFamily("dtrain_rendezvous_next_round", "Rounds formed so far (the next round's number).")
        g.add_metric([], st["next_round"])
        yield g
        g = GaugeMetricFamily("dtrain_rendezvous_sites", "Sites per state.", labels=["state"])
        for state, n in st["site_counts"].items():
            g.add_metric([state], n)
        yield g
        c = CounterMetricFamily(
            "dtrain_rendezvous_round_reports_dropped", "Round reports dropped as malformed or excess."
        )
        c.add_metric([], st["num_reports_dropped"])
        yield c

    @staticmethod
    def _site_state_families(sites: list[Mapping[str, Any]]) -> Iterator:
        """Each site's state (a state set over ``SITE_STATES``) and whether it is up."""
        ss = StateSetMetricFamily("dtrain_site_state", "What each site is doing.", labels=["site"])
        for s in sites:
            ss.add_metric([s["site_id"]], {state: s["state"] == state for state in SITE_STATES})
        yield ss
        up = GaugeMetricFamily("dtrain_site_up", "1 when the site heartbeats within the timeout.", labels=["site"])
        for s in sites:
            up.add_metric([s["site_id"]], 0.0 if s["state"] in ("dead", "left") else 1.0)
        yield up

    @staticmethod
    def _per_site_families(sites: list[Mapping[str, Any]]) -> Iterator:
        """One family per row of ``_PER_SITE_FAMILIES``, a sample per site that has the field."""
        for cls, name, doc, key in _PER_SITE_FAMILIES:
            fam = cls(name, doc, labels=["site"])
            for s in sites:
                if s.get(key) is not None:
                    fam.add_metric([s["site_id"]], float(s[key]))
            yield fam

    @staticmethod
    def _rejected_family(sites: list[Mapping[str, Any]]) -> CounterMetricFamily:
        """Contributions each site rejected as an owner, by RejectCode."""
        # labelled by RejectCode name only (a bounded set; the status model maps any other
        # key to UNKNOWN): reasons name rounds and senders, which would make the series unbounded
        rej = CounterMetricFamily(
            "dtrain_site_rejected_contributions",
            "Contributions the site rejected as an owner, by RejectCode.",
            labels=["site", "code"],
        )
        for s in sites:
            for code, n in sorted(s["rejected_total"].items()):
                rej.add_metric([s["site_id"], code], n)
        return rej


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    timeout = _SOCKET_TIMEOUT_S
    server_version = "dtrain-status"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        log.debug("status http %s: " + format, self.address_string(), *args)

    def _send(self, code: int, body: bytes, content_type: str, extra: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        srv = self.server.owner
        path = self.path.split("?", 1)[0].split("#", 1)[0]
        try:
            if path in ("/", "/index.html"):
                body = render_page(srv.status(), refresh_s=srv.refresh_s).encode()
                self._send(
                    200,
                    body,
                    "text/html; charset=utf-8",
                    {"Content-Security-Policy": srv.csp, "X-Frame-Options": "DENY"},
                )
            elif path == "/fragment":
                self._send(
                    200,
                    render_fragment(srv.status()).encode(),
                    "text/html; charset=utf-8",
                    {"Content-Security-Policy": srv.csp},
                )
            elif path == "/api/status":
                body = json.dumps(srv.status(), allow_nan=False, indent=1).encode()
                self._send(200, body, "application/json")
            elif path == "/metrics":
                self._send(200, generate_latest(srv.registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found: try /, /api/status or /metrics\n", "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        except Exception:
            log.exception("status page: %s failed", path)
            try:
                self._send(500, b"internal error (see the rendezvous log)\n", "text/plain; charset=utf-8")
            except OSError:
                pass

    do_HEAD = do_GET  # noqa: N815

    def _refuse(self) -> None:
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: GET only\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"}
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds up shutdown
    allow_reuse_address = True
    owner: "StatusServer"


class _Server6(_Server):
    address_family = socket.AF_INET6


class StatusServer:
    """A running status page (from :func:`serve_status`).

    Attributes:
        address: ``host:port`` it listens on; url: ``http://host:port/``.
    """

    def __init__(
        self, snapshot: Callable[[float], Mapping[str, Any]], host: str, port: int, *, refresh_s: float, num_rounds: int
    ) -> None:
        self._snapshot = snapshot
        self.refresh_s = refresh_s
        self.num_rounds = num_rounds
        self.csp = csp_header(refresh_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(self.status))
        self._httpd = (_Server6 if ":" in host else _Server)((host, port), _Handler)
        self._httpd.owner = self
        bound_host, bound_port = self._httpd.server_address[:2]
        shown = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self.address = f"{shown}:{bound_port}" if ":" not in shown else f"[{shown}]:{bound_port}"
        self.url = f"http://{self.address}/"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="status-http", daemon=True
        )
        self._thread.start()
        self._stopped = False
        log.info("status page on %s (bound %s:%s)", self.url, bound_host, bound_port)

    def status(self) -> dict:
        """The status document now (copies the core's state under its lock, builds outside it)."""
        return build_status(self._snapshot(time.monotonic()), num_rounds=self.num_rounds)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> "StatusServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_status(core: Any, bind: str = "127.0.0.1:0", *, refresh_s: float = 2.0, num_rounds: int = 20) -> StatusServer:
    """Serve the status page of ``core`` (a ``dtrain.rendezvous.RendezvousCore``).

    Args:
        core: anything with ``snapshot(now) -> dict`` as ``RendezvousCore`` has.
        bind: ``host:port`` (port 0: any free port; read ``.address``).
        refresh_s: how often the page refreshes itself, seconds in [0.5, 600].
        num_rounds: rounds shown in the rounds table (1..1000); the charts show
            every round the core keeps (200).
    Raises:
        ValueError: a bad ``bind``, ``refresh_s`` or ``num_rounds``.
        OSError: the address cannot be bound.
    """
    addr = HostPort.parse(bind, "http_bind")
    if not 0.5 <= refresh_s <= 600:
        raise ValueError(f"refresh_s must be in [0.5, 600] seconds, got {refresh_s!r}")
    if not isinstance(num_rounds, int) or not 1 <= num_rounds <= 1000:
        raise ValueError(f"num_rounds must be an int in [1, 1000], got {num_rounds!r}")
    return StatusServer(core.snapshot, addr.host, addr.port, refresh_s=refresh_s, num_rounds=num_rounds)
