"""The receive thread's hand-on of an opened batch (dtrain/transports/datagram_recv.py): a batch
of plain contributions, taken in columns (``_hand_on_plain``: one ContributionRun per sender), has
every effect the row-by-row path has: each sender's Contributions in the same order, the same
per-sender receive statistics and arrivals, the same reordering measured and the same byte count."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dtrain.protocol import ContributionRun, Member, RoundPlan
from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
from dtrain.transports.datagram_native import native
from dtrain.transports.datagram_wire import Kind, Sealer, codec_id, contribution_body
from dtrain.transports.grpc import GrpcTransportConfig

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(native("auto") is None, reason="the compiled datagram loop does not build here"),
]

KEY = bytes(range(32))
SITES = ("site-a", "site-b", "site-c")


class _Handler:
    def handle_contribution(self, c) -> None:  # nothing is dispatched: _hand_on is called directly
        raise AssertionError("not dispatched in this test")


def _started(sites: tuple[str, ...], owners: list[str], me: str, **config) -> DatagramTransport:
    """A started compiled-loop transport of site ``me`` in round 3 of ``sites`` (sealed with KEY),
    ``owners`` per bucket; ``config``: more DatagramTransportConfig fields. Stop it when done."""
    t = DatagramTransport(
        DatagramTransportConfig(grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0), native="on", **config)
    )
    t.start(_Handler())
    members = tuple(Member(site_id=s, address=f"127.0.0.1:{9 + i}") for i, s in enumerate(sites))
    t.begin_round(
        RoundPlan(round=3, members=members, reduce_timeout_s=60, broadcast_timeout_s=60, datagram_key=KEY),
        owners,
        me,
    )
    return t


def _rows(datagrams: list[bytes], arrivals_ns: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A receive batch's buffers (rows, lengths, arrival stamps) holding ``datagrams``."""
    buf, lens, ts = np.zeros((256, 1401), np.uint8), np.zeros(256, np.uint32), np.zeros(256, np.int64)
    for i, (d, t_ns) in enumerate(zip(datagrams, arrivals_ns)):
        buf[i, : len(d)], lens[i], ts[i] = np.frombuffer(d, np.uint8), len(d), t_ns
    return buf, lens, ts


