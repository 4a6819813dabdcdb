"""Round reports, site states and the status document (dtrain/status.py) and the
rendezvous core's part in them (issue 8). No sockets."""

from __future__ import annotations

import json

import pytest

from dtrain.errors import RejectCode
from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.status import (
    MAX_REPORT_BYTES,
    MAX_REPORTS_PER_HEARTBEAT,
    REPORT_FIELDS,
    StatusLog,
    build_status,
    decide_site_state,
    parse_report,
    round_report,
)

CFG = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0, "quorum_timeout_s": 4.0, "broadcast_timeout_s": 20.0}

LINE = {  # a worker metrics line (docs/METRICS.md), abridged
    "site": "a",
    "event": "round",
    "round": 3,
    "status": "applied",
    "reason": "all 2 live sites are ready",
    "members": ["a", "b"],
    "val_loss": 3.25,
    "train_loss": float("nan"),
    "inner_steps": 40,
    "inner_s": 1.0,
    "sync_s": 0.5,
    "checksum": "abc",
    "reduce_arrived_fraction": 1.0,
    "broadcast_arrived_fraction": 0.5,
    "included_fraction": 1.0,
    "bytes_sent": 1000,
    "bytes_received": 900,
    "stale_buckets": 1,
    "repaired_buckets": 1,
    "skipped_buckets": 0,
    "contributed": True,
    "rejected": {"FAILED_PRECONDITION": 2},
    "errors": ["x", "y"],
    "time": 1.0e9,
}


def _raw(seq: int, **kw) -> str:
    return json.dumps({**round_report(LINE), "seq": seq, **kw})


def test_round_report_keeps_only_known_fields_and_counts_errors() -> None:
    rep = round_report(LINE)
    assert set(rep) <= set(REPORT_FIELDS)
    assert "checksum" not in rep and "errors" not in rep and "inner_s" not in rep
    assert rep["num_errors"] == 2 and rep["rejected"] == {"FAILED_PRECONDITION": 2} and rep["bytes_sent"] == 1000


def test_parse_report_cleans_and_validates() -> None:
    rep, why = parse_report(_raw(1, token="secret", extra="x" * 50), "a")
    assert why == "" and rep is not None
    assert "token" not in rep and "extra" not in rep
    assert rep["train_loss"] is None  # NaN is not JSON for browsers
    assert rep["seq"] == 1 and rep["round"] == 3 and rep["site"] == "a"
    assert parse_report(_raw(1), "b")[1].startswith("report names site 'a'")
    assert "seq" in parse_report(_raw(0), "a")[1]
    assert "'bytes_sent' must be int" in parse_report(_raw(1, bytes_sent=-1), "a")[1]
    assert "'members' must be strs" in parse_report(_raw(1, members=[1]), "a")[1]
    assert "not JSON" in parse_report("{", "a")[1]
    assert "not a JSON object" in parse_report("[1]", "a")[1]
    assert "bytes >" in parse_report(" " * (MAX_REPORT_BYTES + 1), "a")[1]
    long_reason = parse_report(_raw(1, reason="r" * 1000), "a")[0]["reason"]
    assert len(long_reason) == 200


def test_rejections_are_kept_by_code_only() -> None:
    """Reports count rejections by RejectCode name; any other key (an old worker's reason
    text, naming round and sender) is counted as UNKNOWN, so the keys stay a bounded set."""
    rejected = {"INVALID_ARGUMENT": 3, "round 7 bucket 2 from mallory: late": 1, "bad": 2, "NOT_FOUND": 0}
    rep, why = parse_report(_raw(1, rejected=rejected), "a")
    assert why == "" and rep["rejected"] == {"INVALID_ARGUMENT": 3, "UNKNOWN": 3, "NOT_FOUND": 0}
    too_many = {f"reason {i}": 1 for i in range(len(RejectCode) + 1)}
    assert "'rejected' must be counts" in parse_report(_raw(1, rejected=too_many), "a")[1]


