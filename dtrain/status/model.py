"""What the rendezvous's status page shows: per-round reports from sites, site
states, and the status document behind ``/``, ``/api/status`` and ``/metrics``.

Sites send a small report of each round attempt on their next heartbeat
(``HeartbeatRequest.round_reports``, one JSON object each; see
:func:`round_report`). The rendezvous keeps the fields in :data:`REPORT_FIELDS`
(checked for type and bounded in size, anything else dropped, so a site cannot
put arbitrary text or secrets on the page) in a :class:`StatusLog`, which
:class:`dtrain.rendezvous.RendezvousCore` updates under its lock and copies in
``snapshot()``. :func:`build_status` turns a snapshot into the status document,
outside any lock.

Site states (:func:`decide_site_state`, a pure decision with a reason):
``dead`` (silent longer than ``heartbeat_timeout_s``), ``joining`` (must pull
state, or joined after round 0 and not in a round since), ``late`` (heartbeats
overdue, or the others have waited for it longer than half the quorum timeout),
``in round`` (waiting for a quorum, or a member of the newest round that has
not reported it yet), ``training`` (otherwise), and ``left`` (left on purpose).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dtrain.errors import RejectCode

__all__ = [
    "REPORT_FIELDS",
    "MAX_REPORT_BYTES",
    "MAX_REPORTS_PER_HEARTBEAT",
    "SITE_STATES",
    "round_report",
    "parse_report",
    "StatusLog",
    "decide_site_state",
    "build_status",
]

log = logging.getLogger(__name__)

#: Largest accepted report (bytes of JSON); larger ones are dropped.
MAX_REPORT_BYTES = 8192
#: Most reports one heartbeat may carry; the rest are dropped (oldest first kept).
MAX_REPORTS_PER_HEARTBEAT = 16
_MAX_STR = 200
_MAX_LIST = 64

_NUM = "num"
_INT = "int"
_STR = "str"
_BOOL = "bool"
_STRS = "strs"
_COUNTS = "counts"
#: Fields of a round report (a subset of the worker's metrics line, docs/METRICS.md) and their kinds.
REPORT_FIELDS: dict[str, str] = {
    "site": _STR,
    "round": _INT,
    "status": _STR,
    "reason": _STR,
    "members": _STRS,
    "val_loss": _NUM,
    "train_loss": _NUM,
    "inner_steps": _INT,
    "round_steps": _INT,  # inner steps of this round (time-based rounds: as many as fit the window)
    "tokens_per_s": _NUM,
    "tokens": _INT,  # the site's token claim: its weight in a token-weighted mean
    "sync_s": _NUM,
    "reduce_arrived_fraction": _NUM,
    "reduce_live_fraction": _NUM,
    "broadcast_arrived_fraction": _NUM,
    "included_fraction": _NUM,
    "bytes_sent": _INT,
    "bytes_received": _INT,
    "stale_buckets": _INT,
    "repaired_buckets": _INT,
    "skipped_buckets": _INT,
    "contributed": _BOOL,
    "rejected": _COUNTS,
    "num_errors": _INT,
    "time": _NUM,
    "fragment": _INT,  # Streaming DiLoCo: the fragment a round synchronised (absent: the whole model)
    # the phases' times from the plan's formation (what the rendezvous derives deadlines from)
    "reduce_s": _NUM,
    "means_s": _NUM,
    "reduce_timeout_s": _NUM,
    "broadcast_timeout_s": _NUM,
    "deadline_reason": _STR,
}
SITE_STATES = ("training", "in round", "late", "dead", "joining", "left")


def round_report(metrics_line: Mapping[str, Any]) -> dict:
    """The status-page report of one round attempt, from a worker's metrics line.

    Keeps the :data:`REPORT_FIELDS` present in ``metrics_line`` and replaces
    ``errors`` (a list of messages) by ``num_errors``. The caller adds nothing
    secret: metrics lines hold no tokens.
    """
    rep = {k: metrics_line[k] for k in REPORT_FIELDS if k in metrics_line}
    if "errors" in metrics_line:
        rep["num_errors"] = len(metrics_line["errors"] or ())
    return rep


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _clean(kind: str, v: Any) -> tuple[bool, Any]:
    """(valid, cleaned value) of one report field."""
    if kind == _NUM:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return True, None
        return (True, float(v)) if _finite(v) else (False, None)
    if kind == _INT:
        return (True, int(v)) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else (False, None)
    if kind == _STR:
        return (True, v[:_MAX_STR]) if isinstance(v, str) else (False, None)
    if kind == _BOOL:
        return (True, v) if isinstance(v, bool) else (False, None)
    if kind == _STRS:
        ok = isinstance(v, list) and len(v) <= _MAX_LIST and all(isinstance(x, str) for x in v)
        return (True, [x[:_MAX_STR] for x in v]) if ok else (False, None)
    if kind == _COUNTS:
        ok = (
            isinstance(v, dict)
            and len(v) <= len(RejectCode)
            and all(
                isinstance(k, str) and isinstance(c, int) and not isinstance(c, bool) and c >= 0 for k, c in v.items()
            )
        )
        if not ok:
            return False, None
        counts: dict[str, int] = {}
        for k, c in v.items():  # keyed by RejectCode name; anything else counts as UNKNOWN
            code = RejectCode.parse(k).value
            counts[code] = counts.get(code, 0) + c
        return True, counts
    raise AssertionError(kind)


def parse_report(raw: str, site_id: str) -> tuple[dict | None, str]:
    """Validate one report sent by ``site_id``.

    Returns:
        ``(report, "")`` with only :data:`REPORT_FIELDS` plus ``seq`` (non-finite
        numbers become None), or ``(None, reason)`` when the report is too big,
        not a JSON object, names another site, lacks ``round``/``seq``, or has a
        field of the wrong type. Unknown fields are dropped silently.
    """
    if len(raw) > MAX_REPORT_BYTES:
        return None, f"report of {len(raw)} bytes > {MAX_REPORT_BYTES}"
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return None, f"report is not JSON: {e}"
    if not isinstance(obj, dict):
        return None, "report is not a JSON object"
    if obj.get("site", site_id) != site_id:
        return None, f"report names site {str(obj.get('site'))[:_MAX_STR]!r}, sent by {site_id!r}"
    seq = obj.get("seq")
    if not (isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1):
        return None, f"report seq must be an int >= 1, got {seq!r}"[:300]
    out: dict[str, Any] = {"seq": seq}
    for key, kind in REPORT_FIELDS.items():
        if key not in obj:
            continue
        ok, val = _clean(kind, obj[key])
        if not ok:
            return None, f"report field {key!r} must be {kind}, got {str(obj[key])[:80]!r}"
        out[key] = val
    if "round" not in out:
        return None, "report has no round"
    out["site"] = site_id
    return out, ""


@dataclass(kw_only=True)
class _SiteTotals:
    last_seq: int = 0
    num_reports: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    stale_buckets: int = 0
    repaired_buckets: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    last: dict | None = None


class StatusLog:
    """Round reports and round plans for the status page (not thread-safe: the
    rendezvous core calls it under its own lock).

    Args:
        num_rounds_kept: rounds of reports and plans kept (older ones dropped).
    """

    def __init__(self, num_rounds_kept: int = 200) -> None:
        if not isinstance(num_rounds_kept, int) or num_rounds_kept < 1:
            raise ValueError(f"num_rounds_kept must be an int >= 1, got {num_rounds_kept!r}")
        self.num_rounds_kept = num_rounds_kept
        self.rounds: dict[int, dict[str, dict]] = {}  # round -> site -> report
        self.plans: dict[int, dict] = {}  # round -> {"members", "formed_at"}
        self.totals: dict[str, _SiteTotals] = {}
        self.num_dropped = 0

    @staticmethod
    def _trim(d: dict, keep: int) -> None:
        """Drop the oldest rounds beyond ``keep``."""
        while len(d) > keep:
            del d[min(d)]

    def add_plan(self, round: int, members: list[str], now: float) -> None:
        self.plans[round] = {"members": list(members), "formed_at": now}
        self._trim(self.plans, self.num_rounds_kept)

    def site_joined(self, site_id: str) -> None:
        """A (re)started site numbers its reports from 1 again."""
        if site_id in self.totals:
            self.totals[site_id].last_seq = 0

    def add_reports(self, site_id: str, raws: list[str]) -> int:
        """Store the valid, new reports of ``site_id``; returns how many were stored.
        Bad or excess reports are counted in ``num_dropped`` and logged; repeats
        (``seq`` not above the last one, e.g. a heartbeat retried) are ignored."""
        stored = 0
        if len(raws) > MAX_REPORTS_PER_HEARTBEAT:
            self.num_dropped += len(raws) - MAX_REPORTS_PER_HEARTBEAT
            log.warning(
                "status: %s sent %d reports in one heartbeat; keeping the first %d",
                site_id,
                len(raws),
                MAX_REPORTS_PER_HEARTBEAT,
            )
            raws = raws[:MAX_REPORTS_PER_HEARTBEAT]
        t = self.totals.setdefault(site_id, _SiteTotals())
        for raw in raws:
            rep, why = parse_report(raw, site_id)
            if rep is None:
                self.num_dropped += 1
                log.warning("status: dropped a round report from %s: %s", site_id, why)
                continue
            if rep["seq"] <= t.last_seq:
                continue
            t.last_seq = rep["seq"]
            t.num_reports += 1
            for k in ("bytes_sent", "bytes_received", "stale_buckets", "repaired_buckets"):
                setattr(t, k, getattr(t, k) + rep.get(k, 0))
            for code, count in rep.get("rejected", {}).items():
                t.rejected[code] = t.rejected.get(code, 0) + count
            t.last = rep
            self.rounds.setdefault(rep["round"], {})[site_id] = rep
            self._trim(self.rounds, self.num_rounds_kept)
            stored += 1
        return stored

    def snapshot(self) -> dict:
        """Copies of the containers (reports themselves are never mutated once stored)."""
        return {
            "rounds": {r: dict(by_site) for r, by_site in self.rounds.items()},
            "plans": {r: dict(p) for r, p in self.plans.items()},
            "totals": {
                s: {
                    "num_reports": t.num_reports,
                    "bytes_sent": t.bytes_sent,
                    "bytes_received": t.bytes_received,
                    "stale_buckets": t.stale_buckets,
                    "repaired_buckets": t.repaired_buckets,
                    "rejected": dict(t.rejected),
                    "last": t.last,
                }
                for s, t in self.totals.items()
            },
            "num_dropped": self.num_dropped,
        }


def decide_site_state(
    site: Mapping[str, Any],
    *,
    now: float,
    config: Mapping[str, float],
    newest_plan: Mapping[str, Any] | None,
    first_ready_at: float | None,
) -> tuple[str, str]:
    """Decide what a site is doing, for the status page.

    Args:
        site: one entry of ``RendezvousCore.snapshot()["sites"]`` (``left``,
            ``last_heartbeat``, ``needs_resync``, ``resync_reason``, ``joined_round``,
            ``last_member_round``, ``ready_since``, ``last_reported_round``, ``inner_step``).
        now: monotonic seconds (the snapshot's clock).
        config: ``heartbeat_interval_s``, ``heartbeat_timeout_s``,
            ``quorum_timeout_s``, ``broadcast_timeout_s``.
        newest_plan: ``{"round", "members", "formed_at"}`` of the newest round, or None.
        first_ready_at: when the first site became ready for the round being formed, or None.
    Returns:
        ``(state, reason)``; state is one of :data:`SITE_STATES`.
    """
    if site.get("left"):
        return "left", "left the group"
    age = now - site["last_heartbeat"]
    timeout, interval = config["heartbeat_timeout_s"], config["heartbeat_interval_s"]
    if age > timeout:
        return "dead", f"no heartbeat for {age:.1f}s (> {timeout:g}s)"
    if site.get("needs_resync"):
        return "joining", f"must pull state: {site.get('resync_reason') or 'declared dead'}"
    joined, member = site.get("joined_round", 0), site.get("last_member_round")
    if joined > 0 and (member is None or member < joined):
        return "joining", f"joined at round {joined}; not in a round since"
    if age > 2 * interval:
        return "late", f"heartbeat {age:.1f}s old (interval {interval:g}s)"
    if site.get("ready_since") is not None:
        return "in round", f"ready, waiting {now - site['ready_since']:.1f}s for a quorum"
    if newest_plan is not None and site["site_id"] in newest_plan["members"]:
        reported = site.get("last_reported_round")
        in_flight = now - newest_plan["formed_at"] <= config["broadcast_timeout_s"] + 2 * interval
        if (reported is None or reported < newest_plan["round"]) and in_flight:
            return "in round", f"round {newest_plan['round']} in progress"
    if first_ready_at is not None and now - first_ready_at > config["quorum_timeout_s"] / 2:
        return (
            "late",
            f"others have waited {now - first_ready_at:.1f}s for it (quorum timeout {config['quorum_timeout_s']:g}s)",
        )
    return "training", f"inner step {site.get('inner_step', 0)}"


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _round_row(r: int, plan: Mapping[str, Any] | None, reports: Mapping[str, dict]) -> dict:
    applied = {s: rep for s, rep in reports.items() if rep.get("status", "applied") == "applied"}
    members = list(plan["members"]) if plan else sorted(applied)

    def vals(key: str) -> list:
        return [rep[key] for rep in applied.values() if rep.get(key) is not None]

    rejected: dict[str, int] = {}
    for rep in applied.values():
        for code, count in rep.get("rejected", {}).items():
            rejected[code] = rejected.get(code, 0) + count
    red, bro, syn = vals("reduce_arrived_fraction"), vals("broadcast_arrived_fraction"), vals("sync_s")
    frag = vals("fragment")
    return {
        "round": r,
        "fragment": frag[0] if frag else None,
        "members": members,
        "num_reported": len(applied),
        "reduce_arrived_fraction_min": min(red) if red else None,
        "broadcast_arrived_fraction_min": min(bro) if bro else None,
        "sync_s_max": max(syn) if syn else None,
        "bytes_sent": sum(vals("bytes_sent")),
        "bytes_received": sum(vals("bytes_received")),
        "stale_buckets": sum(vals("stale_buckets")),
        "repaired_buckets": sum(vals("repaired_buckets")),
        "rejected": rejected,
        "notes": [
            f"{s}: {rep.get('status')} ({rep.get('reason', '')})"
            for s, rep in sorted(reports.items())
            if s not in applied
        ],
        "sites": {s: dict(rep) for s, rep in sorted(reports.items())},
    }


def build_status(snap: Mapping[str, Any], *, num_rounds: int = 20) -> dict:
    """The status document (``/api/status``) from ``RendezvousCore.snapshot()``.

    Returns a JSON-safe dict: ``next_round``, ``config`` (timing), ``sites``
    (sorted by id: state, reason, address, heartbeat age, rounds joined, inner
    step, losses, per-site totals of reported bytes/buckets/rejections),
    ``rounds`` (the newest ``num_rounds`` rounds, newest first, aggregated over
    the members' reports, plus each site's report), ``series`` (per site,
    ``[round, value]`` pairs of validation loss and sync seconds for the charts)
    and ``num_reports_dropped``. No tokens: the snapshot holds none.
    """
    now = snap["now"]
    status_log = snap["status"]
    plans = status_log["plans"]
    newest_plan = None
    if plans:
        r = max(plans)
        newest_plan = {"round": r, **plans[r]}
    sites = []
    for sid, s in sorted(snap["sites"].items()):
        tot = status_log["totals"].get(sid, {})
        last = tot.get("last") or {}
        state, reason = decide_site_state(
            {**s, "site_id": sid, "last_reported_round": last.get("round")},
            now=now,
            config=snap["config"],
            newest_plan=newest_plan,
            first_ready_at=snap.get("first_ready_at"),
        )
        sites.append(
            {
                "site_id": sid,
                "state": state,
                "state_reason": reason,
                "address": s["address"],
                "heartbeat_age_s": now - s["last_heartbeat"],
                # the accrual detector's suspicion (None: a fixed timeout), and the silence it allows
                "phi": s.get("phi"),
                "dead_after_s": s.get("dead_after_s"),
                "rounds_joined": s["rounds_joined"],
                "inner_step": s["inner_step"],
                "train_loss": s["last_loss"],
                "val_loss": last.get("val_loss"),
                "last_reported_round": last.get("round"),
                "last_sync_s": last.get("sync_s"),
                "round_steps": last.get("round_steps"),
                "tokens_per_s": last.get("tokens_per_s"),
                "weight": last.get("tokens"),
                "last_status": last.get("status"),
                "reduce_arrived_fraction": last.get("reduce_arrived_fraction"),
                "broadcast_arrived_fraction": last.get("broadcast_arrived_fraction"),
                "num_reports": tot.get("num_reports", 0),
                "bytes_sent_total": tot.get("bytes_sent", 0),
                "bytes_received_total": tot.get("bytes_received", 0),
                "stale_buckets_total": tot.get("stale_buckets", 0),
                "repaired_buckets_total": tot.get("repaired_buckets", 0),
                "rejected_total": tot.get("rejected", {}),
            }
        )
    all_rounds = sorted(set(status_log["rounds"]) | set(plans), reverse=True)
    rows = [_round_row(r, plans.get(r), status_log["rounds"].get(r, {})) for r in all_rounds[:num_rounds]]
    series: dict[str, dict[str, list]] = {}
    for r in sorted(status_log["rounds"]):
        for sid, rep in status_log["rounds"][r].items():
            ser = series.setdefault(sid, {"val_loss": [], "sync_s": []})
            if rep.get("val_loss") is not None:
                ser["val_loss"].append([r, rep["val_loss"]])
            if rep.get("sync_s") is not None and rep.get("status", "applied") == "applied":
                ser["sync_s"].append([r, rep["sync_s"]])
    counts = {st: 0 for st in SITE_STATES}
    for s in sites:
        counts[s["state"]] += 1
    return _json_safe(
        {
            "next_round": snap["next_round"],
            "config": dict(snap["config"]),
            "site_counts": counts,
            "sites": sites,
            "rounds": rows,
            "series": dict(sorted(series.items())),
            "num_reports_dropped": status_log["num_dropped"],
        }
    )
