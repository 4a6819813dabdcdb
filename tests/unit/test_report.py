"""`dtrain report`: plots and markdown summary from a synthetic run directory (docs/METRICS.md)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from dtrain.app.report import REPORT_FILES, make_report, summarize_run

pytestmark = pytest.mark.timeout(60)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SITES = ("site-a", "site-b", "site-c")
NUM_ROUNDS = 5
CHECKSUM = "0123456789abcdef"


def _val_loss(site_index: int, r: int) -> float:
    """Distinct, falling losses per site: start (r = -1) at 5.5 + 0.1 * i."""
    return round(5.5 + 0.1 * site_index - 0.25 * (r + 1) - 0.01 * site_index * (r + 1), 6)


def _round_line(site: str, i: int, r: int, *, members=SITES, checksum=CHECKSUM, rejected=None) -> dict:
    return {
        "site": site,
        "event": "round",
        "round": r,
        "status": "applied",
        "reason": "quorum",
        "members": list(members),
        "val_loss": _val_loss(i, r),
        "train_loss": _val_loss(i, r) + 0.05,
        "inner_steps": 10 * (r + 1),
        "inner_s": 1.0,
        "sync_s": 0.5 + 0.1 * r,
        "wall_s": 1.6 * (r + 1) + 0.1 * i,
        "time": 1.7e9 + r,
        "checksum": checksum,
        "owned_buckets": 2,
        "applied_buckets": 6,
        "stale_buckets": 0,
        "repaired_buckets": 0,
        "skipped_buckets": 0,
        "contributed": True,
        "reduce_arrived_fraction": 1.0,
        "broadcast_arrived_fraction": 1.0,
        "included_fraction": 1.0,
        "bytes_sent": 1000 * (i + 1),
        "bytes_received": 2000,
        "encode_s": 0.05,
        "decode_s": 0.04,
        "network_s": 0.3,
        "wait_s": 0.11 + 0.1 * r,
        "total_s": 0.5 + 0.1 * r,
        "rejected": rejected or {},
        "errors": [],
    }


def _write_run(run_dir: Path, *, checksums=None, faulty_round=None, rejected_at=None, extra_lines=None) -> Path:
    """3 sites x NUM_ROUNDS rounds. ``faulty_round``: site-c is absent from that round (members a, b)."""
    checksums = checksums or {}
    for i, site in enumerate(SITES):
        d = run_dir / site
        d.mkdir(parents=True)
        lines = [
            {
                "site": site,
                "event": "start",
                "round": 0,
                "val_loss": _val_loss(i, -1),
                "wall_s": 0,
                "params": 1234,
                "time": 1.7e9,
            }
        ]
        for r in range(NUM_ROUNDS):
            members = SITES
            if r == faulty_round:
                if site == "site-c":
                    continue
                members = ("site-a", "site-b")
            cs = checksums.get(site, CHECKSUM) if r == NUM_ROUNDS - 1 else CHECKSUM
            rej = rejected_at.get((site, r)) if rejected_at else None
            lines.append(_round_line(site, i, r, members=members, checksum=cs, rejected=rej))
        text = "".join(json.dumps(ln) + "\n" for ln in lines)
        if extra_lines and site in extra_lines:
            text += extra_lines[site]
        (d / "metrics.jsonl").write_text(text)
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "site": site,
                    "rounds": NUM_ROUNDS,
                    "first_val_loss": _val_loss(i, -1),
                    "final_val_loss": _val_loss(i, NUM_ROUNDS - 1),
                    "final_train_loss": 1.0,
                    "checksum": checksums.get(site, CHECKSUM),
                    "wall_s": 10.0,
                    "sync_share": 0.25 + 0.01 * i,
                    "bytes_sent": 5000,
                    "bytes_received": 10000,
                    "rounds_joined": NUM_ROUNDS,
                    "fp32_bytes_per_round": 4000,
                    "compression_ratio": 4.0,
                    "interrupted": False,
                }
            )
        )
    return run_dir


def test_report_writes_pngs_and_summary(tmp_path):
    run = _write_run(tmp_path / "run")
    written = make_report(run)
    assert [p.name for p in written] == list(REPORT_FILES)
    for p in written[:4]:
        data = p.read_bytes()
        assert data[:8] == PNG_SIGNATURE, p
        assert len(data) > 5_000, (p, len(data))
        assert not p.with_name(p.name + ".tmp").exists()
    md = (run / "report.md").read_text()
    for i, site in enumerate(SITES):
        assert f"| {site} |" in md
        assert f"{_val_loss(i, NUM_ROUNDS - 1):.4f}" in md  # final loss
        assert f"{_val_loss(i, -1):.4f}" in md  # first loss
        assert f"{25 + i:.1f} %" in md  # sync share from summary.json
    assert "**all agree**" in md and "DISAGREE" not in md
    assert "- sites: **3**" in md and "- rounds: **5**" in md
    assert "Every round's quorum held all 3 sites." in md
    for name in REPORT_FILES[:4]:
        assert f"]({name})" in md


def test_summarize_run_values(tmp_path):
    run = _write_run(tmp_path / "run")
    s = summarize_run(run)
    assert s["num_sites"] == 3 and s["num_rounds"] == NUM_ROUNDS and s["checksums_agree"] is True
    b = s["sites"]["site-b"]
    assert b["final_val_loss"] == pytest.approx(_val_loss(1, NUM_ROUNDS - 1))
    assert b["first_val_loss"] == pytest.approx(_val_loss(1, -1))
    assert b["rounds_applied"] == NUM_ROUNDS and b["final_round"] == NUM_ROUNDS - 1
    assert b["bytes_sent"] == 2000 * NUM_ROUNDS and b["bytes_received"] == 2000 * NUM_ROUNDS
    assert b["mean_sync_s"] == pytest.approx(0.5 + 0.1 * 2)
    assert b["sync_share"] == pytest.approx(0.26)
    assert b["checksum"] == CHECKSUM and b["finished"] is True
    assert s["faults"] == [] and s["num_rejected"] == 0
    json.dumps(s)  # usable by the launcher as-is


def test_disagreeing_checksum_is_reported(tmp_path):
    run = _write_run(tmp_path / "run", checksums={"site-b": "ffffffffffffffff"})
    assert summarize_run(run)["checksums_agree"] is False
    make_report(run)
    md = (run / "report.md").read_text()
    assert "DISAGREE" in md and "all agree" not in md
    assert "`ffffffffffffffff`" in md


def test_faults_and_rejections_are_reported(tmp_path):
    rejected_at = {("site-a", 1): {"stale_round": 2}, ("site-b", 3): {"stale_round": 1, "bad_checksum": 1}}
    run = _write_run(tmp_path / "run", faulty_round=2, rejected_at=rejected_at)
    s = summarize_run(run)
    assert [f["round"] for f in s["faults"]] == [2]
    assert s["faults"][0]["missing"] == ["site-c"] and s["faults"][0]["members"] == ["site-a", "site-b"]
    assert s["rejected"] == {"stale_round": 3, "bad_checksum": 1} and s["num_rejected"] == 4
    assert s["sites"]["site-c"]["rounds_applied"] == NUM_ROUNDS - 1
    make_report(run)
    md = (run / "report.md").read_text()
    assert "1 round(s) ran with fewer than 3 sites" in md
    assert "- round 2: members site-a, site-b; missing site-c" in md
    assert "4 contribution(s) rejected" in md
    assert "- stale_round: 3" in md and "- bad_checksum: 1" in md


def test_malformed_lines_are_skipped_with_warning(tmp_path, caplog):
    bad = '{"site": "site-a", "event": "round", "round": 5, "val_lo\n[1, 2]\n{"event": "round", "round": "x"}\n\n'
    run = _write_run(tmp_path / "run", extra_lines={"site-a": bad})
    with caplog.at_level(logging.WARNING, logger="dtrain"):  # the report and the metrics reader both warn
        written = make_report(run)
    assert len(written) == 5
    path = str(run / "site-a" / "metrics.jsonl")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # lines 1 (start) + 5 rounds are valid; the bad ones are lines 7, 8, 9 (line 10 is blank: ignored)
    assert [m.split(": ")[0] for m in warned] == [f"{path}:7", f"{path}:8", f"{path}:9"]
    s = summarize_run(run)
    assert s["sites"]["site-a"]["final_round"] == NUM_ROUNDS - 1
    assert s["sites"]["site-a"]["final_val_loss"] == pytest.approx(_val_loss(0, NUM_ROUNDS - 1))


def test_deferred_and_resumed_lines(tmp_path):
    """A deferred attempt does not count as a round; a resume's repeated round replaces the earlier line."""
    run = _write_run(tmp_path / "run")
    f = run / "site-a" / "metrics.jsonl"
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    deferred = {
        "site": "site-a",
        "event": "round",
        "round": 4,
        "status": "deferred",
        "reason": "unreachable",
        "members": [],
        "val_loss": 9.9,
        "wall_s": 20.0,
        "checksum": CHECKSUM,
    }
    restart = {"site": "site-a", "event": "start", "round": 4, "val_loss": 3.0, "wall_s": 0, "params": 1, "time": 0}
    redo = dict(lines[-1], val_loss=2.5, wall_s=1.0)
    f.write_text("".join(json.dumps(x) + "\n" for x in [*lines, deferred, restart, redo]))
    a = summarize_run(run)["sites"]["site-a"]
    assert a["rounds_deferred"] == 1 and a["resumes"] == 1
    assert a["final_val_loss"] == 2.5 and a["rounds_applied"] == NUM_ROUNDS
    assert a["wall_s"] == pytest.approx(lines[-1]["wall_s"] + 1.0)  # offset by the wall time before the resume