def test_status_log_dedupes_by_seq_sums_totals_and_keeps_n_rounds() -> None:
    log = StatusLog(num_rounds_kept=3)
    assert log.add_reports("a", [_raw(1, round=0), _raw(2, round=1)]) == 2
    assert log.add_reports("a", [_raw(2, round=1)]) == 0  # a retried heartbeat
    assert log.add_reports("a", ["junk", _raw(3, round=2, site="zz")]) == 0
    assert log.num_dropped == 2
    assert log.add_reports("a", [_raw(4, round=3), _raw(4, round=9), _raw(5, round=4)]) == 2  # seq 4 twice: once
    snap = log.snapshot()
    assert sorted(snap["rounds"]) == [1, 3, 4]  # 4 rounds reported, the oldest (0) trimmed
    t = snap["totals"]["a"]
    assert t["num_reports"] == 4 and t["bytes_sent"] == 4000 and t["rejected"] == {"FAILED_PRECONDITION": 8}
    assert t["last"]["round"] == 4
    log.site_joined("a")  # a restarted site numbers from 1 again
    assert log.add_reports("a", [_raw(1, round=5)]) == 1
    too_many = [_raw(10 + i, round=6) for i in range(MAX_REPORTS_PER_HEARTBEAT + 2)]
    log.add_reports("a", too_many)
    assert log.num_dropped == 4


def _site(**kw) -> dict:
    base = {
        "site_id": "a",
        "last_heartbeat": 100.0,
        "needs_resync": False,
        "joined_round": 0,
        "last_member_round": None,
        "ready_since": None,
        "last_reported_round": None,
        "inner_step": 7,
        "left": False,
    }
    return {**base, **kw}


@pytest.mark.parametrize(
    "site, now, plan, first_ready, state",
    [
        (_site(), 100.5, None, None, "training"),
        (_site(), 105.1, None, None, "dead"),
        (_site(left=True), 200.0, None, None, "left"),
        (_site(needs_resync=True), 100.5, None, None, "joining"),
        (_site(joined_round=4, last_member_round=2), 100.5, None, None, "joining"),
        (_site(joined_round=4, last_member_round=4, last_reported_round=4), 100.5, None, None, "training"),
        (_site(), 102.5, None, None, "late"),
        (_site(ready_since=100.0), 100.5, None, None, "in round"),
        (_site(last_reported_round=2), 100.5, {"round": 3, "members": ["a"], "formed_at": 100.0}, None, "in round"),
        (_site(last_reported_round=3), 100.5, {"round": 3, "members": ["a"], "formed_at": 100.0}, None, "training"),
        (_site(last_reported_round=2), 100.5, {"round": 3, "members": ["b"], "formed_at": 100.0}, None, "training"),
        (_site(), 100.5, None, 97.0, "late"),  # others ready 3.5 s > quorum timeout / 2
        (_site(), 100.5, None, 99.0, "training"),
    ],
)
def test_decide_site_state(site, now, plan, first_ready, state) -> None:
    got, reason = decide_site_state(site, now=now, config=CFG, newest_plan=plan, first_ready_at=first_ready)
    assert got == state, reason
    assert reason


