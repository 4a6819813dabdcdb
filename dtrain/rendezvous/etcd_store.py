"""The rendezvous on etcd v3: membership and quorum with no single point of failure.

:class:`EtcdStore` is a store under the one rendezvous core
(:class:`~dtrain.rendezvous.core.RendezvousCore` makes every decision;
:class:`EtcdRendezvous` is that core over this store). It keeps nothing that matters
in its own process: every fact lives under the run's key prefix in etcd, so any number of ``dtrain rendezvous
--store etcd://...`` front-ends can serve one run at once (stateless), and a site
can use it directly (:class:`EtcdRendezvousClient`, ``--rendezvous etcd://...``).

Keys under ``<prefix>`` (``/dtrain/<run>/``):

* ``site/<id>``: ``{address, lease, joined_round, left}``; the registration (no lease).
* ``alive/<id>``: ``{address}`` on the site's lease, whose TTL is ``heartbeat_timeout_s``;
  a heartbeat is a keep-alive of that lease. The site is live while the key exists.
* ``ready/<r>/<id>``: ``{t, seen}`` (wall-clock seconds: first asked, last renewed) on the
  site's lease: ready for round r; it counts only while renewed (``EtcdStore._fresh``).
* ``startup``: ``{t}`` when the ``initial_sites``-th site registered.
* ``plan/<r>``: the round plan, written once by a transaction that succeeds only if no
  plan for r exists, after :func:`~dtrain.rendezvous.core.decide_quorum` held on what
  the store showed; ``next`` (= r + 1) in the same transaction. The last
  ``NUM_PLANS_KEPT`` plans are kept.
* ``status/<id>``: ``{t, inner_step, last_loss}`` on the site's lease, for the status
  page; written at most every ``status_interval_s`` per process (bounded write cost).
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
import contextlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import parse_qsl, urlsplit

from dtrain.errors import RendezvousError
from dtrain.protocol import Member, RoundPlan
from dtrain.rendezvous.core import (
    RendezvousConfig,
    RendezvousCore,
    ReportSink,
    SiteIdTaken,
)
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
from dtrain.rendezvous.inproc import InprocRendezvousClient
from dtrain.rendezvous.store import Liveness, QuorumView, ReadyCounts, Standing, taken_message

__all__ = [
    "timing_from_url",
    "EtcdStoreConfig",
    "EtcdStore",
    "SiteIdTaken",
    "EtcdRendezvous",
    "EtcdRendezvousClient",
    "NUM_PLANS_KEPT",
]

log = logging.getLogger(__name__)

NUM_PLANS_KEPT = 8


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
        status_interval_s: a site's status key (heartbeat time, inner step, train loss,
            on its lease) is written at most this often per process, seconds (> 0): the
            status page's write cost is one put per site per interval.
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
    status_interval_s: float = 5.0

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
        if not isinstance(self.status_interval_s, (int, float)) or not self.status_interval_s > 0:
            raise ValueError(f"status_interval_s must be > 0 seconds, got {self.status_interval_s!r}")
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
            "left_out": list(plan.left_out),
            "deadline_reason": plan.deadline_reason,
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
        left_out=tuple(d.get("left_out", ())),
        deadline_reason=str(d.get("deadline_reason", "")),
        formed_at=float(d.get("t", 0.0)),  # wall-clock, the etcd store's clock
    )


class EtcdStore:
    """The rendezvous facts in etcd (see the module docstring); thread-safe.

    Stored times are wall-clock (``clock``); the ``now`` arguments only serve the status
    rows' ages. Calls raise ``EtcdError`` (a ``RendezvousError``) when etcd cannot be
    reached or has no quorum, and :class:`SiteIdTaken` when a live site at another
    address holds the site id.

    Args:
        store: where and how to reach etcd.
        config: membership and round timing (the same on every process of the run).
    """

    blocking = True  # its calls wait on etcd: the gRPC servicer runs them on threads
    local = False

    def __init__(self, store: EtcdStoreConfig, config: RendezvousConfig) -> None:
        self.store = store
        self.config = config
        self.etcd = store.client()
        self.prefix = f"/dtrain/{store.run}/".encode()
        self._ttl_s = max(1, math.ceil(config.silence_bound_s))
        self._cv = threading.Condition()
        self._plans: dict[int, RoundPlan] = {}
        self._reasons: dict[int, str] = {}  # round -> why its plan formed as it did
        self.plan_seen_at: dict[int, float] = {}  # round -> when this process learnt its plan (monotonic s)
        self._next = 0
        self._dead_cache: tuple[float, tuple[str, ...]] | None = None
        self._status_at: dict[str, float] = {}  # site -> when this process last wrote its status key (monotonic)
        self._watch = None
        self._watch_lock = threading.Lock()
        try:
            self._start_watch()
        except RendezvousError as e:  # etcd down now: the first call that needs it tries again
            log.warning("rendezvous(etcd): store unreachable at start (%s); retrying on first use", e)

    # ------------------------------------------------------------------ keys, plumbing
    def _k(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()

    @staticmethod
    def _r(r: int) -> str:
        return f"{r:012d}"

    def atomic(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # etcd's transactions make each step atomic

    def clock(self, now: float) -> float:
        return time.time()

    def next_round(self) -> int:
        with self._cv:
            return self._next

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()

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
                doc = json.loads(kv.value)
                self._add_plan(_plan_from_json(doc), doc.get("reason"))
            if nxt is not None:
                self._next = max(self._next, int(nxt.value))
        self._watch = self.etcd.watch(self._k("plan/"), self._on_plans, prefix=True, start_revision=rev + 1)

    def _add_plan(self, plan: RoundPlan, reason: str | None = None) -> None:
        if plan.round not in self._plans:
            self.plan_seen_at[plan.round] = time.monotonic()
            self.plan_seen_at.pop(plan.round - NUM_PLANS_KEPT, None)
        self._plans[plan.round] = plan
        if reason:
            self._reasons[plan.round] = reason
        self._next = max(self._next, plan.round + 1)
        for r in [r for r in self._plans if r <= plan.round - NUM_PLANS_KEPT]:
            del self._plans[r]
            self._reasons.pop(r, None)

    def _on_plans(self, events, _rev: int) -> None:
        with self._cv:
            for e in events:
                if e.kind == "PUT":
                    doc = json.loads(e.kv.value)
                    self._add_plan(_plan_from_json(doc), doc.get("reason"))
            self._cv.notify_all()

    def wait(self, round: int, timeout_s: float) -> None:
        """Block until the watch delivered round ``round``'s plan, or ``timeout_s`` passed."""
        with self._cv:
            self._cv.wait_for(lambda: round in self._plans or self._next > round, timeout_s)

    def wait_for_plan(self, round: int, timeout_s: float) -> RoundPlan | None:
        self.wait(round, timeout_s)
        with self._cv:
            return self._plans.get(round)

    # ------------------------------------------------------------------ membership
    def claim(self, site_id: str, address: str, rank_addresses: Sequence[str], *, now: float) -> int:
        self._start_watch()
        alive = self.etcd.get(self._k("alive", site_id))
        lease = 0
        if alive is not None:
            held = json.loads(alive.value).get("address")
            if held != address:
                raise SiteIdTaken(taken_message(site_id, held, address, self.store.run, self.config.silence_bound_s))
            lease = alive.lease if self.etcd.lease_keepalive(alive.lease) > 0 else 0
        if not lease:
            lease = self.etcd.lease_grant(self._ttl_s)
        nxt = self.next_round()
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
        self._status_at.pop(site_id, None)
        self._note_startup()
        return nxt

    def _note_startup(self) -> None:
        if self.etcd.get(self._k("startup")) is not None:
            return
        _, count, _ = self.etcd.range(self._k("site/"), prefix=True, count_only=True)
        if count >= self.config.startup_sites:
            self.etcd.txn([cmp_absent(self._k("startup"))], [op_put(self._k("startup"), _j({"t": time.time()}))])

    def live_members(self, now: float) -> list[Member]:
        kvs, _, _ = self.etcd.range(self._k("alive/"), prefix=True)
        cut = len(self._k("alive/"))
        return [_member(kv.key[cut:].decode(), json.loads(kv.value)) for kv in kvs]

    def keep_alive(
        self, site_id: str, *, now: float, inner_step: int, last_loss: float | None, unreachable: Sequence[str]
    ) -> Liveness:
        """Keep the site's lease alive, and every ``status_interval_s`` write its status
        key (heartbeat time, inner step, train loss) on that lease. An expired lease
        means the site was declared dead: it must resync. ``unreachable`` is not used
        (no shorter silence on etcd: a lease's TTL is fixed)."""
        reg = self.etcd.get(self._k("site", site_id))
        info = json.loads(reg.value) if reg is not None else None
        if info is None or info.get("left"):
            return Liveness(known=False)
        lease = int(info["lease"])
        if self.etcd.lease_keepalive(lease) <= 0:
            reason = f"no heartbeat for > {self.config.silence_bound_s}s: its etcd lease expired, declared dead"
            return Liveness(known=True, resync_reason=reason)
        mono = time.monotonic()
        if mono - self._status_at.get(site_id, -math.inf) >= self.store.status_interval_s:
            self._status_at[site_id] = mono
            status = {"t": time.time(), "inner_step": inner_step, "last_loss": last_loss}
            self.etcd.put(self._k("status", site_id), _j(status), lease=lease)
        return Liveness(known=True)

    def dead(self, now: float) -> tuple[str, ...]:
        """Registered sites without a live lease (dead or left); cached for a heartbeat interval."""
        mono = time.monotonic()
        c = self._dead_cache
        if c is not None and mono - c[0] < self.config.heartbeat_interval_s:
            return c[1]
        sites, _, _ = self.etcd.range(self._k("site/"), prefix=True, keys_only=True)
        alive, _, _ = self.etcd.range(self._k("alive/"), prefix=True, keys_only=True)
        n, m = len(self._k("site/")), len(self._k("alive/"))
        dead = tuple(sorted({kv.key[n:].decode() for kv in sites} - {kv.key[m:].decode() for kv in alive}))
        self._dead_cache = (mono, dead)
        return dead

    def release(self, site_id: str, *, now: float) -> None:
        reg = self.etcd.get(self._k("site", site_id))
        if reg is None:
            return
        info = json.loads(reg.value)
        self.etcd.lease_revoke(int(info["lease"]))
        self.etcd.put(self._k("site", site_id), _j({**info, "left": True}))
        self._dead_cache = None

    def put_reports(self, site_id: str, raws: Sequence[str], sink) -> None:
        """Store the site's round reports (at most ``max_report_bytes`` each; only the
        newest ``num_report_rounds`` rounds are kept)."""
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
            if r >= self.next_round() - self.store.num_report_rounds:
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

    # ------------------------------------------------------------------ rounds
    def standing(self, site_id: str, round: int, *, now: float) -> Standing:
        """The site's standing for ``round``. A plan the watch delivered that names the
        site is answered at once, with no etcd call: a member learns its plan as soon as
        the watch brings it, even while etcd is slow to answer (a plan never changes)."""
        self._start_watch()
        with self._cv:
            plan, reason = self._plans.get(round), self._reasons.get(round, "already formed")
        if plan is not None and site_id in plan.site_ids:
            return Standing(known=True, plan=plan, member=True, plan_reason=reason, next_round=self.next_round())
        _, resp = self.etcd.txn(
            [],
            [
                op_range(self._k("site", site_id)),
                op_range(self._k("alive", site_id)),
                op_range(self._k("plan", self._r(round))),
            ],
        )
        reg, alive, plan_kv = (txn_range_kvs(r) for r in resp)
        info = json.loads(reg[0].value) if reg else {"left": True}
        if info.get("left"):
            return Standing(known=False, next_round=self.next_round())
        if not alive:
            reason = f"no heartbeat for > {self.config.silence_bound_s}s: its etcd lease expired, declared dead"
            return Standing(known=True, resync_reason=reason, next_round=self.next_round())
        if plan_kv:
            doc = json.loads(plan_kv[0].value)
            plan = _plan_from_json(doc)
            reason = doc.get("reason") or "already formed"
            with self._cv:
                self._add_plan(plan, reason)
                self._cv.notify_all()
            return Standing(
                known=True, plan=plan, member=site_id in plan.site_ids, plan_reason=reason, next_round=self.next_round()
            )
        # No plan at the read's revision, but one may have formed since and the watch moved
        # next_round past it: take the plan with the round count, under one lock, else a member
        # of the round just formed was told "round already ran" (a 3-site etcd test under load)
        with self._cv:
            nxt, plan, reason = self._next, self._plans.get(round), self._reasons.get(round, "already formed")
        if plan is not None:
            return Standing(known=True, plan=plan, member=site_id in plan.site_ids, plan_reason=reason, next_round=nxt)
        return Standing(known=True, next_round=nxt, lease=int(info["lease"]))

    def adopt(self, round: int, *, now: float) -> bool:
        return False  # etcd's state outlives every process: nothing to adopt

    def mark_ready(self, site_id: str, round: int, *, now: float, lease: int) -> ReadyCounts:
        """Put ``ready/<round>/<site>`` (its first time is kept) and, in the same
        transaction, count the live and ready sites and read the earliest ready."""
        key = self._k("ready", self._r(round), site_id)
        live = op_range(self._k("alive/"), prefix=True)["request_range"]
        ready = op_range(self._k("ready", self._r(round)) + b"/", prefix=True)["request_range"]
        counts = [
            {"request_range": {**live, "count_only": True}},
            {"request_range": {**ready, "limit": "1", "sort_order": "ASCEND", "sort_target": "CREATE"}},
        ]
        wall = time.time()
        put = op_put(key, _j({"t": wall, "seen": wall}), lease)
        ok, resp = self.etcd.txn([cmp_absent(key)], [put, *counts], [op_range(key), *counts])
        held = [] if ok else txn_range_kvs(resp[0])
        if held:  # renew it (at most once per heartbeat interval); a stale one starts afresh
            old = json.loads(held[0].value)
            seen = float(old.get("seen", old["t"]))
            if wall - seen >= self.config.heartbeat_interval_s:
                first = old["t"] if wall - seen <= self.config.silence_bound_s else wall
                self.etcd.put(key, _j({"t": first, "seen": wall}), lease=lease)
        num_live = int(resp[-2].get("response_range", {}).get("count", 0))
        rng = resp[-1].get("response_range", {})
        first = txn_range_kvs(resp[-1])
        return ReadyCounts(
            num_live=num_live,
            num_ready=int(rng.get("count", 0)),
            first_ready_t=float(json.loads(first[0].value)["t"]) if first else None,
        )

    def view(self, round: int, *, now: float) -> QuorumView:
        """What the store shows for ``round``'s quorum, in one read."""
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
        startup = txn_range_kvs(resp[3])
        return QuorumView(
            live=set(addresses),
            ready=self._fresh({kv.key[n_ready:].decode(): json.loads(kv.value) for kv in ready_kvs}),
            joined=int(resp[2].get("response_range", {}).get("count", 0)),
            startup_t=float(json.loads(startup[0].value)["t"]) if startup else None,
            first_round=not txn_range_kvs(resp[4]),
            grace_left_s=0.0,
            member=lambda s: _member(s, addresses[s]),
        )

    def _fresh(self, readies: dict[str, dict]) -> dict[str, float]:
        """The ready times that count: a ready counts only while its site keeps asking
        (renewed every heartbeat interval; stale after ``heartbeat_timeout_s``). A site
        that deferred the round (etcd unreachable) trains on locally and asks no more,
        and its key may outlive an outage (etcd renews every lease on a new leader)."""
        wall, limit_s = time.time(), self.config.silence_bound_s
        return {s: float(d["t"]) for s, d in readies.items() if wall - float(d.get("seen", d["t"])) <= limit_s}

    def put_plan(self, plan: RoundPlan, reason: str, *, now: float) -> tuple[RoundPlan, str, bool]:
        """Write round r's plan if none exists (with ``next``, dropping older readies,
        plans and reports in the same transaction); the plan that holds is returned."""
        r = plan.round
        old = max(0, r - NUM_PLANS_KEPT + 1)
        old_reports = max(0, r - self.store.num_report_rounds + 1)
        ok, resp = self.etcd.txn(
            [cmp_absent(self._k("plan", self._r(r)))],
            [
                op_put(self._k("plan", self._r(r)), _plan_to_json(plan, reason)),
                op_put(self._k("next"), str(r + 1).encode()),
                op_delete(self._k("ready/"), end=self._k("ready", self._r(r + 1))),
                op_delete(self._k("plan/"), end=self._k("plan", self._r(old))),
                op_delete(self._k("report/"), end=self._k("report", self._r(old_reports))),
            ],
            [op_range(self._k("plan", self._r(r)))],
        )
        if not ok:
            doc = json.loads(txn_range_kvs(resp[0])[0].value)
            plan, reason = _plan_from_json(doc), doc.get("reason") or reason
        with self._cv:
            self._add_plan(plan, reason)
            self._cv.notify_all()
        return plan, reason, ok

    # ------------------------------------------------------------------ status page
    def site_rows(self, now: float, sink) -> tuple[dict[str, dict], float | None]:
        """The status rows from the store: registrations, live leases, and each site's
        status key (written every ``status_interval_s``, so a heartbeat age is at most
        that much too old); the stored plans and round reports go to ``sink``."""
        _, resp = self.etcd.txn(
            [],
            [
                op_range(self._k("site/"), prefix=True),
                {"request_range": {**op_range(self._k("alive/"), prefix=True)["request_range"], "keys_only": True}},
                op_range(self._k("status/"), prefix=True),
            ],
        )
        regs, alive, status_kvs = (txn_range_kvs(x) for x in resp)
        n, m, k = len(self._k("site/")), len(self._k("alive/")), len(self._k("status/"))
        live = {kv.key[m:].decode() for kv in alive}
        status = {kv.key[k:].decode(): json.loads(kv.value) for kv in status_kvs}
        with self._cv:
            plans = dict(self._plans)
        for r in sorted(plans):
            sink.add_plan(r, list(plans[r].site_ids), now)
        for _, by_site in sorted(self.reports().items()):
            for site, raw in by_site.items():
                sink.add_reports(site, [raw])
        wall, timeout_s = time.time(), self.config.silence_bound_s
        sites = {}
        for kv in regs:
            sid, info = kv.key[n:].decode(), json.loads(kv.value)
            st = status.get(sid, {})
            age = max(0.0, wall - float(st["t"])) if "t" in st else 0.0
            # a live lease had a keep-alive within its TTL; an expired one did not
            age = min(age, timeout_s) if sid in live else max(age, timeout_s + self.config.heartbeat_interval_s)
            rounds = [r for r, p in plans.items() if sid in p.site_ids]
            sites[sid] = {
                "address": info["address"],
                "alive": sid in live,
                "needs_resync": False,
                "resync_reason": "",
                "heartbeat_age_s": age,
                "last_heartbeat": now - age,
                "rounds_joined": len(rounds),
                "inner_step": int(st.get("inner_step", 0)),
                "last_loss": st.get("last_loss"),
                "joined_round": int(info.get("joined_round", 0)),
                "last_member_round": max(rounds, default=None),
                "ready_since": None,
                "left": bool(info.get("left")),
            }
        return sites, None