def _batch(order: str, varying: bool = True) -> list[bytes]:
    """Sealed contributions of round 3 from site-a and site-b (20 each, 3 buckets; ``varying``:
    claims and codecs vary within a sender's, else one claim and int8 per sender), interleaved;
    ``reordered``: some of each sender's swapped."""
    rows: list[list[bytes]] = []
    rng = np.random.default_rng(1)
    for sender in (0, 1):
        sealer = Sealer(KEY, run=0, round=3, sender=sender)
        fields, bodies = [], []
        for i in range(20):
            codec = codec_id("int8" if i % 5 or not varying else "int4")
            fields.append((i // 8, i, 640 * i, 640, codec, 0, 1))
            payload = rng.integers(0, 256, int(rng.integers(1, 700)), dtype=np.uint8).tobytes()
            bodies.append(contribution_body(1000 * sender + (i * (1 << 33) if varying else 0), payload))
        sealed = sealer.seal_many(Kind.CONTRIB, fields, bodies)
        rows.append([sealed.datagram(i) for i in range(20)])
    if order == "reordered":
        for r in rows:
            r[3], r[6] = r[6], r[3]
            r[10], r[11] = r[11], r[10]
    if order == "one sender":
        return rows[0]
    return [d for pair in zip(*rows) for d in pair]


def _hand_on(datagrams: list[bytes], now_ns: int, columns: bool, monkeypatch) -> tuple:
    t = _started(SITES, [], "site-c")
    try:
        if not columns:
            monkeypatch.setattr(t, "_hand_on_plain", lambda *a: False)
        n = len(datagrams)
        # arrival times 1 ms apart, the last one at now_ns
        buf, lens, ts = _rows(datagrams, [now_ns - (n - i) * 1_000_000 for i in range(n)])
        opened = t._opener.open_batch(buf, lens, n, None)
        assert opened.ok.all()
        out: list[tuple] = []
        t._hand_on(buf, lens, ts, opened, out)
        rs = t._round(3)
        items = [(kind, r.round, h.round, h.sender, c) for kind, r, h, c in out]
        stats = {s: (v.datagrams, v.bytes, v.first_t, v.last_t) for s, v in rs.stats.items()}
        arrivals = {s: (a.hi, list(a.seqs)) for s, a in rs.arrivals.items()}
        late = {s: t._reorder.get(s) for s in SITES}
        return items, stats, arrivals, late, t._counts["received"], sorted(rs.owner_active)
    finally:
        t.stop(0)


def _by_sender(items: list[tuple]) -> dict[str, list]:
    """Each sender's Contributions in queue order (a ContributionRun's items one by one), with
    the queued item's round numbers and header sender."""
    out: dict[str, list] = {}
    for kind, rnd, h_round, h_sender, obj in items:
        for c in obj if isinstance(obj, ContributionRun) else (obj,):
            out.setdefault(c.sender, []).append((kind, rnd, h_round, h_sender, c))
    return out


@pytest.mark.parametrize("varying", [False, True], ids=["one claim and codec a sender", "claims and codecs vary"])
@pytest.mark.parametrize("order", ["in order", "reordered", "one sender"])
def test_a_plain_batch_in_columns_has_the_row_by_row_effects(order: str, varying: bool, monkeypatch) -> None:
    datagrams, now_ns = _batch(order, varying), time.time_ns()
    cols = _hand_on(datagrams, now_ns, True, monkeypatch)
    rows = _hand_on(datagrams, now_ns, False, monkeypatch)
    items, stats, arrivals, late, received, active = cols
    runs = [obj for *_, obj in items if isinstance(obj, ContributionRun)]
    # one run per sender when its rows share claim and codec; else a Contribution per row
    assert len(runs) == (0 if varying else 1 if order == "one sender" else 2)
    assert sum(len(r) for r in runs) == (0 if varying else len(datagrams))
    assert _by_sender(items) == _by_sender(rows[0])
    flat = [c for cs in _by_sender(items).values() for *_, c in cs]
    assert len(flat) == len(datagrams)
    claim = {c.chunk: (c.chunk * (1 << 33) if varying else 0) for c in flat}
    assert [c.tokens for c in flat] == [1000 * SITES.index(c.sender) + claim[c.chunk] for c in flat]
    assert [c.codec for c in flat] == ["int8" if c.chunk % 5 or not varying else "int4" for c in flat]
    assert stats.keys() == rows[1].keys()
    for s, (num, nbytes, first, last) in stats.items():
        assert (num, nbytes) == rows[1][s][:2]
        # the arrival times, taken from the same ns stamps; the clock offset is read once per batch
        assert first == pytest.approx(rows[1][s][2], abs=0.05) and last == pytest.approx(rows[1][s][3], abs=0.05)
        assert last - first == pytest.approx(rows[1][s][3] - rows[1][s][2], abs=1e-6)
        assert last - first > 0.018
    assert arrivals == rows[2]
    assert received == rows[4] == sum(len(c.payload) for c in flat)
    assert active == rows[5]
    if order == "reordered":  # each sender's two swaps measured the same way on both paths
        assert late["site-a"] > 0 and late["site-b"] > 0
        assert late == pytest.approx(rows[3], abs=1e-6)
    else:
        assert late == rows[3] == dict.fromkeys(SITES, 0.0)


def test_a_short_batch_goes_row_by_row(monkeypatch) -> None:
    """Below ``_COLUMNS_MIN_ROWS`` the columns' per-batch numpy passes cost more than the rows."""
    from dtrain.transports import datagram_recv

    datagrams, now_ns = _batch("one sender")[: datagram_recv._COLUMNS_MIN_ROWS - 1], time.time_ns()
    calls: list[int] = []
    monkeypatch.setattr(datagram_recv.DatagramReceive, "_hand_on_plain", lambda self, *a: calls.append(1))
    items = _hand_on(datagrams, now_ns, True, monkeypatch)[0]
    assert calls == [] and len(items) == len(datagrams)


# ------------------------------------------------------------------ a member's mean chunks
OWNERS = ("site-a", "site-b", "site-a", "site-b")  # bucket -> owner; site-c (this site) owns none


def _mean_batch(case: str) -> tuple[list[bytes], set[tuple[int, int]], dict[tuple[int, int], object]]:
    """Sealed whole mean chunks of round 3 for site-c, as ``(sender, bucket, chunk)`` rows in
    arrival order by ``case``; the (bucket, chunk) this site holds before the batch; and each
    (bucket, chunk)'s first MeanChunk from its owner, made by MeanChunk's own constructor."""
    from dtrain.protocol import MeanChunk
    from dtrain.transports.datagram_round import senders_bitmap
    from dtrain.transports.datagram_wire import CODEC_WIRE_NAMES

    rng = np.random.default_rng(2)
    all3 = senders_bitmap(("site-a", "site-b", "site-c"), SITES)
    two = senders_bitmap(("site-a", "site-b"), SITES)
    rows: list[tuple[int, int, int, bytes]] = []  # sender, bucket, chunk, bitmap
    held: set[tuple[int, int]] = set()
    if case == "one bucket":
        rows = [(0, 0, c, all3) for c in range(20)]
    elif case == "runs":  # owner a's bucket 0, b's bucket 1, a's bucket 0 again, a's bucket 2
        rows = [(0, 0, c, all3) for c in range(5)] + [(1, 1, c, all3) for c in range(4)]
        rows += [(0, 0, c, all3) for c in range(5, 10)] + [(0, 2, c, two) for c in range(6)]
    elif case == "duplicates and strangers":
        rows = [(0, 0, c, all3 if c % 3 else two) for c in range(8)] + [(0, 0, 2, all3), (0, 0, 5, two)]
        rows += [(1, 0, 9, all3), (2, 1, 0, all3), (0, 1, 3, all3)]  # not the owner; this site; a's on b's bucket
        rows += [(1, 1, c, all3) for c in range(4)]
        held = {(0, 1), (1, 2)}
    elif case == "mostly copies":  # each of 4 chunks 4 times: a quarter of the batch kept
        rows = [(0, 0, c % 4, all3) for c in range(16)]
    else:  # "over budget": the round's buffer (1,400 bytes) holds 3 of these payloads
        rows = [(0, 0, c, all3) for c in range(9)]
    sealers = {s: Sealer(KEY, run=0, round=3, sender=s) for s in range(3)}
    out, expected = [], {}
    for sender, bucket, chunk, bitmap in rows:
        size = 400 if case == "over budget" else 100 + 7 * chunk
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        field = (bucket, chunk, 640 * chunk, 640, codec_id("int8" if chunk % 4 else "int4"), 0, 1)
        out.append(sealers[sender].seal_many(Kind.MEAN, [field], [bitmap + payload]).datagram(0))
        if OWNERS[bucket] == SITES[sender] and (bucket, chunk) not in expected:
            named = tuple(s for i, s in enumerate(SITES) if bitmap[0] >> i & 1)
            expected[(bucket, chunk)] = MeanChunk(
                chunk=chunk,
                offset=field[2],
                numel=640,
                codec=CODEC_WIRE_NAMES[field[4]],
                payload=payload,
                senders=named,
            )
    return out, held, expected


def _hand_on_means(case: str, columns: bool, monkeypatch) -> tuple:
    datagrams, held, _ = _mean_batch(case)
    budget = 1400 if case == "over budget" else 512 << 20
    t = _started(SITES, list(OWNERS), "site-c", max_round_buffer_bytes=budget)
    acks: list[tuple] = []
    monkeypatch.setattr(t, "_ack_mean", lambda rs, sender, bucket, have: acks.append((sender, bucket, have)))
    if not columns:
        monkeypatch.setattr(t, "_hand_on_means", lambda *a: False)
    try:
        rs = t._round(3)
        done = rs.mean_for(1)  # the whole mean of bucket 1 is 4 chunks: complete within the batch, acknowledged
        done.num_chunks, done.have = 4, "ab" * 8
        from dtrain.protocol import MeanChunk

        for bucket, chunk in held:
            rs.mean_for(bucket).chunks[chunk] = MeanChunk(
                chunk=chunk, offset=0, numel=640, codec="int8", payload=b"held", senders=("site-a",)
            )
        n = len(datagrams)
        buf, lens, ts = _rows(datagrams, [time.time_ns()] * n)
        opened = t._opener.open_batch(buf, lens, n, None)
        assert opened.ok.all()
        out: list[tuple] = []
        t._hand_on(buf, lens, ts, opened, out)
        means = {b: dict(rs.mean_for(b).chunks) for b in range(len(OWNERS))}
        counts = {k: t._counts[k] for k in ("received", "mean_duplicates")}
        refused = {k: v for k, v in t._opener.counts().items() if v}
        return means, counts, refused, acks, sorted(rs.owner_active), out, rs.buffered_bytes
    finally:
        t.stop(0)


@pytest.mark.parametrize("case", ["one bucket", "runs", "duplicates and strangers", "mostly copies", "over budget"])
def test_a_batch_of_mean_chunks_in_columns_has_the_row_by_row_effects(case: str, monkeypatch) -> None:
    """A member's batch of whole mean chunks, taken in columns (``_hand_on_means``: one compiled
    pass, each run of one owner's bucket in one call), holds the same chunks (payloads, senders,
    codecs, offsets), counts the same duplicates and refusals, charges the same budget and
    acknowledges the same means as row by row. The kept payloads are views of the batch's one
    copy, except where most of the batch was not kept: then they are copied out (a view would
    hold the whole batch for the bytes charged to the round's budget)."""
    cols = _hand_on_means(case, True, monkeypatch)
    rows = _hand_on_means(case, False, monkeypatch)
    means, counts, refused, acks, active, out, charged = cols
    assert means == rows[0]
    assert (counts, refused, acks, active, out, charged) == rows[1:]
    new = [c for m in means.values() for c in m.values() if c.payload != b"held"]
    expected = _mean_batch(case)[2]
    for b, held_b in means.items():  # equal to MeanChunk's own, every field set
        for c, mc in held_b.items():
            assert mc.payload == b"held" or (
                mc == expected[(b, c)] and vars(mc).keys() == vars(expected[(b, c)]).keys()
            )
    if case in ("mostly copies", "over budget"):  # a quarter, a third of the batch kept
        assert all(type(c.payload) is bytes for c in new)
    else:
        assert all(type(c.payload) is memoryview and c.payload.readonly for c in new)
    assert counts["received"] == sum(len(c.payload) for c in new) == charged
    if case == "one bucket":
        assert sorted(means[0]) == list(range(20)) and refused == {} and counts["mean_duplicates"] == 0
        assert means[0][4].senders == ("site-a", "site-b", "site-c") and means[0][4].codec == "int4"
    elif case == "runs":
        assert [sorted(means[b]) for b in range(3)] == [list(range(10)), list(range(4)), list(range(6))]
        assert means[2][0].senders == ("site-a", "site-b")
        assert acks == [(1, 1, "ab" * 8)]  # bucket 1's 4 chunks arrived: acknowledged once
    elif case == "duplicates and strangers":
        # chunks 2 and 5 twice, 0/1 and 1/2 held before; b on a's bucket, this site, a on b's: malformed
        assert counts["mean_duplicates"] == 2 + 2 and refused == {"malformed": 3}
        assert means[0][5].senders == ("site-a", "site-b", "site-c")  # the first copy's, not the second's
        assert acks == [(1, 1, "ab" * 8)]
    elif case == "mostly copies":
        assert sorted(means[0]) == [0, 1, 2, 3] and counts["mean_duplicates"] == 12 and refused == {}
    else:
        assert sorted(means[0]) == [0, 1, 2] and refused == {"over_budget": 6}


def test_a_mean_batch_from_more_than_64_sites_goes_row_by_row() -> None:
    """``plain_batch`` reads a row's lead as one 64-bit integer, so a senders bitmap of 65 sites
    (9 bytes) is refused there, and a member's mean batch from such a round is held row by row."""
    from dtrain.transports.datagram_native import PlainColumns
    from dtrain.transports.datagram_round import senders_bitmap

    buf, lens, ts = _rows([], [])
    with pytest.raises(ValueError, match="lead must be 1..8"):
        native("on").plain_batch(buf, lens, ts, 4, PlainColumns(), np.empty(800, np.uint8), offset_s=0.0, now_s=0.0,
                        kind=Kind.MEAN, round=0, num_codecs=4, num_members=65, lead=9)  # fmt: skip
    sites = tuple(f"site-{i}" for i in range(65))
    t = _started(sites, ["site-0"], "site-64")
    try:
        fields = [(0, c, 640 * c, 640, codec_id("int8"), 0, 1) for c in range(8)]
        body = senders_bitmap(sites, sites) + bytes(300)
        sealed = Sealer(KEY, run=0, round=3, sender=0).seal_many(Kind.MEAN, fields, [body] * 8)
        buf, lens, ts = _rows([sealed.datagram(i) for i in range(8)], [0] * 8)
        assert t._hand_on_means(buf, lens, ts, 8) is False
        t._hand_on(buf, lens, ts, t._opener.open_batch(buf, lens, 8, None), [])
        held = t._round(3).mean_for(0).chunks
        assert sorted(held) == list(range(8)) and held[3].senders == sites and held[3].payload == bytes(300)
    finally:
        t.stop(0)