def test_empty_dir_raises_naming_it(tmp_path):
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    (empty / "site-a").mkdir()
    with pytest.raises(ValueError, match="nothing-here") as e:
        make_report(empty)
    assert "no metrics" in str(e.value)
    (empty / "site-a" / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="no metrics"):
        summarize_run(empty)
    with pytest.raises(ValueError, match="does not exist"):
        make_report(tmp_path / "missing")
    assert not list(empty.glob("*.png"))


def test_missing_summary_and_nan_loss(tmp_path):
    """A site that crashed (no summary.json) and a NaN loss still give a report."""
    run = _write_run(tmp_path / "run")
    (run / "site-c" / "summary.json").unlink()
    f = run / "site-b" / "metrics.jsonl"
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    lines[-1]["val_loss"] = float("nan")
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    make_report(run)
    s = summarize_run(run)
    assert s["sites"]["site-c"]["sync_share"] is None and s["sites"]["site-c"]["finished"] is False
    assert math.isnan(s["sites"]["site-b"]["final_val_loss"])
    md = (run / "report.md").read_text()
    assert "site-c: no summary.json" in md


def test_end_lines_count_in_the_bytes_and_quorum_round_means(tmp_path):
    """bytes_sent/received add the end line (means served after the last round), so they equal
    summary.json's; the table shows the means of sync_s, quorum_s and round_s over the lines."""
    end = {"event": "end", "version": 2, "site": "site-a", "round": NUM_ROUNDS, "bytes_sent": 777, "bytes_received": 0}
    run = _write_run(tmp_path / "run", extra_lines={"site-a": json.dumps(end) + "\n"})
    a = summarize_run(run)["sites"]["site-a"]
    assert a["bytes_sent"] == 1000 * NUM_ROUNDS + 777 and a["bytes_received"] == 2000 * NUM_ROUNDS
    assert a["mean_round_s"] == pytest.approx(0.5 + 0.1 * 2)  # version-1 lines: total_s read as round_s
    assert math.isnan(a["mean_quorum_s"])  # version 1 had no quorum_s
    make_report(run)
    md = (run / "report.md").read_text()
    assert "| mean sync_s | mean quorum_s | mean round_s |" in md and f"{1000 * NUM_ROUNDS + 777:,}" in md


