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
    t = DatagramTransport(
        DatagramTransportConfig(grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0), native="on")
    )
    t.start(_Handler())
    try:
        members = tuple(Member(site_id=s, address=f"127.0.0.1:{9 + i}") for i, s in enumerate(SITES))
        plan = RoundPlan(round=3, members=members, reduce_timeout_s=60, broadcast_timeout_s=60, datagram_key=KEY)
        t.begin_round(plan, [], "site-c")
        if not columns:
            monkeypatch.setattr(t, "_hand_on_plain", lambda *a: False)
        n = len(datagrams)
        buf = np.zeros((256, 1401), np.uint8)
        lens = np.zeros(256, np.uint32)
        ts = np.zeros(256, np.int64)
        for i, d in enumerate(datagrams):
            buf[i, : len(d)] = np.frombuffer(d, np.uint8)
            lens[i] = len(d)
            ts[i] = now_ns - (n - i) * 1_000_000  # arrival times 1 ms apart, the last one at now_ns
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
