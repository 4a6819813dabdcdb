"""The metrics schema and its one reader (dtrain.metrics, docs/METRICS.md)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from dtrain.metrics import (
    ENGINE_FIELDS,
    METRICS_VERSION,
    EndLine,
    MetricsError,
    MetricsTail,
    MetricsVersionError,
    RoundLine,
    StartLine,
    Summary,
    Totals,
    engine_fields,
    parse_line,
    read_metrics,
    read_summary,
    write_line,
)
from dtrain.rounds import RoundResult

pytestmark = pytest.mark.timeout(30)


def _result(**kw) -> RoundResult:
    base = dict(round=4, members=("a", "b"), owned_buckets=2, bytes_sent=1000, bytes_received=700, total_s=0.25)
    return RoundResult(**{**base, **kw})


def _round(**kw) -> RoundLine:
    res = _result()
    return RoundLine(
        site="a", round=4, members=list(res.members), sync_s=0.5, quorum_s=0.2, inner_s=1.0, **engine_fields(res), **kw
    )


def test_every_round_result_field_has_a_round_line_field():
    names = {f.name for f in dataclasses.fields(RoundResult)} - {"round", "members", "bucket_outcome", "buckets"}
    produced = set(engine_fields(_result()))
    assert produced == set(ENGINE_FIELDS), (
        f"RoundResult and RoundLine differ: only in RoundResult {produced - set(ENGINE_FIELDS)}, "
        f"only in RoundLine {set(ENGINE_FIELDS) - produced}"
    )
    assert len(names) == len(produced)
    assert engine_fields(_result())["round_s"] == 0.25  # RoundResult.total_s is the line's round_s


def test_a_round_result_attribute_the_schema_lacks_is_refused():
    @dataclasses.dataclass
    class Newer(RoundResult):
        frobs: int = 0

    with pytest.raises(MetricsError, match="RoundResult.frobs has no RoundLine field"):
        engine_fields(Newer(round=0, members=()))


def test_lines_round_trip_through_json_and_the_reader(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        StartLine(site="a", round=0, val_loss=5.5, params=10, time=1.0),
        _round(val_loss=3.0),
        RoundLine(site="a", round=5, status="deferred", reason="unreachable", sync_s=2.0, quorum_s=2.0),
        EndLine(site="a", round=5, bytes_sent=300, bytes_received=0, wall_s=9.0),
    ]
    with open(path, "w") as f:
        for ln in lines:
            write_line(f, ln)
    raw = [json.loads(x) for x in path.read_text().splitlines()]
    assert [d["event"] for d in raw] == ["start", "round", "round", "end"]
    assert all(d["version"] == METRICS_VERSION for d in raw)
    assert "round_s" in raw[1] and "total_s" not in raw[1]
    assert not set(ENGINE_FIELDS) & set(raw[2]), "a deferred line carries no engine fields"
    assert read_metrics(path) == lines


def test_unknown_versions_are_refused_naming_file_line_and_version(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps(StartLine(site="a").as_dict())
    path.write_text(good + "\n" + json.dumps({"version": 99, "event": "round", "round": 0}) + "\n")
    with pytest.raises(MetricsVersionError, match=r"metrics\.jsonl:2: metrics version 99 is not one this dtrain reads"):
        read_metrics(path)
    with pytest.raises(MetricsVersionError, match="'2'"):
        parse_line({"version": "2", "event": "start", "round": 0})
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"version": 3, "site": "a"}))
    with pytest.raises(MetricsVersionError, match="summary.json"):
        read_summary(summary)


def test_version_1_lines_are_read_with_total_s_as_round_s():
    line = parse_line({"event": "round", "round": 2, "site": "a", "total_s": 0.3, "sync_s": 0.4, "future": 1})
    assert isinstance(line, RoundLine) and line.round_s == 0.3 and line.quorum_s is None
    assert line.version == METRICS_VERSION  # upgraded on reading


def test_half_written_last_line_is_skipped_silently_and_malformed_lines_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    start = json.dumps(StartLine(site="a").as_dict())
    path.write_text(f'{start}\n[1]\n{{"event": "nope", "round": 0}}\n\n{{"event": "round", "round": 0, "si')
    with caplog.at_level(logging.WARNING, logger="dtrain.metrics"):
        lines = read_metrics(path)
    assert lines == [StartLine(site="a")]
    warned = [r.getMessage() for r in caplog.records]
    assert [m.split(": ")[0] for m in warned] == [f"{path}:2", f"{path}:3"], warned
    assert "expected a JSON object" in warned[0] and "'event' must be one of start, round, end" in warned[1]


def test_tail_returns_each_line_once_when_complete(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []  # no file yet
    first = json.dumps(StartLine(site="a").as_dict())
    second = json.dumps(_round().as_dict())
    path.write_text(first + "\n" + second[:20])
    assert tail.poll() == [StartLine(site="a")]
    assert tail.poll() == []
    with open(path, "a") as f:
        f.write(second[20:] + "\n")
    assert tail.poll() == [_round()]
    with open(path, "a") as f:
        f.write('{"version": 7, "event": "end", "round": 1}\n')
    with pytest.raises(MetricsVersionError, match=f"{path}:3"):
        tail.poll()


def test_totals_add_time_of_every_round_line_and_bytes_of_rounds_that_ran():
    t = Totals()
    for ln in (
        StartLine(site="a"),
        _round(),
        _round(),
        RoundLine(site="a", round=6, status="resynced", sync_s=1.5, quorum_s=0.5, inner_s=1.0),
        EndLine(site="a", round=7, bytes_sent=30, bytes_received=5),
    ):
        t.add(ln)
    assert t.rounds_joined == 2
    assert t.sync_s == pytest.approx(2.5) and t.quorum_s == pytest.approx(0.9) and t.round_s == pytest.approx(0.5)
    assert t.inner_s == pytest.approx(3.0)
    assert (t.bytes_sent, t.bytes_received) == (2030, 1405)
    assert t.compression_ratio is None  # encoded nothing
    t.encoded_bytes, t.encoded_fp32_bytes = 10, 40
    assert t.compression_ratio == 4.0


def test_summary_round_trip_and_missing_or_broken_files(tmp_path, caplog):
    s = Summary(site="a", rounds=3, bytes_sent=10, sync_s=1.0, wall_s=4.0, sync_share=0.25)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(s.as_dict()))
    assert read_summary(path) == s
    assert read_summary(tmp_path / "absent.json") is None
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="dtrain.metrics"):
        assert read_summary(path) is None
    assert "unreadable summary" in caplog.text


def test_compact_senders_round_trips_each_chunk_and_stays_small():
    from dtrain.metrics import chunk_senders
    from dtrain.rounds.types import compact_senders

    everyone = ("a", "b", "c", "d")
    per_chunk = [everyone] * 480
    per_chunk[3] = ("a", "c", "d")
    per_chunk[17] = ("a", "b")
    per_chunk[479] = ("b", "c", "d")
    entry = compact_senders(per_chunk)
    assert entry == {"senders": list(everyone), "absent": {"a": [479], "b": [3], "c": [17], "d": [17]}}
    assert [chunk_senders(entry, c) for c in range(480)] == [list(s) for s in per_chunk]
    assert len(json.dumps(entry)) < 120  # a list per chunk: ~14,000 characters
    # lines written before the compact form: a list per chunk
    assert chunk_senders([["a", "b"], ["b"]], 1) == ["b"] and chunk_senders([["a"]], 5) == []
    assert chunk_senders(None, 0) == [] and compact_senders([]) == {"senders": [], "absent": {}}
