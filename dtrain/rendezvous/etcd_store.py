"""The rendezvous on etcd v3: membership and quorum with no single point of failure.

:class:`EtcdRendezvous` answers the same calls as the in-memory
:class:`~dtrain.rendezvous.core.RendezvousCore` (join, heartbeat, ready, leave,
decide), but keeps nothing that matters in its own process: every fact lives
under the run's key prefix in etcd, so any number of ``dtrain rendezvous
--store etcd://...`` front-ends can serve one run at once (stateless), and a site
can use it directly (:class:`EtcdRendezvousClient`, ``--rendezvous etcd://...``).

Keys under ``<prefix>`` (``/dtrain/<run>/``):

* ``site/<id>``: ``{address, lease, joined_round, left}``; the registration (no lease).
* ``alive/<id>``: ``{address}`` on the site's lease, whose TTL is ``heartbeat_timeout_s``;
  a heartbeat is a keep-alive of that lease. The site is live while the key exists.
* ``ready/<r>/<id>``: ``{t}`` (wall-clock seconds) on the site's lease: ready for round r.
* ``startup``: ``{t}`` when the ``initial_sites``-th site registered.
* ``plan/<r>``: the round plan, written once by a transaction that succeeds only if no
  plan for r exists, after :func:`~dtrain.rendezvous.core.decide_quorum` held on what
  the store showed; ``next`` (= r + 1) in the same transaction. The last
  ``NUM_PLANS_KEPT`` plans are kept.
* ``report/<r>/<id>``: a site's round report for the status page, at most
  ``max_report_bytes``; the last ``num_report_rounds`` rounds are kept.

Waiters learn plans from a watch on ``plan/`` (one per process), not by polling;
the quorum is decided by whoever makes it complete (the last ready) or, on a
quorum timeout, by the first waiter whose timer fires. Times in keys are wall-clock
(``time.time()``): the clocks of the processes must agree to well under
``quorum_timeout_s`` (NTP). When etcd has no quorum (a majority of its members
down), every call raises :class:`~dtrain.rendezvous.etcd_client.EtcdError`, a
``RendezvousError``: sites keep training locally and say so in their log.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import parse_qsl, urlsplit

from dtrain.errors import RendezvousError
from dtrain.protocol import HeartbeatInfo, JoinInfo, Member, ReadyDecision, RoundPlan
from dtrain.rendezvous.core import NullReportSink, RendezvousConfig, ReportSink, SiteIdTaken, decide_quorum
from dtrain.rendezvous.etcd_client import (
    EtcdAuth,
    EtcdClient,
    EtcdTls,
    cmp_absent,
    op_delete,
    op_put,
    op_range,
    txn_range_kvs,
)

__all__ = [
    "timing_from_url",
    "EtcdStoreConfig",
    "SiteIdTaken",
    "EtcdRendezvous",
    "EtcdRendezvousClient",
    "NUM_PLANS_KEPT",
]

log = logging.getLogger(__name__)

NUM_PLANS_KEPT = 8
WAKE_JITTER_S = 0.2  # spread of the waiters' wake-ups at a quorum timeout (seconds)
MIN_WAKE_S = 0.05  # a waiting client looks again no sooner than this (seconds)


@dataclass(frozen=True, kw_only=True)
class EtcdStoreConfig:
    """Where the run's rendezvous state lives in etcd.

    Attributes:
        endpoints: ``host:port`` of etcd members' client ports.
        run: the run's name; its keys live under ``/dtrain/<run>/``.
        username: etcd user (none: no authentication).
        password: the user's password.
        ca_file: CA bundle (PEM) that verifies etcd's certificate; set: https.
        cert_file: client certificate (PEM) for etcd's client-certificate auth.
        key_file: the client certificate's private key (PEM).
        https: TLS to etcd even without ``ca_file`` (the system's CAs verify etcd).
        timeout_s: deadline of one etcd call on one member, seconds.
        num_report_rounds: round reports kept (the newest rounds), >= 1.
        max_report_bytes: largest round report stored; longer ones are dropped.
    """

    endpoints: tuple[str, ...]
    run: str = "default"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    https: bool = False
    timeout_s: float = 3.0
    num_report_rounds: int = 16
    max_report_bytes: int = 8192

    def __post_init__(self) -> None:
        if not self.endpoints or not all(isinstance(e, str) and e.rpartition(":")[2].isdigit() for e in self.endpoints):
            raise ValueError(f"endpoints must be host:port strings, got {self.endpoints!r}")
        if not self.run or "/" in self.run:
            raise ValueError(f"run must be a non-empty name without '/', got {self.run!r}")
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password must be given together")
        if self.cert_file is not None and self.key_file is None:
            raise ValueError("key_file must be set with cert_file")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if not isinstance(self.num_report_rounds, int) or self.num_report_rounds < 1:
            raise ValueError(f"num_report_rounds must be an int >= 1, got {self.num_report_rounds!r}")
        if not isinstance(self.max_report_bytes, int) or self.max_report_bytes < 256:
            raise ValueError(f"max_report_bytes must be an int >= 256, got {self.max_report_bytes!r}")

    @classmethod
    def parse(cls, url: str, **kw) -> "EtcdStoreConfig":
        """``etcd://h1:2379,h2:2379[/run][?name=value&...]``; ``etcds://`` for https.

        The query may name ``ca_file``, ``cert_file``, ``key_file``, ``username`` and
        ``password_file`` (a file holding the password: never the password itself), and
        the run's timing (:func:`timing_from_url`); ``kw`` sets fields too.

        Raises:
            ValueError: a malformed url or a field the config refuses.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("etcd", "etcds") or not parts.netloc:
            raise ValueError(f"an etcd store is etcd://host:port[,host:port...][/run], got {url!r}")
        run = parts.path.strip("/") or kw.pop("run", "default")
        for name, text in parse_qsl(parts.query, keep_blank_values=True):
            if name in _STORE_QUERY:
                kw.setdefault(name, text)
            elif name == "password_file":
                try:
                    kw.setdefault("password", Path(text).read_text().strip())
                except OSError as e:
                    raise ValueError(f"etcd url: password_file {text!r} cannot be read: {e}") from None
            elif name not in _TIMING_FIELDS:
                allowed = sorted({*_STORE_QUERY, "password_file", *_TIMING_FIELDS})
                raise ValueError(f"etcd url: unknown name {name!r}; allowed: {allowed}")
        return cls(endpoints=tuple(parts.netloc.split(",")), run=run, https=parts.scheme == "etcds", **kw)

    def client(self) -> EtcdClient:
        auth = EtcdAuth(username=self.username, password=self.password or "") if self.username else None
        tls = EtcdTls(ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file)
        use_tls = self.https or self.ca_file is not None or self.cert_file is not None
        return EtcdClient(self.endpoints, timeout_s=self.timeout_s, auth=auth, tls=tls if use_tls else None)


_TIMING_FIELDS = {f: float for f in ("quorum_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s")}
_TIMING_FIELDS.update({"reduce_timeout_s": float, "broadcast_timeout_s": float, "min_sites": int, "initial_sites": int})


_STORE_QUERY = ("ca_file", "cert_file", "key_file", "username")


def timing_from_url(url: str) -> RendezvousConfig:
    """The run's :class:`RendezvousConfig` from an ``etcd://...?name=value&...`` query (for
    sites on etcd directly; the unnamed fields keep their defaults).

    Raises:
        ValueError: a value the config refuses.
    """
    values = {}
    for name, text in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name not in _TIMING_FIELDS:
            continue  # a store field (EtcdStoreConfig.parse checks those)
        try:
            values[name] = _TIMING_FIELDS[name](text)
        except ValueError:
            raise ValueError(f"etcd url: {name} must be a number, got {text!r}") from None
    return RendezvousConfig(**values)


def _j(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _member(site_id: str, info: dict) -> Member:
    """A member from its ``alive/`` value (``address``, ``ranks``: a site group's rank addresses)."""
    return Member(site_id=site_id, address=info["address"], rank_addresses=tuple(info.get("ranks", ())))


def _plan_to_json(plan: RoundPlan, reason: str) -> bytes:
    return _j(
        {
            "round": plan.round,
            "members": [[m.site_id, m.address, list(m.rank_addresses)] for m in plan.members],
            "reduce_timeout_s": plan.reduce_timeout_s,
            "broadcast_timeout_s": plan.broadcast_timeout_s,
            "datagram_key": base64.b64encode(plan.datagram_key).decode(),
            "reason": reason,
            "t": time.time(),
        }
    )


def _plan_from_json(d: dict) -> RoundPlan:
    return RoundPlan(
        round=int(d["round"]),
        members=tuple(
            Member(site_id=m[0], address=m[1], rank_addresses=tuple(m[2] if len(m) > 2 else ())) for m in d["members"]
        ),
        reduce_timeout_s=float(d["reduce_timeout_s"]),
        broadcast_timeout_s=float(d["broadcast_timeout_s"]),
        datagram_key=base64.b64decode(d.get("datagram_key", "")),
    )


class EtcdRendezvous:
    """The rendezvous core over etcd (see the module docstring); thread-safe.

    ``now`` arguments are accepted for the core's signature and ignored: times that
    other processes compare are wall-clock seconds. Raises ``EtcdError`` (a
    ``RendezvousError``) when etcd cannot be reached or has no quorum, and
    :class:`SiteIdTaken` when a live site at another address holds the site id.

    Args:
        store: where and how to reach etcd.
        config: membership and round timing (the same as the in-memory core's).
        reports: where :meth:`snapshot` puts the stored round reports and plans for the
            status page (``dtrain.status.StatusLog``); a cache, refilled from the store.
    """

    blocking = True  # its calls wait on etcd: the gRPC servicer runs them on threads

    def __init__(
        self, store: EtcdStoreConfig, config: RendezvousConfig | None = None, *, reports: ReportSink | None = None
    ) -> None:
        self.store = store
        self.status_log: ReportSink = reports if reports is not None else NullReportSink()
        self.config = config or RendezvousConfig()
        self.etcd = store.client()
        self.prefix = f"/dtrain/{store.run}/".encode()
        self._ttl_s = max(1, math.ceil(self.config.heartbeat_timeout_s))
        self._cv = threading.Condition()
        self._plans: dict[int, RoundPlan] = {}
        self.plan_seen_at: dict[int, float] = {}  # round -> when this process learnt its plan (monotonic s)
        self._next = 0
        self._pending: set[int] = set()  # rounds this process saw a ready for and no plan yet
        self._next_check = 0.0
        self._dead_cache: tuple[float, tuple[str, ...]] | None = None
        self._watch = None
        self._watch_lock = threading.Lock()
        try:
            self._start_watch()
        except RendezvousError as e:  # etcd down now: the first call that needs it tries again
            log.warning("rendezvous(etcd): store unreachable at start (%s); retrying on first use", e)

    # ------------------------------------------------------------------ keys
    def _k(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()

    @staticmethod
    def _r(r: int) -> str:
        return f"{r:012d}"

    # ------------------------------------------------------------------ the plan watch
    def _start_watch(self) -> None:
        """Load the kept plans and watch ``plan/`` from there (once; raises EtcdError)."""
        with self._watch_lock:
            if self._watch is None:
                self._load_and_watch()

    def _load_and_watch(self) -> None:
        kvs, _, rev = self.etcd.range(self._k("plan/"), prefix=True)
        nxt = self.etcd.get(self._k("next"))
        with self._cv:
            for kv in kvs:
                self._add_plan(_plan_from_json(json.loads(kv.value)))
            if nxt is not None:
                self._next = max(self._next, int(nxt.value))
        self._watch = self.etcd.watch(self._k("plan/"), self._on_plans, prefix=True, start_revision=rev + 1)

    def _add_plan(self, plan: RoundPlan) -> None:
        if plan.round not in self._plans:
            self.plan_seen_at[plan.round] = time.monotonic()
            self.plan_seen_at.pop(plan.round - NUM_PLANS_KEPT, None)
        self._plans[plan.round] = plan
        self._next = max(self._next, plan.round + 1)
        for r in [r for r in self._plans if r <= plan.round - NUM_PLANS_KEPT]:
            del self._plans[r]
        self._pending = {r for r in self._pending if r >= self._next}

    def _on_plans(self, events, _rev: int) -> None:
        with self._cv:
            for e in events:
                if e.kind == "PUT":
                    self._add_plan(_plan_from_json(json.loads(e.kv.value)))
            self._cv.notify_all()

    @property
    def next_round(self) -> int:
        with self._cv:
            return self._next

    def wait_for_plan(self, round: int, timeout_s: float) -> RoundPlan | None:
        """Block until the watch delivered round ``round``'s plan, or ``timeout_s`` passed."""
        with self._cv:
            self._cv.wait_for(lambda: round in self._plans or self._next > round, timeout_s)
            return self._plans.get(round)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    # ------------------------------------------------------------------ membership
    def join(self, site_id: str, address: str, *, now: float = 0.0, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        self._start_watch()
        alive = self.etcd.get(self._k("alive", site_id))
        lease = 0
        if alive is not None:
            held = json.loads(alive.value).get("address")
            if held != address:
                raise SiteIdTaken(
                    f"site id {site_id!r} is held by a live site at {held} on run {self.store.run!r} "
                    f"(this one is at {address}): give each site its own --site-id, or wait "
                    f"{self.config.heartbeat_timeout_s}s for the other to be declared dead"
                )
            lease = alive.lease if self.etcd.lease_keepalive(alive.lease) > 0 else 0
        if not lease:
            lease = self.etcd.lease_grant(self._ttl_s)
        nxt = self.next_round
        reg = _j({"address": address, "lease": lease, "joined_round": nxt, "left": False})
        ok, resp = self.etcd.txn(
            [cmp_absent(self._k("alive", site_id))] if alive is None else [],
            [
                op_put(self._k("alive", site_id), _j({"address": address, "ranks": list(rank_addresses)}), lease),
                op_put(self._k("site", site_id), reg),
            ],
            [op_range(self._k("alive", site_id))],
        )
        if not ok:
            self.etcd.lease_revoke(lease)
            other = txn_range_kvs(resp[0])
            held = json.loads(other[0].value).get("address") if other else "?"
            raise SiteIdTaken(f"site id {site_id!r} was taken at the same moment by a site at {held}")
        self._dead_cache = None
        self._note_startup()
        members = tuple(m for m in self._alive_members() if m.site_id != site_id)
        log.info(
            "rendezvous(etcd): %s joined (%s); next round %d; %d other live sites", site_id, address, nxt, len(members)
        )
        return JoinInfo(
            next_round=nxt,
            members=members,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            needs_state=nxt > 0 and bool(members),
        )

    def _note_startup(self) -> None:
        if self.etcd.get(self._k("startup")) is not None:
            return
        _, count, _ = self.etcd.range(self._k("site/"), prefix=True, count_only=True)
        if count >= self.config.startup_sites:
            self.etcd.txn([cmp_absent(self._k("startup"))], [op_put(self._k("startup"), _j({"t": time.time()}))])

    def _alive_members(self) -> list[Member]:
        kvs, _, _ = self.etcd.range(self._k("alive/"), prefix=True)
        cut = len(self._k("alive/"))
        return [_member(kv.key[cut:].decode(), json.loads(kv.value)) for kv in kvs]

    def heartbeat(
        self,
        site_id: str,
        *,
        now: float = 0.0,
        inner_step: int = 0,
        last_loss: float | None = None,
        round_reports: Sequence[str] = (),
    ) -> HeartbeatInfo:
        """Keep the site's lease alive; store its round reports (bounded). An
        expired lease means the site was declared dead: it must resync."""
        reg = self.etcd.get(self._k("site", site_id))
        info = json.loads(reg.value) if reg is not None else None
        if info is None or info.get("left"):
            return HeartbeatInfo(
                known=False, resync_required=False, next_round=self.next_round, reason="unknown site: join again"
            )
        if self.etcd.lease_keepalive(int(info["lease"])) <= 0:
            reason = f"no heartbeat for > {self.config.heartbeat_timeout_s}s: its etcd lease expired, declared dead"
            return HeartbeatInfo(known=True, resync_required=True, next_round=self.next_round, reason=reason)
        if round_reports:
            self._store_reports(site_id, round_reports)
        return HeartbeatInfo(
            known=True, resync_required=False, next_round=self.next_round, reason="", dead=self._dead()
        )

    def _store_reports(self, site_id: str, raws: Sequence[str]) -> None:
        for raw in raws:
            if len(raw.encode()) > self.store.max_report_bytes:
                log.warning(
                    "rendezvous(etcd): dropped a %d-byte report of %s (> %d)",
                    len(raw),
                    site_id,
                    self.store.max_report_bytes,
                )
                continue
            try:
                r = int(json.loads(raw)["round"])
            except (ValueError, KeyError, TypeError):
                log.warning("rendezvous(etcd): dropped a report of %s without a round", site_id)
                continue
            if r >= self.next_round - self.store.num_report_rounds:
                self.etcd.put(self._k("report", self._r(r), site_id), raw.encode())

    def reports(self) -> dict[int, dict[str, str]]:
        """round -> site_id -> raw report JSON, of the rounds still kept."""
        kvs, _, _ = self.etcd.range(self._k("report/"), prefix=True)
        out: dict[int, dict[str, str]] = {}
        cut = len(self._k("report/"))
        for kv in kvs:
            r, _, site = kv.key[cut:].decode().partition("/")
            out.setdefault(int(r), {})[site] = kv.value.decode()
        return out

    def _dead(self) -> tuple[str, ...]:
        """Registered sites without a live lease (dead or left); cached for a heartbeat interval."""
        now = time.monotonic()
        c = self._dead_cache
        if c is not None and now - c[0] < self.config.heartbeat_interval_s:
            return c[1]
        sites, _, _ = self.etcd.range(self._k("site/"), prefix=True, keys_only=True)
        alive, _, _ = self.etcd.range(self._k("alive/"), prefix=True, keys_only=True)
        n, m = len(self._k("site/")), len(self._k("alive/"))
        dead = tuple(sorted({kv.key[n:].decode() for kv in sites} - {kv.key[m:].decode() for kv in alive}))
        self._dead_cache = (now, dead)
        return dead

    def leave(self, site_id: str, *, now: float = 0.0) -> None:
        reg = self.etcd.get(self._k("site", site_id))
        if reg is None:
            return
        info = json.loads(reg.value)
        self.etcd.lease_revoke(int(info["lease"]))
        self.etcd.put(self._k("site", site_id), _j({**info, "left": True}))
        self._dead_cache = None
        log.info("rendezvous(etcd): %s left", site_id)

    # ------------------------------------------------------------------ rounds
    def ready(self, site_id: str, round: int, *, now: float = 0.0) -> ReadyDecision:
        """Mark ``site_id`` ready for ``round`` (its first ready time is kept) and
        decide the quorum if this could complete it. Same answers as the in-memory core."""
        self._start_watch()
        known, lease = self._answer_known(site_id, round)
        if known is not None:
            return known
        key = self._k("ready", self._r(round), site_id)
        counts = self._count_ops(round)
        _, resp = self.etcd.txn([cmp_absent(key)], [op_put(key, _j({"t": time.time()}), lease), *counts], counts)
        with self._cv:
            self._pending.add(round)
        return self._decide_round(round, resp[-len(counts) :])

    def _answer_known(self, site_id: str, round: int) -> tuple[ReadyDecision | None, int]:
        """The answer when it does not depend on the quorum (a plan exists, the round
        ran, the site is unknown or dead), or None; and the site's lease."""
        _, resp = self.etcd.txn(
            [],
            [
                op_range(self._k("site", site_id)),
                op_range(self._k("alive", site_id)),
                op_range(self._k("plan", self._r(round))),
            ],
        )
        reg, alive, plan_kv = (txn_range_kvs(r) for r in resp)
        nxt = self.next_round
        info = json.loads(reg[0].value) if reg else {"left": True}
        if info.get("left"):
            return ReadyDecision(status="wait", reason="unknown site: join first", next_round=nxt), 0
        if not alive:
            return ReadyDecision(
                status="missed",
                reason=f"no heartbeat for > {self.config.heartbeat_timeout_s}s: its etcd lease expired, declared dead",
                next_round=nxt,
            ), 0
        if plan_kv:
            doc = json.loads(plan_kv[0].value)
            plan = _plan_from_json(doc)
            with self._cv:
                self._add_plan(plan)
            if site_id in plan.site_ids:  # every member learns why the round formed as it did
                why = doc.get("reason") or "already formed"
                return ReadyDecision(status="plan", reason=why, next_round=self.next_round, plan=plan), 0
            return ReadyDecision(
                status="missed",
                reason=f"round {round} started without {site_id} (straggler)",
                next_round=self.next_round,
            ), 0
        if round < nxt:
            return ReadyDecision(status="missed", reason=f"round {round} already ran", next_round=nxt), 0
        return None, int(info["lease"])

    def _count_ops(self, round: int) -> list[dict]:
        """Reads that tell, without listing anyone, whether the quorum could be complete:
        how many sites are live, how many ready for ``round`` and the earliest ready."""
        live = op_range(self._k("alive/"), prefix=True)["request_range"]
        ready = op_range(self._k("ready", self._r(round)) + b"/", prefix=True)["request_range"]
        return [
            {"request_range": {**live, "count_only": True}},
            {"request_range": {**ready, "limit": "1", "sort_order": "ASCEND", "sort_target": "CREATE"}},
        ]

    def _cannot_form_yet(self, counts: Sequence[dict]) -> str | None:
        """Why ``decide_quorum`` must answer "wait" on these counts (fewer ready than live,
        and the earliest ready less than ``quorum_timeout_s`` ago), or None: look closer."""
        num_live = int(counts[0].get("response_range", {}).get("count", 0))
        rng = counts[1].get("response_range", {})
        num_ready, first = int(rng.get("count", 0)), txn_range_kvs(counts[1])
        if not first or num_ready >= num_live:
            return None
        waited = time.time() - float(json.loads(first[0].value)["t"])
        if waited >= self.config.quorum_timeout_s:
            return None
        self._schedule(self.config.quorum_timeout_s - waited)
        return f"{num_ready} of {num_live} live sites ready; waiting up to {self.config.quorum_timeout_s - waited:.1f}s more"

    def _view(self, round: int) -> tuple[dict[str, float], int, float | None, bool, dict[str, str]]:
        """What the store shows for ``round``'s quorum, in one read: ready times, the
        registered count, the start-up time, whether no plan exists yet, live addresses."""
        _, resp = self.etcd.txn(
            [],
            [
                op_range(self._k("alive/"), prefix=True),
                op_range(self._k("ready", self._r(round)) + b"/", prefix=True),
                {"request_range": {**op_range(self._k("site/"), prefix=True)["request_range"], "count_only": True}},
                op_range(self._k("startup")),
                op_range(self._k("next")),
            ],
        )
        alive_kvs, ready_kvs = txn_range_kvs(resp[0]), txn_range_kvs(resp[1])
        n_alive, n_ready = len(self._k("alive/")), len(self._k("ready", self._r(round))) + 1
        addresses = {kv.key[n_alive:].decode(): json.loads(kv.value) for kv in alive_kvs}
        ready = {kv.key[n_ready:].decode(): float(json.loads(kv.value)["t"]) for kv in ready_kvs}
        joined = int(resp[2].get("response_range", {}).get("count", 0))
        startup = txn_range_kvs(resp[3])
        startup_t = float(json.loads(startup[0].value)["t"]) if startup else None
        return ready, joined, startup_t, not txn_range_kvs(resp[4]), addresses

    def _decide_round(self, round: int, counts: Sequence[dict] | None = None) -> ReadyDecision:
        """``decide_quorum`` on what the store shows; the plan written once if it holds."""
        if counts is not None and (why := self._cannot_form_yet(counts)) is not None:
            return ReadyDecision(status="wait", reason=why, next_round=max(self.next_round, round))
        ready, joined, startup_t, first_round, addresses = self._view(round)
        now = time.time()
        members, reason = decide_quorum(
            round=round,
            live=set(addresses),
            ready=ready,
            joined_ever=joined,
            now=now,
            config=self.config,
            startup_complete_at=startup_t,
            first_round=first_round,
        )
        if members is None:
            first = (
                max(min(ready.values(), default=now), startup_t or 0.0)
                if first_round
                else min(ready.values(), default=now)
            )
            self._schedule(first + self.config.quorum_timeout_s - now)
            return ReadyDecision(status="wait", reason=reason, next_round=max(self.next_round, round))
        plan = RoundPlan(
            round=round,
            members=tuple(_member(s, addresses[s]) for s in members),
            reduce_timeout_s=self.config.reduce_timeout_s,
            broadcast_timeout_s=self.config.broadcast_timeout_s,
            datagram_key=os.urandom(32),  # the round's datagram AEAD key (protocol.RoundPlan)
        )
        return self._write_plan(plan, reason)

    def _schedule(self, until_timeout_s: float) -> None:
        """When ``decide`` should look again: at the quorum timeout (plus a random delay of up
        to ``WAKE_JITTER_S``, so the waiters do not all read the full view at once: the first
        one forms the plan and the others' watches deliver it), or within a heartbeat
        interval (a site that dies while others wait shrinks the live set)."""
        until = min(max(0.0, until_timeout_s) + random.uniform(0.0, WAKE_JITTER_S), self.config.heartbeat_interval_s)
        with self._cv:
            self._next_check = time.monotonic() + until + 0.01

    def _write_plan(self, plan: RoundPlan, reason: str) -> ReadyDecision:
        r = plan.round
        body = _plan_to_json(plan, reason)
        old = max(0, r - NUM_PLANS_KEPT + 1)
        old_reports = max(0, r - self.store.num_report_rounds + 1)
        ok, resp = self.etcd.txn(
            [cmp_absent(self._k("plan", self._r(r)))],
            [
                op_put(self._k("plan", self._r(r)), body),
                op_put(self._k("next"), str(r + 1).encode()),
                op_delete(self._k("ready/"), end=self._k("ready", self._r(r + 1))),
                op_delete(self._k("plan/"), end=self._k("plan", self._r(old))),
                op_delete(self._k("report/"), end=self._k("report", self._r(old_reports))),
            ],
            [op_range(self._k("plan", self._r(r)))],
        )
        if ok:
            log.info("rendezvous(etcd): round %d formed with %s: %s", r, list(plan.site_ids), reason)
        else:  # another writer formed it first, perhaps with other members: theirs holds
            doc = json.loads(txn_range_kvs(resp[0])[0].value)
            plan, reason = _plan_from_json(doc), doc.get("reason") or reason
        with self._cv:
            self._add_plan(plan)
            self._cv.notify_all()
        return ReadyDecision(status="plan", reason=reason, next_round=self.next_round, plan=plan)

    def decide(self, *, now: float = 0.0) -> int:
        """Re-run the quorum decision for the rounds this process saw readies for, when
        a quorum timeout (or a heartbeat interval) has passed since the last look;
        returns ``next_round``. Costs nothing while no ready is pending here."""
        with self._cv:
            pending = sorted(r for r in self._pending if r >= self._next)
            due = time.monotonic() >= self._next_check
        if pending and due:
            try:
                _, counts = self.etcd.txn([], self._count_ops(pending[-1]))
                self._decide_round(pending[-1], counts)
            except RendezvousError as e:
                log.warning("rendezvous(etcd): deciding round %d failed: %s", pending[-1], e)
                with self._cv:
                    self._next_check = time.monotonic() + self.config.heartbeat_interval_s
        return self.next_round

    def wait_until_check(self, timeout_s: float) -> float:
        """Seconds until ``decide`` would look again, capped by ``timeout_s``."""
        with self._cv:
            return max(0.0, min(timeout_s, self._next_check - time.monotonic()))

    # ------------------------------------------------------------------ status page
    def snapshot(self, now: float) -> dict:
        """What the status page shows, read from the store (the shape of
        ``RendezvousCore.snapshot``). etcd keeps no heartbeat times, only whether a
        site's lease lives: a live site's heartbeat age is 0, a dead one's the timeout."""
        regs, _, _ = self.etcd.range(self._k("site/"), prefix=True)
        alive, _, _ = self.etcd.range(self._k("alive/"), prefix=True, keys_only=True)
        n, m = len(self._k("site/")), len(self._k("alive/"))
        live = {kv.key[m:].decode() for kv in alive}
        with self._cv:
            plans = dict(self._plans)
            nxt = self._next
        for r in sorted(plans):
            self.status_log.add_plan(r, list(plans[r].site_ids), now)
        for _, by_site in sorted(self.reports().items()):
            for site, raw in by_site.items():
                self.status_log.add_reports(site, [raw])
        c = self.config
        sites = {}
        for kv in regs:
            sid, info = kv.key[n:].decode(), json.loads(kv.value)
            rounds = [r for r, p in plans.items() if sid in p.site_ids]
            sites[sid] = {
                "address": info["address"],
                "alive": sid in live,
                "needs_resync": False,
                "resync_reason": "",
                "heartbeat_age_s": 0.0 if sid in live else c.heartbeat_timeout_s,
                "last_heartbeat": now if sid in live else now - c.heartbeat_timeout_s,
                "rounds_joined": len(rounds),
                "inner_step": 0,
                "last_loss": None,
                "joined_round": int(info.get("joined_round", 0)),
                "last_member_round": max(rounds, default=None),
                "ready_since": None,
                "left": bool(info.get("left")),
            }
        timing = ("heartbeat_interval_s", "heartbeat_timeout_s", "quorum_timeout_s", "reduce_timeout_s")
        return {
            "now": now,
            "next_round": nxt,
            "config": {
                **{k: getattr(c, k) for k in timing},
                "broadcast_timeout_s": c.broadcast_timeout_s,
                "min_sites": c.min_sites,
            },
            "first_ready_at": None,
            "sites": sites,
            "status": self.status_log.snapshot(),
        }


class EtcdRendezvousClient:
    """A site's rendezvous client straight on etcd (``--rendezvous etcd://...``), no
    ``dtrain rendezvous`` process: same methods as ``GrpcRendezvousClient``.

    ``ready`` waits for the plan on the process's watch of ``plan/``, waking only
    to decide the quorum itself when its timeout (or a heartbeat interval) passed.
    """

    def __init__(self, store: EtcdStoreConfig, config: RendezvousConfig | None = None) -> None:
        self.core = EtcdRendezvous(store, config)

    def join(self, site_id: str, address: str, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        return self.core.join(site_id, address, rank_addresses=rank_addresses)

    def heartbeat(
        self, site_id: str, inner_step: int = 0, last_loss: float | None = None, round_reports: Sequence[str] = ()
    ) -> HeartbeatInfo:
        return self.core.heartbeat(site_id, inner_step=inner_step, last_loss=last_loss, round_reports=round_reports)

    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision:
        deadline = time.monotonic() + timeout_s
        d = self.core.ready(site_id, round)
        while d.status == "wait":
            left = deadline - time.monotonic()
            if left <= 0:
                return d
            self.core.wait_for_plan(round, max(MIN_WAKE_S, self.core.wait_until_check(left)))
            d = self.core.ready(site_id, round)
        return d

    def leave(self, site_id: str) -> None:
        self.core.leave(site_id)

    def close(self) -> None:
        self.core.close()
