"""``dtrain launch``'s plain progress lines (stderr not a terminal), from metrics files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.app.launch import _finish, _PlainProgress, _SiteView
from dtrain.metrics import RoundLine, StartLine, write_line

pytestmark = pytest.mark.timeout(30)


def _append(path: Path, *lines) -> None:
    with open(path, "a") as f:
        for ln in lines:
            write_line(f, ln)


def _round(site: str, r: int, *, val: float, sync: float, sent: int, members=("a", "b")) -> RoundLine:
    return RoundLine(site=site, round=r, members=list(members), val_loss=val, sync_s=sync, bytes_sent=sent, round_s=0.1)


def test_one_line_per_round_once_every_running_site_wrote_it(tmp_path):
    views = [_SiteView(s, tmp_path / f"{s}.jsonl") for s in ("a", "b")]
    out: list[str] = []
    prog = _PlainProgress(3, out.append)
    for v in views:
        _append(v.tail.path, StartLine(site=v.site))
    _append(views[0].tail.path, _round("a", 0, val=3.0, sync=0.2, sent=2_000_000))

    def step() -> None:
        for v in views:
            v.poll()
        prog.update(views)

    step()
    assert out == []  # b has not finished round 0
    _append(views[1].tail.path, _round("b", 0, val=3.5, sync=0.4, sent=1_000_000))
    _append(views[0].tail.path, _round("a", 1, val=2.0, sync=0.1, sent=500_000))
    step()
    assert out == [
        "round 0 (1/3): members 2, val_loss 3.000-3.500, bytes_sent 3.00 MB (3.00 MB so far), sync_s 0.20-0.40"
    ]
    # b skips round 1 (resynced lines carry no bytes) and writes round 2; a writes round 2
    _append(views[1].tail.path, RoundLine(site="b", round=1, status="resynced", sync_s=1.0, val_loss=2.5))
    _append(views[1].tail.path, _round("b", 2, val=1.5, sync=0.3, sent=0, members=("a", "b")))
    _append(views[0].tail.path, _round("a", 2, val=1.5, sync=0.3, sent=1_000_000))
    step()
    assert out[1:] == [
        "round 1 (2/3): members 2, val_loss 2.000-2.500, bytes_sent 0.50 MB (3.50 MB so far), sync_s 0.10-1.00",
        "round 2 (3/3): members 2, val_loss 1.500, bytes_sent 1.00 MB (4.50 MB so far), sync_s 0.30",
    ]
    step()
    assert len(out) == 3  # nothing is printed twice


def test_the_verdict_of_a_launch_where_no_site_finished_says_so(tmp_path, capsys) -> None:
    for i in range(2):
        (tmp_path / f"site-{i}").mkdir()
    assert _finish(tmp_path, 2, {}, 0) == 1
    out = capsys.readouterr().out
    assert "no site finished; run dir:" in out and "distinct" not in out


def test_a_site_started_twice_is_named_and_the_runs_first_loss_is_its_first_start(tmp_path, capsys) -> None:
    d = tmp_path / "site-0"
    d.mkdir()
    lines = [
        {"event": "start", "site": "site-0", "round": 0, "val_loss": 5.5},
        {"event": "start", "site": "site-0", "round": 3, "val_loss": 2.5},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    _finish(tmp_path, 1, {}, 0)
    out = capsys.readouterr().out
    assert "site-0 started 2 times (restarted by --max-restarts, or resumed); its last start joined at round 3" in out


def test_an_interrupted_launch_says_the_sites_stopped_at_their_own_rounds(tmp_path, capsys) -> None:
    for i, (rounds, checksum) in enumerate(((4, "aaaa"), (3, "bbbb"))):
        d = tmp_path / f"site-{i}"
        d.mkdir()
        summary = {"site": f"site-{i}", "rounds": rounds, "checksum": checksum, "interrupted": True}
        summary.update(first_val_loss=5.0, final_val_loss=3.0, wall_s=1.0, sync_share=0.1)
        (d / "summary.json").write_text(json.dumps(summary))
    _finish(tmp_path, 2, {}, 130)
    out = capsys.readouterr().out
    assert "interrupted: the sites stopped at their own rounds (site-0 after round 3, site-1 after round 2)" in out
    assert "DIFFER" not in out


def test_a_restarted_site_is_announced_when_its_second_start_line_appears(tmp_path) -> None:
    """A site group restarted by --max-restarts is said while the run goes on (it was only
    in the final summary; the live view showed one member fewer for 13 rounds)."""
    v = _SiteView("site-1", tmp_path / "site-1.jsonl")
    _append(v.tail.path, StartLine(site="site-1", round=0), _round("site-1", 0, val=3.0, sync=0.1, sent=1))
    v.poll()
    assert v.restarts_to_tell() == []  # the first start is not news
    _append(v.tail.path, StartLine(site="site-1", round=7))
    v.poll()
    assert v.restarts_to_tell() == ["site-1 started again (start 2, at round 7: restarted by --max-restarts)"]
    v.poll()
    assert v.restarts_to_tell() == []  # said once