def test_core_keeps_reports_plans_and_departed_sites_in_its_snapshot() -> None:
    core = RendezvousCore(RendezvousConfig(heartbeat_timeout_s=5.0, initial_sites=2), reports=StatusLog())
    core.join("a", "h:1", now=0.0)
    core.join("b", "h:2", now=0.0)
    core.ready("a", 0, now=0.1)
    assert core.ready("b", 0, now=0.2).status == "plan"
    rep_a = json.dumps({**round_report({**LINE, "round": 0}), "seq": 1})
    rep_b = json.dumps(
        {**round_report({**LINE, "site": "b", "round": 0, "sync_s": 0.7, "reduce_arrived_fraction": 0.5}), "seq": 1}
    )
    core.heartbeat("a", now=0.5, inner_step=10, last_loss=4.0, round_reports=[rep_a])
    core.heartbeat("b", now=0.5, inner_step=10, round_reports=[rep_b, "not json"])
    core.ready("a", 1, now=0.6)  # a waits for round 1
    core.leave("b", now=0.7)
    status = build_status(core.snapshot(now=1.0))
    json.dumps(status, allow_nan=False)  # valid JSON for a browser
    assert status["next_round"] == 1 and status["num_reports_dropped"] == 1
    sites = {s["site_id"]: s for s in status["sites"]}
    assert sites["a"]["state"] == "in round" and sites["b"]["state"] == "left"
    assert sites["a"]["rounds_joined"] == 1 and sites["a"]["inner_step"] == 10 and sites["a"]["train_loss"] == 4.0
    assert sites["a"]["val_loss"] == 3.25 and sites["a"]["bytes_sent_total"] == 1000
    (row,) = status["rounds"]
    assert row["round"] == 0 and row["members"] == ["a", "b"] and row["num_reported"] == 2
    assert row["sync_s_max"] == 0.7 and row["reduce_arrived_fraction_min"] == 0.5
    assert row["bytes_sent"] == 2000 and row["rejected"] == {"FAILED_PRECONDITION": 4} and row["repaired_buckets"] == 2
    assert status["series"]["a"] == {"val_loss": [[0, 3.25]], "sync_s": [[0, 0.5]]}
    # a site that re-joins after leaving keeps its round count and is "joining" until admitted again
    core.join("b", "h:2", now=2.0)
    sites = {s["site_id"]: s for s in build_status(core.snapshot(now=2.1))["sites"]}
    assert sites["b"]["state"] == "joining" and sites["b"]["rounds_joined"] == 1
    # an unknown site's reports are ignored (it must join and resend)
    core.heartbeat("zz", now=2.2, round_reports=[json.dumps({"round": 0, "seq": 1})])
    assert "zz" not in core.snapshot(now=2.3)["status"]["totals"]


def test_resynced_reports_are_notes_not_round_aggregates() -> None:
    log = StatusLog()
    log.add_plan(5, ["a", "b"], now=0.0)
    log.add_reports("a", [_raw(1, round=5)])
    log.add_reports(
        "c",
        [
            json.dumps(
                {
                    **round_report({**LINE, "site": "c"}),
                    "round": 5,
                    "seq": 1,
                    "status": "resynced",
                    "reason": "round 5 started without c (straggler)",
                }
            )
        ],
    )
    snap = {"now": 1.0, "next_round": 6, "config": CFG, "sites": {}, "status": log.snapshot()}
    (row,) = build_status(snap)["rounds"]
    assert row["num_reported"] == 1 and row["bytes_sent"] == 1000
    assert row["notes"] == ["c: resynced (round 5 started without c (straggler))"]


def _joined_group():
    """A rendezvous core with a status log, its in-process client and site "a"'s joined Group
    (a heartbeat every 5 s unless kicked)."""
    from types import SimpleNamespace

    from dtrain.membership import Group
    from dtrain.rendezvous import InprocRendezvousClient

    core = RendezvousCore(RendezvousConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=10.0), reports=StatusLog())
    client = InprocRendezvousClient(core)
    engine = SimpleNamespace(site_id="a", address="h:1", state=SimpleNamespace(rounds_applied=0))
    group = Group(engine, client)  # type: ignore[arg-type]
    group.join()
    return core, client, group