class EtcdRendezvous(RendezvousCore):
    """The rendezvous core over an :class:`EtcdStore` (``dtrain rendezvous --store
    etcd://...``: a stateless front-end; any number serve one run).

    Args:
        store: where and how to reach etcd.
        config: membership and round timing (the same as the in-memory core's).
        reports: where :meth:`snapshot` puts the stored round reports and plans for the
            status page (``dtrain.status.StatusLog``); a cache, refilled from the store.
    """

    def __init__(
        self, store: EtcdStoreConfig, config: RendezvousConfig | None = None, *, reports: ReportSink | None = None
    ) -> None:
        config = config or RendezvousConfig()
        super().__init__(config, reports=reports, store=EtcdStore(store, config))


class EtcdRendezvousClient(InprocRendezvousClient):
    """A site's rendezvous client straight on etcd (``--rendezvous etcd://...``), no
    ``dtrain rendezvous`` process: same methods as ``GrpcRendezvousClient``.

    ``ready`` waits for the plan on the process's watch of ``plan/``, waking only
    to decide the quorum itself when its timeout (or a heartbeat interval) passed.
    """

    def __init__(self, store: EtcdStoreConfig, config: RendezvousConfig | None = None) -> None:
        super().__init__(EtcdRendezvous(store, config))

    def close(self) -> None:
        self.core.close()
