"""The compiled batch loop of the datagram path (dtrain/transports/dgram_native.c): it seals
the same bytes as the Python ``cryptography`` path, refuses exactly what the Python
:meth:`Opener.open` refuses (same reasons, same counts), and its ``sendmmsg``/``recvmmsg``
carry datagrams, arrival times and oversize marks; without a compiler it is reported
unavailable and the transport falls back."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from dtrain.transports import datagram_native
from dtrain.transports.datagram_native import OPEN_STATUS, header_view, native
from dtrain.transports.datagram_wire import (
    HEADER_BYTES,
    MAGIC,
    TAG_BYTES,
    VERSION,
    Dropped,
    Kind,
    Opener,
    Sealer,
    codec_id,
)

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(32))
LIB = native("auto")
if LIB is None and os.environ.get("DTRAIN_NATIVE_REQUIRED"):  # .ci/run as root installs gcc and libssl-dev
    native("on")  # raises, naming why it is unavailable
needs_lib = pytest.mark.skipif(LIB is None, reason="the compiled datagram loop does not build here (gcc, libssl-dev)")


def _fields(n: int) -> list[tuple[int, ...]]:
    return [(2, c, 1280 * c, 1280, codec_id("int8"), 0, 1) for c in range(n)]


def _bodies(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(0, 1300)), dtype=np.uint8).tobytes() for _ in range(n)]


@needs_lib
def test_native_seal_is_byte_for_byte_the_python_seal() -> None:
    fast = Sealer(KEY, run=7, round=3, sender=1, native=LIB)
    slow = Sealer(KEY, run=7, round=3, sender=1)
    fields, bodies = _fields(40), _bodies(40)
    a, b = fast.seal_many(Kind.CONTRIB, fields, bodies), slow.seal_many(Kind.CONTRIB, fields, bodies)
    assert list(a.lens) == list(b.lens) == [HEADER_BYTES + len(x) + TAG_BYTES for x in bodies]
    assert [a.datagram(i) for i in range(40)] == [b.datagram(i) for i in range(40)]
    # and each is what seal() gives for the same sequence number
    one = Sealer(KEY, run=7, round=3, sender=1)
    singles = [
        one.seal(Kind.CONTRIB, x, bucket=2, chunk=c, offset=1280 * c, numel=1280, codec=codec_id("int8"))
        for c, x in enumerate(bodies)
    ]
    assert singles == [a.datagram(i) for i in range(40)]
    hv = header_view(a.buf, 40)
    assert list(hv["seq"]) == list(range(40)) and list(hv["chunk"]) == list(range(40))


@needs_lib
def test_a_header_field_past_its_wire_width_is_refused() -> None:
    s = Sealer(KEY, run=7, round=3, sender=1, native=LIB)
    with pytest.raises(ValueError, match="wire width"):
        s.seal_many(Kind.CONTRIB, [(1 << 32, 0, 0, 0, 0, 0, 1)], [b"x"])


def _mixed_batch() -> list[bytes]:
    """Good datagrams among every kind of bad one, in one arrival order."""
    good = Sealer(KEY, run=7, round=3, sender=1)
    d = [good.seal(Kind.CONTRIB, b"body-%d" % i, bucket=1, chunk=i) for i in range(6)]
    forged_body = bytearray(d[1])
    forged_body[-20] ^= 1
    forged_header = bytearray(d[2])
    forged_header[16] ^= 1  # the chunk field: authenticated as associated data
    bad_version = bytearray(d[3])
    bad_version[2] = 9
    return [
        d[0],
        d[0],  # replayed
        bytes(forged_body),
        bytes(forged_header),
        d[4][: HEADER_BYTES + 3],  # truncated
        d[5][:-1],  # a cut tag: forged
        Sealer(KEY, run=7, round=3, sender=1).seal(Kind.CONTRIB, b"z" * 1400),  # oversized
        b"\x00" * 200,  # bad magic
        bytes(bad_version),
        Sealer(KEY, run=8, round=3, sender=1).seal(Kind.CONTRIB, b"r"),  # wrong run
        Sealer(KEY, run=7, round=9, sender=1).seal(Kind.CONTRIB, b"u"),  # unknown round
        Sealer(KEY, run=7, round=1, sender=1).seal(Kind.CONTRIB, b"s"),  # stale round
        Sealer(KEY, run=7, round=3, sender=5).seal(Kind.CONTRIB, b"b"),  # bad sender
        Sealer(os.urandom(32), run=7, round=3, sender=2).seal(Kind.CONTRIB, b"k"),  # wrong key
        d[4],
        d[5],
        good.seal(Kind.MEAN, b"", bucket=2),  # an empty body authenticates too
    ]


def _opener(native_lib=None) -> Opener:
    op = Opener(run=7, max_datagram_bytes=1400, native=native_lib)
    op.open_round(1, KEY, 3)
    op.open_round(3, KEY, 3)
    op.open_round(4, KEY, 3)  # retires round 1
    return op


@needs_lib
@pytest.mark.parametrize("order", ["arrival", "reversed", "junk_first", "unknown_round_first", "skips"])
def test_open_batch_refuses_what_open_refuses_with_the_same_counts(order: str) -> None:
    """Whatever row comes first (its round picks the one-round call, whose other rows go the
    general way) and with rows skipped (a test's injected drops: neither opened nor counted)."""
    batch = _mixed_batch()
    if order != "arrival":
        batch = _reordered(batch, order)
    skip = np.array([i % 3 == 1 for i in range(len(batch))]) if order == "skips" else None
    slow = _opener()
    want_ok, want_bodies = [], []
    for i, data in enumerate(batch):
        if skip is not None and skip[i]:
            want_ok.append(False)
            continue
        try:
            want_bodies.append(slow.open(data)[1])
            want_ok.append(True)
        except Dropped:
            want_ok.append(False)
    fast = _opener(LIB)
    general: list[list[int]] = []  # the rows each general-path call was given
    open_general = fast._open_general

    def spy(buf, lens, n, skip, hv):
        general.append([i for i in range(n) if skip is None or not skip[i]])
        return open_general(buf, lens, n, skip, hv)

    fast._open_general = spy  # type: ignore[method-assign]
    buf, lens = _rows(batch)
    got = fast.open_batch(buf, lens, len(batch), skip)
    if order == "arrival":  # round 3 in one call; only the rows of rounds 9 and 1 went the general way
        assert general == [[10, 11]]
    elif order in ("junk_first", "unknown_round_first"):  # no key for the first row's round
        assert general == [list(range(len(batch)))]
    assert list(got.ok) == want_ok
    assert [buf[i, HEADER_BYTES : lens[i] - TAG_BYTES].tobytes() for i in np.flatnonzero(got.ok)] == want_bodies
    assert fast.counts() == slow.counts()
    unknown = [i for i, d in enumerate(batch) if d == _mixed_batch()[10] and (skip is None or not skip[i])]
    assert got.pending == unknown  # the unknown round's datagram, still sealed: opened once its plan comes
    for i in unknown:
        assert buf[i, : lens[i]].tobytes() == batch[i]
    if order != "skips":
        assert sum(want_ok) == 4 and slow.counts()["forged"] == 4 and slow.counts()["replayed"] == 1


@needs_lib
def test_the_compiled_open_checks_replays_on_the_python_paths_window() -> None:
    """The replay check runs in the compiled open (``dg_open_round``) on the ring the Python path
    keeps (``ReplayWindow.pointers``): over reordered, repeated and far-behind sequence numbers
    the batch accepts exactly what ``Opener.open`` accepts and counts the rest ``replayed``, and a
    datagram opened by either path is a replay for the other."""
    seqs = [0, 5, 3, 5, 20000, 3, 19999, 11807, 11808, 11809, 20000, 7, 20001, 11809]
    sealer = Sealer(KEY, run=7, round=3, sender=2)
    batch = []
    for q in seqs:
        sealer._next_seq = q  # the sequence number the next datagram carries
        batch.append(sealer.seal(Kind.CONTRIB, b"q%d" % q, bucket=1, chunk=q % 100))
    slow, fast = _opener(), _opener(LIB)
    want = []
    for data in batch:
        try:
            slow.open(data)
            want.append(True)
        except Dropped as e:
            assert e.reason == "replayed"
            want.append(False)
    assert want == [True, True, True, False, True, False, True, False, False, True, False, False, True, False]
    buf, lens = _rows(batch)
    got = fast.open_batch(buf, lens, len(batch))
    assert list(got.ok) == want and fast.counts()["replayed"] == slow.counts()["replayed"] == want.count(False)
    fresh = [
        sealer.seal(Kind.CONTRIB, b"late", bucket=1, chunk=c) for c in range(2)
    ]  # 11810, 11811: new, in the window
    buf, lens = _rows(fresh[:1])
    assert list(fast.open_batch(buf, lens, 1).ok) == [True]
    with pytest.raises(Dropped, match="replayed"):
        fast.open(fresh[0])  # opened by the batch: a replay for the Python path
    fast.open(fresh[1])
    buf, lens = _rows(fresh[1:])
    assert list(fast.open_batch(buf, lens, 1).ok) == [False]  # and the other way round
    assert fast.counts()["replayed"] == want.count(False) + 2
    # the compiled call itself says "replayed" (no Python loop after it)
    rk = fast._keys[3]
    twice = [sealer.seal(Kind.CONTRIB, b"x", bucket=1, chunk=0)] * 2
    buf, lens = _rows(twice)
    status, opened = LIB.open_round(
        rk.handle, buf, lens, 2, None, max_len=1400, magic=MAGIC, version=VERSION, run=7, round=3, num_members=3,
        windows=rk.native_windows,
    )  # fmt: skip
    assert [OPEN_STATUS[c] for c in status] == ["ok", "replayed"] and opened == 1
    # the top sequence number is refused by both paths and leaves the window as it was (seq + 1
    # would wrap to 0 in the compiled check and reset it, letting old datagrams in again)
    sealer._next_seq = 16383  # new, in the window, and in the slot the top number maps to (8191)
    buf, lens = _rows([sealer.seal(Kind.CONTRIB, b"s", bucket=1, chunk=0)])
    assert list(fast.open_batch(buf, lens, 1).ok) == [True]
    sealer._next_seq = (1 << 64) - 1
    top = sealer.seal(Kind.CONTRIB, b"top", bucket=1, chunk=0)
    buf, lens = _rows([top, batch[1]])  # then an old one (seq 5, seen and far behind)
    assert list(fast.open_batch(buf, lens, 2).ok) == [False, False]
    with pytest.raises(Dropped, match="replayed"):
        fast.open(top)
    assert rk.windows[2]._next[0] == 20002  # the highest seen is still 20001


def _reordered(batch: list[bytes], order: str) -> list[bytes]:
    if order == "reversed":
        return batch[::-1]
    if order == "junk_first":  # bad magic first: its "round" field is zeros
        return [batch[7]] + batch[:7] + batch[8:]
    if order == "unknown_round_first":
        return [batch[10]] + batch[:10] + batch[11:]
    return batch  # "skips"


def _rows(batch: list[bytes], stride: int = 1401) -> tuple[np.ndarray, np.ndarray]:
    buf = np.zeros((len(batch), stride), np.uint8)
    lens = np.zeros(len(batch), np.uint32)
    for i, data in enumerate(batch):
        cut = data[:stride]
        buf[i, : len(cut)] = np.frombuffer(cut, np.uint8)
        lens[i] = len(data) if len(data) <= stride else stride + 1
    return buf, lens


@needs_lib
def test_sendmmsg_and_recvmmsg_carry_a_batch_with_arrival_times() -> None:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_TIMESTAMPNS", 35), 1)
        tx.connect(rx.getsockname())
        sealed = Sealer(KEY, run=7, round=3, sender=1, native=LIB).seal_many(Kind.CONTRIB, _fields(20), _bodies(20))
        t0 = time.time()
        assert LIB.send(tx.fileno(), sealed.buf, sealed.lens, 20) == 20
        tx.send(b"q" * 1500)  # larger than a receive row: reported as row + 1 bytes (oversized)
        buf = np.zeros((32, 1401), np.uint8)
        lens, ts, drops = np.zeros(32, np.uint32), np.zeros(32, np.int64), np.zeros(1, np.uint32)
        got, deadline = 0, time.monotonic() + 5
        while got < 21 and time.monotonic() < deadline:
            n = LIB.recv(rx.fileno(), buf[got:], lens[got:], ts[got:], drops)
            assert n >= 0
            got += n
        assert got == 21
        assert [buf[i, : lens[i]].tobytes() for i in range(20)] == [sealed.datagram(i) for i in range(20)]
        assert lens[20] == 1402
        assert all(t0 - 1 < t * 1e-9 < time.time() + 1 for t in ts[:21])
        assert LIB.recv(rx.fileno(), buf, lens, ts, drops) == 0  # nothing queued: no wait
    finally:
        rx.close()
        tx.close()


def _batch_lens_for_gso() -> list[int]:
    """Bodies whose sealed lengths make GSO runs of every kind: full runs past 64 segments and past
    65,000 bytes, a shorter datagram closing a run, a longer one opening the next, runs of one."""
    return [1332] * 70 + [500] + [1332] * 3 + [1332, 100, 1332] + [40] * 5 + [600] * 2


def _received(rx: socket.socket, n: int) -> list[bytes]:
    got, deadline = [], time.monotonic() + 5
    rx.settimeout(1.0)
    while len(got) < n and time.monotonic() < deadline:
        got.append(rx.recv(2000))
    return got


@needs_lib
@pytest.mark.parametrize("no_check", [False, True], ids=["gso", "kernel-refuses-gso"])
def test_gso_sends_the_same_datagrams_as_sendmmsg_in_the_same_order(no_check: bool) -> None:
    """One batch sealed once, sent with ``sendmmsg`` and with UDP_SEGMENT runs: the receiver reads
    the same datagrams in the same order. With SO_NO_CHECK the kernel refuses UDP_SEGMENT (EINVAL):
    the refusal is reported and the batch still leaves whole through ``sendmmsg``."""
    import errno

    bodies = [bytes([i % 251]) * n for i, n in enumerate(_batch_lens_for_gso())]
    fields = [(1, c, 0, 1, codec_id("int8"), 0, 1) for c in range(len(bodies))]
    sealed = Sealer(KEY, run=7, round=3, sender=1, native=LIB).seal_many(Kind.CONTRIB, fields, bodies)
    n = len(bodies)
    want = [sealed.datagram(i) for i in range(n)]
    rx, tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.bind(("127.0.0.1", 0))
        tx.connect(rx.getsockname())
        if no_check:
            tx.setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK: UDP GSO needs checksums
        assert LIB.send(tx.fileno(), sealed.buf, sealed.lens, n) == n
        assert _received(rx, n) == want
        r, refused = LIB.send_gso(tx.fileno(), sealed.buf, sealed.lens, n)
        assert r == n and refused == (errno.EINVAL if no_check else 0)
        assert _received(rx, n) == want


def _read_all(read, n: int, rows: int) -> tuple[list[bytes], list[int], list[int]]:
    """Call ``read(buf, lens, ts)`` (``rows`` rows a call) until ``n`` datagrams came (5 s at most):
    their bytes (a row's first ``min(len, 1401)``), lengths and arrival times, in order."""
    buf = np.zeros((rows, 1401), np.uint8)
    lens, ts = np.zeros(rows, np.uint32), np.zeros(rows, np.int64)
    got, got_lens, got_ts, deadline = [], [], [], time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        k = read(buf, lens, ts)
        assert k >= 0
        got += [buf[i, : min(int(lens[i]), 1401)].tobytes() for i in range(k)]
        got_lens += lens[:k].tolist()
        got_ts += ts[:k].tolist()
        if k < rows:
            time.sleep(0.01)
    return got, got_lens, got_ts


@needs_lib
def test_coalesced_reads_give_the_rows_recvmmsg_gives() -> None:
    """A GSO-sent batch read from a socket with UDP_GRO arrives as a few coalesced reads
    (loopback keeps the sender's segments whole); ``recv_gro`` cuts them into the same rows, in
    order, that ``recv`` reads from a socket without it: same bytes, lengths, the oversized mark
    of a datagram longer than a row, arrival times. With 7 rows a call, the rest of a coalesced
    read is held and returned by the next calls (``gro_pending``) before the socket is read again."""
    bodies = [bytes([i % 251]) * n for i, n in enumerate(_batch_lens_for_gso())]
    fields = [(1, c, 0, 1, codec_id("int8"), 0, 1) for c in range(len(bodies))]
    sealed = Sealer(KEY, run=7, round=3, sender=1, native=LIB).seal_many(Kind.CONTRIB, fields, bodies)
    n = len(bodies)
    want = [sealed.datagram(i) for i in range(n)] + [b"q" * 1401]
    for rows in (256, 7):
        rx, tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        state = LIB.gro_state()
        with rx, tx:
            rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            rx.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_TIMESTAMPNS", 35), 1)
            rx.setsockopt(socket.SOL_UDP, 104, 1)  # UDP_GRO
            rx.bind(("127.0.0.1", 0))
            tx.connect(rx.getsockname())
            t0 = time.time()
            for _ in range(2):
                assert LIB.send_gso(tx.fileno(), sealed.buf, sealed.lens, n) == (n, 0)
                tx.send(b"q" * 1500)  # larger than a row: reported as row + 1 bytes (oversized)
            drops = np.zeros(1, np.uint32)
            calls: list[int] = []

            def read(buf, lens, ts, calls=calls, state=state, rx=rx, drops=drops):
                calls.append(LIB.gro_pending(state))
                return LIB.recv_gro(state, rx.fileno(), buf, lens, ts, drops)

            got, got_lens, got_ts = _read_all(read, 2 * (n + 1), rows)
            assert got == want * 2
            assert got_lens == ([len(d) for d in want[:-1]] + [1402]) * 2
            assert all(t0 - 1 < t * 1e-9 < time.time() + 1 for t in got_ts)
            assert LIB.recv_gro(state, rx.fileno(), *_empty_rows(4), drops) == 0  # nothing queued: no wait
            assert not LIB.gro_pending(state)
            reads, datagrams = LIB.gro_stats(state)
            assert datagrams == 2 * (n + 1)
            assert reads < datagrams // 8  # coalesced (14 reads here): the GSO runs arrive whole
            if rows == 7:
                assert any(calls)  # some call started from what an earlier one held
        LIB.gro_free(state)


def _empty_rows(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros((rows, 1401), np.uint8), np.zeros(rows, np.uint32), np.zeros(rows, np.int64)


def _begin_pair(a, b, addr_a: str, addr_b: str) -> list:
    """Round 0 of sites a and b begun at both; 100 one-datagram contributions of site-a."""
    from dtrain.protocol import Contribution, Member, RoundPlan

    plan = RoundPlan(
        round=0,
        members=(Member(site_id="site-a", address=addr_a), Member(site_id="site-b", address=addr_b)),
        reduce_timeout_s=5,
        broadcast_timeout_s=5,
        datagram_key=os.urandom(32),
    )
    a.begin_round(plan, [], "site-a")
    b.begin_round(plan, [], "site-b")
    return [
        Contribution(round=0, bucket=0, chunk=i, offset=i, numel=1, codec="fp32", sender="site-a", payload=b"abcd")
        for i in range(100)
    ]


@needs_lib
def test_a_transport_whose_kernel_refuses_gso_says_so_once_and_sends_with_sendmmsg(caplog) -> None:
    """The push of a transport whose UDP_SEGMENT writes are refused (here: SO_NO_CHECK on its send
    socket) delivers every contribution, logs the refusal once and sends with ``sendmmsg`` after."""
    import logging

    from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
    from dtrain.transports.grpc import GrpcTransportConfig

    class Count:
        def __init__(self) -> None:
            self.got: list = []

        def handle_contribution(self, c) -> None:
            self.got.append(c.chunk)

    cfg = DatagramTransportConfig(grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0), native="on")
    a, b = DatagramTransport(cfg), DatagramTransport(cfg)
    rec = Count()
    addr_b, addr_a = b.start(rec), a.start(Count())
    try:
        assert a._gso and b._gso
        cs = _begin_pair(a, b, addr_a, addr_b)
        a._send_sock(addr_b).setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK
        with caplog.at_level(logging.WARNING, logger="dtrain.transports.datagram"):
            assert a.push(addr_b, cs, timeout_s=5) == 100
            assert a.push(addr_b, cs, timeout_s=5) == 100  # again (identical): via sendmmsg
        assert not a._gso
        assert [r.getMessage() for r in caplog.records].count(
            "UDP segmentation offload refused by the kernel (Invalid argument): sending datagrams with sendmmsg "
            "from now on"
        ) == 1
        # A push returns once the owner's REPORT came, or after report_wait_s without one (a busy
        # receiver): delivery is then still under way, so wait for it (bounded) before comparing.
        until = time.monotonic() + 20
        while len(rec.got) < 200 and time.monotonic() < until:
            time.sleep(0.02)
        assert sorted(rec.got) == sorted(list(range(100)) * 2)
    finally:
        a.stop(0)
        b.stop(0)


def test_without_a_compiler_the_loop_is_unavailable_and_says_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DTRAIN_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    lib, why = datagram_native._build_and_load()
    assert lib is None and "/bin/false" in why and "failed" in why
    monkeypatch.setattr(datagram_native, "_loaded", {"lib": None, "why": why})
    assert native("auto") is None and native("off") is None
    with pytest.raises(RuntimeError, match="unavailable: `/bin/false` failed"):
        native("on")
    with pytest.raises(ValueError, match="native must be one of auto, on, off, got 'fast'"):
        native("fast")


@needs_lib
def test_one_sealer_seals_from_many_threads_at_once() -> None:
    """A round's Sealer serves every push and mean thread of a site at the same time."""
    import threading

    fast = Sealer(KEY, run=7, round=3, sender=1, native=LIB)
    out: list = []

    def work(k: int) -> None:
        for _ in range(30):
            out.append(fast.seal_many(Kind.CONTRIB, _fields(16), _bodies(16, seed=k)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    op = Opener(run=7, max_datagram_bytes=1400)
    op.open_round(3, KEY, 3)
    bodies = [op.open(b.datagram(i))[1] for b in out for i in range(16)]
    assert len(bodies) == 6 * 30 * 16 and op.counts()["forged"] == 0
    assert len({int(s) for b in out for s in header_view(b.buf, 16)["seq"]}) == len(bodies)  # no sequence twice


def _owner_with_a_mean(member_address: str = "127.0.0.1:9"):
    """A transport (not started) and the state of a 2-member round in which it, site "a",
    published a 5-chunk mean of bucket 0; site "b" is at ``member_address``."""
    from dtrain.protocol import BucketMean, MeanChunk, Member, RoundPlan
    from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
    from dtrain.transports.datagram_round import RoundState

    t = DatagramTransport(DatagramTransportConfig(native="off"))
    plan = RoundPlan(
        round=0,
        members=(Member(site_id="a", address="127.0.0.1:9"), Member(site_id="b", address=member_address)),
        reduce_timeout_s=5,
        broadcast_timeout_s=5,
        datagram_key=KEY,
    )
    rs = RoundState(plan, ["a"], "a", run=0, max_buffer_bytes=1 << 20)
    chunks = tuple(
        MeanChunk(chunk=c, offset=10 * c, numel=10, codec="fp32", payload=bytes([c]) * 40, senders=("a", "b"))
        for c in range(5)
    )
    rs.published[0] = BucketMean(
        round=0, bucket=0, owner="a", chunks=chunks, checksum_before="00" * 16, checksum_after="11" * 16
    )
    return t, rs


def test_an_owner_answers_a_nack_with_each_listed_chunk_twice_and_a_whole_mean_once(monkeypatch) -> None:
    """nack_copies=2: the chunks a NACK lists (and the final meta) leave twice, separately sealed,
    in the pacer's first class, only for chunks that already left (the rest are on their way);
    the NACK's own second copy is not answered again; a NACK for all of a mean (nothing arrived)
    re-sends it once."""
    import struct
    from types import SimpleNamespace

    t, rs = _owner_with_a_mean()
    sent: list[tuple[int, int]] = []  # (kind, chunk) of every datagram that left
    classes: list[bool] = []

    def capture(rs_, dest, sock, batch, deadline, *, contribution, first_class=False):
        hv = header_view(batch.buf, len(batch.lens))
        sent.extend(zip(hv["kind"].tolist(), hv["chunk"].tolist()))
        classes.append(first_class)
        assert len(set(hv["seq"].tolist())) == len(batch.lens)  # every copy sealed on its own
        return True

    monkeypatch.setattr(t, "_send_batch", capture)
    rs.mean_left[0] = 2  # chunks 0-1 have left, 2-4 are still on their way: only chunk 1 is answered
    t._answer_nack(rs, SimpleNamespace(bucket=0, sender=1, chunk=7), struct.pack("<2I", 1, 3))
    t._run_queued_repairs()
    assert sorted(sent) == sorted([(Kind.MEAN, 1)] * 2 + [(Kind.MEAN_META, 1)] * 2)
    sent.clear()
    t._answer_nack(rs, SimpleNamespace(bucket=0, sender=1, chunk=8), struct.pack("<1I", 3))
    t._run_queued_repairs()
    assert sent == []  # nothing asked for has left yet: no answer
    rs.mean_left[0] = 5  # the whole mean has left
    nack = SimpleNamespace(bucket=0, sender=1, chunk=1)  # the member's first NACK of bucket 0
    t._answer_nack(rs, nack, struct.pack("<2I", 1, 3))
    t._run_queued_repairs()
    assert sorted(sent) == sorted([(Kind.MEAN, 1), (Kind.MEAN, 3)] * 2 + [(Kind.MEAN_META, 1)] * 2)
    assert classes and all(classes)  # a NACK's answer is paced ahead of fresh means
    sent.clear()
    t._answer_nack(rs, nack, struct.pack("<2I", 1, 3))  # the NACK's second copy: not answered again
    t._run_queued_repairs()
    assert sent == []
    t._answer_nack(rs, SimpleNamespace(bucket=0, sender=1, chunk=2), struct.pack("<2I", 0xFFFFFFFF, 0xFFFFFFFE))
    t._run_queued_repairs()
    assert sorted(sent) == sorted([(Kind.MEAN_META, 0)] + [(Kind.MEAN, c) for c in range(5)] + [(Kind.MEAN_META, 1)])
    t.stop(0)


def test_a_datagram_that_failed_to_open_just_before_its_round_began_is_opened_not_held() -> None:
    """begin_round opens the round's key, then takes what is held; a datagram that failed to open
    just before the key arrived and reaches _hold after that is not held for a round that has
    begun (nothing would take it): _hold says so and the caller opens it again. A datagram of a
    round still to come is held."""
    from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig

    t = DatagramTransport(DatagramTransportConfig(native="off"))
    now = Sealer(KEY, run=0, round=3, sender=1).seal(Kind.CONTRIB, b"x" * 40, bucket=0, chunk=0)
    later = Sealer(KEY, run=0, round=4, sender=1).seal(Kind.CONTRIB, b"y" * 40, bucket=0, chunk=0)
    t._opener.open_round(3, KEY, 2)
    assert t._hold(now) is False and t._pending == []  # its key is here: opened again by the caller
    assert t._hold(later) is True and t._pending == [later]
    h, body = t._opener.open(now)
    assert (h.round, body) == (3, b"x" * 40)
    t.stop(0)


def test_a_nack_answer_waiting_on_the_pacer_does_not_hold_up_the_dispatch_thread(monkeypatch) -> None:
    """The receive thread only decides what a NACK asks for; the repair thread sends it. With
    the answer stuck in the pacer, a SEND_END that came after the NACK is still handled and
    answered; past the repair queue's bound (``_MAX_REPAIRS_QUEUED``) a NACK is dropped and
    counted ``over_budget``, not queued."""
    import queue
    import struct
    import threading
    from types import SimpleNamespace

    from dtrain.transports.datagram import _SEND_END
    from dtrain.transports.datagram_means import _MAX_REPAIRS_QUEUED

    t, rs = _owner_with_a_mean()
    rs.mean_left[0] = 5
    in_pacer, release = threading.Event(), threading.Event()
    sent: list[int] = []

    def stuck(rs_, dest, sock, batch, deadline, *, contribution, first_class=False):
        in_pacer.set()
        assert release.wait(10)
        sent.append(len(batch.lens))
        return True

    done, reports = threading.Event(), []
    t._handler = SimpleNamespace(handle_sender_done=lambda round, sender, buckets=None: done.set())
    monkeypatch.setattr(t, "_send_batch", stuck)
    monkeypatch.setattr(t, "_send_ctl", lambda rs_, dest, data, **kw: reports.append(dest))
    threads = [threading.Thread(target=f, daemon=True) for f in (t._dispatch_loop, t._repair_loop)]
    for th in threads:
        th.start()
    try:
        t._answer_nack_here(rs, SimpleNamespace(bucket=0, sender=1, chunk=1), struct.pack("<1I", 2))
        assert in_pacer.wait(10)  # the repair thread is sending the answer, and stays there
        t._enqueue([(Kind.SEND_END, rs, SimpleNamespace(sender=1, chunk=0), _SEND_END.pack(10, 12800, 0.5, 0))])
        assert done.wait(10) and not release.is_set()  # handled while the answer is still stuck
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reports == [1]  # ... and answered with a REPORT
        assert t._repairs.maxsize == _MAX_REPAIRS_QUEUED
        t._repairs = queue.Queue(maxsize=3)  # a smaller bound, to fill it with one member's NACKs
        before = t._opener.counts()["over_budget"]
        for n in range(5):  # distinct NACKs (numbers 2..6, each within its budget): none is a copy
            t._answer_nack(rs, SimpleNamespace(bucket=0, sender=1, chunk=2 + n), struct.pack("<1I", 3))
        assert t._opener.counts()["over_budget"] - before == 2
        assert t._repairs.qsize() == 3
        t._repairs.get_nowait()  # room again: a refused NACK's next copy is answered, not taken as answered
        t._answer_nack(rs, SimpleNamespace(bucket=0, sender=1, chunk=6), struct.pack("<1I", 3))
        assert t._repairs.qsize() == 3 and t._opener.counts()["over_budget"] - before == 2
    finally:
        release.set()
        t._stopped.set()
        for th in threads:
            th.join(5)
    assert sent and sent[0] > 0  # the stuck answer left once released
    t.stop(0)


def test_a_nack_is_answered_by_the_receive_thread_not_queued_behind_contributions() -> None:
    """A NACK asks for mean chunks that already left, so it does not wait for the dispatch
    thread's backlog: an opened NACK goes to the repair queue at once and nothing of it is
    queued for dispatch, while a SEND_END (which counts the contributions before it) is."""
    import struct
    from types import SimpleNamespace

    t, rs = _owner_with_a_mean()
    rs.mean_left[0] = 5
    out: list[tuple] = []
    nack = SimpleNamespace(kind=Kind.NACK, round=0, bucket=0, sender=1, chunk=1)
    t._on_opened(rs, nack, struct.pack("<2I", 1, 3), 0.0, out)
    assert out == [] and t._repairs.qsize() == 1
    _, m, dest, wanted, meta, copies = t._repairs.get_nowait()
    assert (m.bucket, dest, wanted, meta, copies) == (0, 1, [1, 3], False, 2)
    end = SimpleNamespace(kind=Kind.SEND_END, round=0, bucket=0, sender=1, chunk=0)
    t._on_opened(rs, end, b"", 0.0, out)
    assert [item[0] for item in out] == [Kind.SEND_END]
    t.stop(0)


def test_what_one_nack_can_make_an_owner_resend_is_bounded(monkeypatch) -> None:
    """A member holds a valid key but is not trusted: a NACK numbered past ``max_nack_rounds``
    (an honest member never sends one) is not answered; one NACK number's bodies ask for at most
    the whole mean and its meta (more is refused, counted ``over_budget``); a chunk listed twice
    is sent once per copy, not twice."""
    import struct
    from types import SimpleNamespace

    t, rs = _owner_with_a_mean()
    rs.mean_left[0] = 5
    sent: list[tuple[int, int]] = []

    def capture(rs_, dest, sock, batch, deadline, *, contribution, first_class=False):
        hv = header_view(batch.buf, len(batch.lens))
        sent.extend(zip(hv["kind"].tolist(), hv["chunk"].tolist()))
        return True

    monkeypatch.setattr(t, "_send_batch", capture)

    def nack(number: int, *chunks: int) -> int:
        """Answer one NACK: the mean chunk datagrams it made the owner send, the NACKs refused."""
        sent.clear()
        before = t._opener.counts()["over_budget"]
        t._answer_nack(rs, SimpleNamespace(bucket=0, sender=1, chunk=number), struct.pack(f"<{len(chunks)}I", *chunks))
        t._run_queued_repairs()
        return sum(k == Kind.MEAN for k, _ in sent), t._opener.counts()["over_budget"] - before

    limit = t.config.max_nack_rounds
    assert nack(limit + 1, 0xFFFFFFFE) == (0, 1)  # past max_nack_rounds: refused
    assert nack(0, 0xFFFFFFFE) == (0, 1)  # numbers start at 1
    assert nack(1, *[2] * 300) == (2, 0)  # chunk 2 listed 300 times: sent nack_copies (2) times
    assert nack(1, 0, 1, 3) == (6, 0)  # another body of number 1: 4 of the 5 chunks + meta spent
    assert nack(1, 0, 4, 0xFFFFFFFF) == (0, 1)  # 3 more would pass the whole mean + meta (6): refused
    assert nack(1, 4, 0xFFFFFFFF) == (2, 0)  # 2 more fit
    assert nack(limit, 0xFFFFFFFE) == (5, 0)  # the last number: all 5 chunks once
    t.stop(0)


def test_a_stopped_transport_sends_nothing_more() -> None:
    """After stop() no mean chunk, NACK answer or control datagram leaves, as from a crashed site
    (its send sockets close only after the threads are joined; a mean push thread is not)."""
    member = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    member.bind(("127.0.0.1", 0))
    member.settimeout(2.0)
    try:
        t, rs = _owner_with_a_mean(f"127.0.0.1:{member.getsockname()[1]}")
        rs.mean_left[0] = 5
        t._send_mean(rs, rs.published[0], [1], [0, 1], with_meta=True)  # before stop: it leaves
        assert t.counters()["datagrams_sent"] == 4  # meta, 2 chunks, final meta
        assert len([member.recv(2048) for _ in range(4)]) == 4
        t.stop(0)
        t._send_mean(rs, rs.published[0], [1], list(range(5)), with_meta=True)
        t._send_ctl(rs, 1, b"x" * 40)
        assert t.counters()["datagrams_sent"] == 4
        member.settimeout(0.3)
        with pytest.raises(TimeoutError):
            member.recv(2048)  # nothing arrived after stop()
    finally:
        member.close()


@needs_lib
def test_a_transport_whose_kernel_refuses_gro_says_so_and_reads_with_recvmmsg(caplog, monkeypatch) -> None:
    """A kernel without UDP_GRO (here: its setsockopt made to fail with ENOPROTOOPT, as Linux
    < 5.0 does) is logged at start, naming the option and the fallback, and the transport's
    receive thread reads every datagram with ``recvmmsg``."""
    import errno
    import logging

    from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
    from dtrain.transports.grpc import GrpcTransportConfig

    real = socket.socket.setsockopt

    def no_gro(self, level, option, *value):
        if (level, option) == (socket.SOL_UDP, 104):
            raise OSError(errno.ENOPROTOOPT, os.strerror(errno.ENOPROTOOPT))
        return real(self, level, option, *value)

    got: list[int] = []

    class Count:
        def handle_contribution(self, c) -> None:
            got.append(c.chunk)

    cfg = DatagramTransportConfig(grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0), native="on")
    a = DatagramTransport(cfg)
    addr_a = a.start(Count())
    b = DatagramTransport(cfg)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="dtrain.transports.datagram_recv"):
        m.setattr(socket.socket, "setsockopt", no_gro)
        addr_b = b.start(Count())
    try:
        assert a._gro is not None and b._gro is None
        assert [r.getMessage() for r in caplog.records] == [
            "UDP receive coalescing (UDP_GRO) refused by the kernel ([Errno 92] Protocol not available): "
            "reading with recvmmsg"
        ]
        cs = _begin_pair(a, b, addr_a, addr_b)
        assert a.push(addr_b, cs, timeout_s=5) == 100
        until = time.monotonic() + 20  # a push may return before delivery ends (see the GSO test above)
        while len(got) < 100 and time.monotonic() < until:
            time.sleep(0.02)
        assert sorted(got) == list(range(100))
    finally:
        a.stop(0)
        b.stop(0)


@needs_lib
def test_plain_batch_gives_the_columns_of_whole_contributions_and_refuses_any_other_batch() -> None:
    """``plain_batch`` on opened rows: each row's header fields, claim, payload and arrival, per
    sender its figures; 0 (nothing written to the blob) when one row is of another kind, round,
    fragment count or sender range. Two batches in two buffers,
    alternated through one PlainColumns, each give their own columns (its pointers follow the
    buffer)."""
    from dtrain.transports.datagram_native import PlainColumns
    from dtrain.transports.datagram_wire import contribution_body

    def batch(sender: int, claim: int, fields=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bytes]]:
        fields = fields or [(1, c, 10 * c, 10, codec_id("int8"), 0, 1) for c in range(6)]
        payloads = [bytes([sender, c]) * (5 + c) for c in range(len(fields))]
        sealed = Sealer(KEY, run=7, round=3, sender=sender, native=LIB).seal_many(
            Kind.CONTRIB, fields, [contribution_body(claim, p) for p in payloads]
        )
        rows = [sealed.datagram(i) for i in range(len(fields))]
        buf, lens = _rows(rows)
        opener = _opener(LIB)
        assert opener.open_batch(buf, lens, len(rows), None).ok.all()
        return buf, lens, np.arange(1, len(rows) + 1, dtype=np.int64) * 1_000_000_000, payloads

    pc = PlainColumns()
    a, b = batch(0, 111), batch(2, 222)
    for buf, lens, ts, payloads in (a, b, a):
        blob = bytearray(sum(map(len, payloads)))
        k = LIB.plain_batch(buf, lens, ts, 6, pc, blob, offset_s=5.0, now_s=0.0, kind=Kind.CONTRIB, round=3,
                            num_codecs=8, num_members=3)  # fmt: skip
        assert k == 1
        s = int(pc.order[0])
        assert pc.cols[:6].tolist() == [
            [s, 1, c, 10 * c, 10, codec_id("int8"), c, 111 if s == 0 else 222] for c in range(6)
        ]
        assert [bytes(blob[a : a + w]) for a, w in zip(pc.at[:6].tolist(), pc.width[:6].tolist())] == payloads
        assert pc.t[:6].tolist() == [5.0 + i for i in range(1, 7)]
        assert (pc.rows[s], pc.first[s], pc.ascending[s], pc.uniform[s]) == (6, 0, 1, 1)
        assert pc.bytes[s] == sum(len(p) + 8 for p in payloads) and (pc.tmin[s], pc.tmax[s]) == (6.0, 11.0)
    buf, lens, ts, payloads = a
    for what, change in (
        ("another round", dict(round=4)),
        ("another kind", dict(kind=int(Kind.MEAN))),
        ("a sender past the members", dict(num_members=0)),
    ):
        blob = bytearray(b"\xee" * sum(map(len, payloads)))
        args = dict(offset_s=0.0, now_s=0.0, kind=int(Kind.CONTRIB), round=3, num_codecs=8, num_members=3) | change
        assert LIB.plain_batch(buf, lens, ts, 6, pc, blob, **args) == 0, what
        assert set(blob) == {0xEE}, what
    frags = batch(1, 5, [(1, 0, 0, 10, codec_id("int8"), 0, 2)] * 6)  # fragments, not whole contributions
    blob = bytearray(100)
    assert LIB.plain_batch(frags[0], frags[1], frags[2], 6, pc, blob, offset_s=0.0, now_s=0.0, kind=Kind.CONTRIB,
                           round=3, num_codecs=8, num_members=3) == 0  # fmt: skip