@pytest.mark.timeout(30)
def test_group_sends_round_reports_on_the_heartbeat_at_once_and_retries_when_unreachable() -> None:
    import time

    core, client, group = _joined_group()
    try:

        def reports() -> int:
            return core.snapshot(now=time.monotonic())["status"]["totals"].get("a", {}).get("num_reports", 0)

        client.down = True
        group.report_round(round_report({**LINE, "round": 0}))  # the kick fails: kept for later
        time.sleep(0.3)
        assert reports() == 0 and len(group._reports) == 1
        client.down = False
        group.report_round(round_report({**LINE, "round": 1}))  # well before the 5 s heartbeat interval
        deadline = time.monotonic() + 3.0
        while reports() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reports() == 2 and len(group._reports) == 0
        assert sorted(core.snapshot(now=time.monotonic())["status"]["rounds"]) == [0, 1]
    finally:
        group.leave()


@pytest.mark.timeout(30)
def test_a_join_probe_report_reaches_the_deadlines_and_leaves_the_round_reports_numbered_from_1() -> None:
    """The status page finds a report's metrics line by its seq (1 = the first line): a join
    probe sent first must not take seq 1 (a CI run's status page test read past the end)."""
    import time

    core, client, group = _joined_group()
    try:
        group.report_probe({"probe": True, "reduce_s": 30.0, "means_s": 60.0, "why": "test"})
        assert group.beat_and_wait(3.0)
        group.report_round(round_report({**LINE, "round": 0}))
        deadline = time.monotonic() + 3.0
        while not core.snapshot(now=time.monotonic())["status"]["rounds"] and time.monotonic() < deadline:
            time.sleep(0.02)
        (rep,) = core.snapshot(now=time.monotonic())["status"]["rounds"][0].values()
        assert rep["seq"] == 1
        assert core.deadlines.reduce_timeout_s == pytest.approx(30.0 * 1.5 + 5.0)
    finally:
        group.leave()


def test_package_reexports_every_model_name() -> None:
    """dtrain.status lists its public names once (model.__all__); each must be imported there too."""
    import dtrain.status
    from dtrain.status import model

    assert dtrain.status.__all__ is model.__all__
    missing = [name for name in model.__all__ if getattr(dtrain.status, name, None) is not getattr(model, name)]
    assert missing == [], f"dtrain/status/__init__.py does not import {missing} from dtrain.status.model"


def test_a_fragment_round_says_its_fragment_in_the_rounds_table() -> None:
    from dtrain.status.page import render_fragment

    log = StatusLog()
    log.add_plan(5, ["a", "b"], now=0.0)
    log.add_plan(6, ["a", "b"], now=0.0)
    log.add_reports("a", [_raw(1, round=5, fragment=0), _raw(2, round=6)])
    snap = {"now": 1.0, "next_round": 7, "config": {**CFG, "min_sites": 1}, "sites": {}, "status": log.snapshot()}
    status = build_status(snap)
    assert [(row["round"], row["fragment"]) for row in status["rounds"]] == [(6, None), (5, 0)]
    html = render_fragment(status)
    assert '<tr data-round="5"><td>5 <span class="frag">(fragment 0)</span></td>' in html
    assert '<tr data-round="6"><td>6</td>' in html
    assert "'fragment' must be int" in parse_report(_raw(3, fragment=-1), "a")[1]


def test_sites_table_shows_steps_per_round_tokens_per_s_and_weight() -> None:
    """Issue 34: each site's steps per round, tokens/s and weight (its claim) from its last report."""
    from dtrain.status.page import render_fragment

    core = RendezvousCore(RendezvousConfig(heartbeat_timeout_s=5.0, initial_sites=1), reports=StatusLog())
    core.join("a", "h:1", now=0.0)
    rep = {**round_report({**LINE, "round": 0, "round_steps": 37, "tokens_per_s": 1234.4, "tokens": 37}), "seq": 1}
    core.heartbeat("a", now=0.5, inner_step=37, round_reports=[json.dumps(rep)])
    status = build_status(core.snapshot(now=1.0))
    (a,) = status["sites"]
    assert (a["round_steps"], a["tokens_per_s"], a["weight"]) == (37, 1234.4, 37)
    assert "<td>37</td><td>1234</td><td>37</td>" in render_fragment(status)