def test_unknown_metrics_version_is_refused_naming_the_file(tmp_path):
    from dtrain.metrics import MetricsVersionError

    future = {"event": "round", "version": 9, "site": "site-b", "round": NUM_ROUNDS}
    run = _write_run(tmp_path / "run", extra_lines={"site-b": json.dumps(future) + "\n"})
    with pytest.raises(MetricsVersionError, match=r"site-b/metrics\.jsonl:7: metrics version 9"):
        make_report(run)


def test_fragment_rounds_are_reported(tmp_path):
    """Streaming DiLoCo: each round line names its fragment (round r syncs (r + 1) mod 2); the
    summary lists the rounds of each fragment, the report says so and tags a faulty round."""
    run = _write_run(tmp_path / "run", faulty_round=2)
    for site in SITES:
        p = run / site / "metrics.jsonl"
        lines = [json.loads(ln) for ln in p.read_text().splitlines()]
        for ln in lines:
            if ln["event"] == "round":
                ln["fragment"] = (ln["round"] + 1) % 2
        p.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    s = summarize_run(run)
    odd, even = list(range(0, NUM_ROUNDS, 2)), list(range(1, NUM_ROUNDS, 2))
    assert s["fragment_rounds"] == {"0": even, "1": odd}
    assert s["faults"][0]["fragment"] == 1
    make_report(run)
    md = (run / "report.md").read_text()
    assert f"fragment 0: rounds {', '.join(map(str, even))}; fragment 1: rounds {', '.join(map(str, odd))}" in md
    assert "- round 2 (fragment 1): members site-a, site-b; missing site-c" in md
    assert summarize_run(_write_run(tmp_path / "plain"))["fragment_rounds"] == {}


def test_a_dead_sites_older_checksum_does_not_make_the_finished_sites_disagree(tmp_path):
    """site-c died (no summary.json) with the checksum of an earlier round: the sites that
    finished agree, and the report says which site did not finish (the launch summary did;
    the report said DISAGREE)."""
    run = _write_run(tmp_path / "run", checksums={"site-c": "dead0000dead0000"})
    (run / "site-c" / "summary.json").unlink()
    s = summarize_run(run)
    assert s["checksums_agree"] is True and s["unfinished"] == ["site-c"]
    make_report(run)
    md = (run / "report.md").read_text()
    assert "**all agree** (over the sites that finished; site-c did not)" in md
    (run / "site-b" / "summary.json").unlink()
    (run / "site-a" / "summary.json").unlink()
    assert summarize_run(run)["checksums_agree"] is False  # none finished: every site counts
    make_report(run)  # an interrupted run: the verdict says what it is over, without contradiction
    assert (
        "**DISAGREE** (sites ended with different θ) (no site finished: over every site's last round"
        in (run / "report.md").read_text()
    )