@needs_lib
def test_a_batch_that_opens_whole_says_so_and_one_bad_row_takes_the_counted_way() -> None:
    """Every row of the one-round call opened: ``all_ok``, with read-only flags (shared between
    batches) and the bodies open() gives; the same batch again is all replays, each counted; a
    forged row among good ones clears ``all_ok`` and is counted."""
    sealer = Sealer(KEY, run=7, round=3, sender=1)
    batch = [sealer.seal(Kind.CONTRIB, b"body-%d" % i, bucket=1, chunk=i) for i in range(8)]
    fast, slow = _opener(LIB), _opener()
    want = [slow.open(d)[1] for d in batch]
    buf, lens = _rows(batch)
    got = fast.open_batch(buf, lens, len(batch))
    assert got.all_ok and list(got.ok) == [True] * 8 and not got.ok.flags.writeable and got.pending == []
    assert [buf[i, HEADER_BYTES : lens[i] - TAG_BYTES].tobytes() for i in range(8)] == want
    assert sum(fast.counts().values()) == sum(slow.counts().values()) == 0
    buf, lens = _rows(batch)  # the same datagrams again
    again = fast.open_batch(buf, lens, len(batch))
    assert not again.all_ok and not again.ok.any() and fast.counts()["replayed"] == 8
    more = [sealer.seal(Kind.CONTRIB, b"more-%d" % i, bucket=1, chunk=i) for i in range(4)]
    forged = bytearray(more[2])
    forged[-20] ^= 1
    buf, lens = _rows([more[0], more[1], bytes(forged), more[3]])
    mixed = fast.open_batch(buf, lens, 4)
    assert not mixed.all_ok and list(mixed.ok) == [True, True, False, True] and fast.counts()["forged"] == 1


@needs_lib
def test_the_receive_buffers_addresses_are_kept_per_array_and_are_the_arrays_own() -> None:
    """The addresses handed to the library for the receive thread's buffers are the arrays'
    own, kept while the same arrays come back (the arrays held, so no other takes their ids)."""
    addresses = datagram_native._Addresses(size=2)
    a, b = np.zeros(16, np.uint8), np.zeros(4, np.uint32)
    assert addresses(a, b) == (a.ctypes.data, b.ctypes.data)
    assert addresses(a, b) is addresses(a, b)  # kept, not computed again
    c = np.zeros(8, np.int64)
    assert addresses(c) == (c.ctypes.data,) and addresses(b) == (b.ctypes.data,)  # a third tuple: the kept ones go
    assert addresses(a, b) == (a.ctypes.data, b.ctypes.data)
