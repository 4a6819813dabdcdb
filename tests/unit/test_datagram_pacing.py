"""Pacing, rate control and configuration of the datagram data path."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest

from dtrain.codecs import get_codec
from dtrain.codecs.base import HEADER_BYTES
from dtrain.transports.datagram import DatagramTransportConfig, datagram_chunk_bytes
from dtrain.transports.datagram_pacing import Pacer, RateController, ReceiverReport, socket_buffer_bytes
from dtrain.transports.datagram_wire import max_body_bytes

pytestmark = pytest.mark.timeout(30)


def test_pacer_never_releases_faster_than_its_rate() -> None:
    rate_mbit, n, size, burst = 200.0, 400, 1400, 16 << 10
    # t0 before the pacer: its virtual clock starts when it is made (t0 after it once failed by 40 ns)
    t0 = time.monotonic()
    p = Pacer(rate_mbit, burst_bytes=burst)
    for _ in range(n):
        assert p.wait(size, deadline=t0 + 60)
    elapsed = time.monotonic() - t0
    floor_s = (n * size - burst) / (rate_mbit * 1e6 / 8)  # what the rate allows, less one burst
    assert elapsed >= floor_s, f"{n * size} bytes left in {elapsed:.4f} s < {floor_s:.4f} s at {rate_mbit} Mbit/s"


def test_pacer_refuses_what_would_end_past_the_deadline() -> None:
    p = Pacer(1.0, burst_bytes=1000)  # 125 kB/s
    now = time.monotonic()
    assert not p.wait(1_000_000, deadline=now + 1.0)  # 8 s of traffic
    assert p.wait(500, deadline=now + 1.0)  # nothing was reserved by the refused call


def _report(n: int, size: int, send_s: float, received: int, recv_s: float, drops: int = 0) -> ReceiverReport:
    """What a receiver reports of ``n`` datagrams of ``size`` bytes sent over ``send_s``."""
    return ReceiverReport(
        sent_datagrams=n,
        sent_bytes=n * size,
        send_s=send_s,
        received_datagrams=received,
        received_bytes=received * size,
        recv_s=recv_s,
        receiver_drops=drops,
    )


def _link(rate_mbit: float, capacity_mbit: float, loss: float, rng: random.Random) -> ReceiverReport:
    """One round through a bottleneck of ``capacity_mbit`` (a 256-datagram tail-drop queue),
    then random loss on the way to the receiver."""
    n, size = 4000, 1400
    send_s = n * size * 8 / 1e6 / rate_mbit
    through = n if rate_mbit <= capacity_mbit else min(n, int(capacity_mbit / rate_mbit * n) + 256)
    recv_s = send_s if rate_mbit <= capacity_mbit else through * size * 8 / 1e6 / capacity_mbit
    received = sum(rng.random() >= loss for _ in range(through))
    return _report(n, size, send_s, received, recv_s)


@pytest.mark.parametrize("capacity_mbit,loss", [(80.0, 0.0), (80.0, 0.05), (30.0, 0.1)])
def test_rate_converges_to_the_bottleneck_and_stays_under_the_ceiling(capacity_mbit: float, loss: float) -> None:
    """A 256-datagram tail-drop queue hardly stretches the receive window: the loss signal finds it."""
    rng = random.Random(1)
    rc = RateController(max_rate_mbit=200.0, initial_rate_mbit=200.0, loss_signal=True)
    rates = []
    for _ in range(20):
        rate, why = rc.decide([_link(rc.rate_mbit, capacity_mbit, loss, rng)])
        assert rate <= 200.0 and why
        rates.append(rate)
    tail = rates[-8:]
    assert all(0.85 * capacity_mbit <= r <= 1.15 * capacity_mbit for r in tail), rates


@pytest.mark.parametrize("loss", [0.0, 0.2])
def test_random_loss_without_a_bottleneck_keeps_the_ceiling(loss: float) -> None:
    rng = random.Random(2)
    rc = RateController(max_rate_mbit=100.0, initial_rate_mbit=10.0)
    for _ in range(15):
        rc.decide([_link(rc.rate_mbit, 1000.0, loss, rng)])
    assert rc.rate_mbit == 100.0


def test_rising_random_loss_is_not_congestion_by_default() -> None:
    rng = random.Random(3)
    rc = RateController(max_rate_mbit=100.0)
    for loss in (0.01, 0.05, 0.1, 0.2, 0.2):
        rc.decide([_link(rc.rate_mbit, 1000.0, loss, rng)])
    assert rc.rate_mbit == 100.0
    rc = RateController(max_rate_mbit=100.0, loss_signal=True)
    for loss in (0.01, 0.05, 0.1):
        rc.decide([_link(rc.rate_mbit, 1000.0, loss, rng)])
    assert rc.rate_mbit < 100.0  # the opt-in loss signal reads the rise as a bottleneck


def test_a_deep_queue_is_found_from_the_receive_window() -> None:
    """A queue deep enough to hold what exceeds the capacity stretches the receive window."""
    rc = RateController(max_rate_mbit=200.0)
    for _ in range(12):
        n, size = 4000, 1400
        send_s = n * size * 8 / 1e6 / rc.rate_mbit
        recv_s = max(send_s, n * size * 8 / 1e6 / 60.0)  # 60 Mbit/s, nothing dropped
        rc.decide(
            [
                ReceiverReport(
                    sent_datagrams=n,
                    sent_bytes=n * size,
                    send_s=send_s,
                    received_datagrams=n,
                    received_bytes=n * size,
                    recv_s=recv_s,
                )
            ]
        )
    assert 0.85 * 60 <= rc.rate_mbit <= 1.2 * 60  # detection starts at (1 + queue_tolerance) x capacity


def test_a_receiver_overflowing_its_socket_is_congestion_random_loss_is_not() -> None:
    """Drops the receiver's socket counted (it was too slow: SO_RXQ_OVFL) cut the rate to what
    it took; the same loss with no socket drops (the path's random loss) keeps the ceiling."""
    n, size, took = 4000, 1400, 3600  # the receiver kept up with 90% of a 95 Mbit/s send

    def report(drops: int) -> ReceiverReport:
        send_s = n * size * 8 / 1e6 / 95.0
        return _report(n, size, send_s, took, send_s, drops)

    slow, lossy = RateController(max_rate_mbit=95.0), RateController(max_rate_mbit=95.0)
    rate, why = slow.decide([report(n - took)])
    assert rate < 0.95 * 95.0 and "receiver overflow" in why, why
    assert lossy.decide([report(0)])[0] == 95.0


def test_arrival_times_come_from_the_kernel() -> None:
    """SO_TIMESTAMPNS: a datagram that waited in the socket keeps the time it arrived, not the
    time the receive thread got to it (a CPU-starved receiver is not a queue on the path)."""
    import socket

    from dtrain.transports.datagram import DatagramTransport
    from dtrain.transports.datagram_recv import _enable_rx_meta

    rx, tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind(("127.0.0.1", 0))
        anc = _enable_rx_meta(rx)
        if not anc:
            pytest.skip("no SO_TIMESTAMPNS on this platform")
        transport = DatagramTransport()
        # the kernel turns stamping on (a global static key) asynchronously: until then it
        # stamps at recvmsg time, so warm up until a stamp predates a delayed read
        for _ in range(50):
            sent_at = time.monotonic()
            tx.sendto(b"x" * 100, rx.getsockname())
            time.sleep(0.2)  # the receive thread is late
            _, cmsgs, _, _ = rx.recvmsg_into([bytearray(2048)], anc)
            t = transport._rx_meta(cmsgs)
            if t is not None and t <= sent_at + 0.1:
                break
    assert t is not None and sent_at - 0.01 <= t <= sent_at + 0.1, (sent_at, t)


def test_a_short_send_window_stretched_by_the_bottleneck_cuts_the_rate() -> None:
    """A small model's train leaves in 5 ms at 1000 Mbit/s and a 100 Mbit/s link stretches it
    to 50 ms: the rate drops to 0.95x what was delivered, though the send window is under
    ``min_window_s`` (it once kept the 1000 Mbit/s ceiling every round)."""
    n, size = 440, 1400  # 616 kB: 4.9 ms at 1000 Mbit/s
    delivered_mbit = n * size * 8 / 1e6 / 0.05  # 98.6 Mbit/s
    rc = RateController(max_rate_mbit=1000.0)
    rate, why = rc.decide([_report(n, size, 0.005, n, 0.05)])
    assert rate == pytest.approx(0.95 * delivered_mbit, rel=1e-6), why
    assert why.startswith("queue: received over 0.050 s what left in 0.005 s"), why
    # the same through a shallow queue: 40% lost, the rest over 31 ms
    rc = RateController(max_rate_mbit=1000.0)
    rate, why = rc.decide([_report(n, size, 0.005, 264, 0.031)])
    assert rate == pytest.approx(0.95 * 264 * size * 8 / 1e6 / 0.031, rel=1e-6), why
    # two receivers, one of only 3 datagrams: the stretched one alone decides
    rc = RateController(max_rate_mbit=1000.0)
    rate, _ = rc.decide([_report(n, size, 0.005, n, 0.05), _report(3, size, 0.001, 3, 0.02)])
    assert rate == pytest.approx(0.95 * delivered_mbit, rel=1e-6)


def test_short_windows_of_a_few_datagrams_or_without_congestion_keep_the_rate() -> None:
    """2-3 datagrams stretched by a delay or one lost are noise; a short window that shows no
    queue is no evidence for a higher rate. Neither changes the rate."""
    size = 1400
    rc = RateController(max_rate_mbit=1000.0, initial_rate_mbit=500.0)
    for rep in (
        _report(3, size, 0.001, 3, 0.02),  # 20x stretched, 3 datagrams
        _report(2, size, 0.0005, 2, 0.015),
        _report(3, size, 0.001, 2, 0.001),  # 1 of 3 lost: 33% > congestion_loss
        _report(440, size, 0.005, 440, 0.0055),  # 440 datagrams, no queue
        _report(200, size, 0.004, 0, 0.0),  # nothing arrived (an outage): no window
    ):
        rate, why = rc.decide([rep])
        assert rate == 500.0 and why == "no report with a rate signal: rate kept", (rep, why)
    assert rc.bottleneck_mbit is None and rc.base_loss is None
    # min_datagrams is the line: 16 arrived count, 15 do not
    assert RateController(max_rate_mbit=1000.0).decide([_report(15, size, 0.001, 15, 0.02)])[0] == 1000.0
    assert RateController(max_rate_mbit=1000.0).decide([_report(16, size, 0.001, 16, 0.02)])[0] == pytest.approx(
        0.95 * 16 * size * 8 / 1e6 / 0.02
    )


def test_after_a_short_window_cut_the_rate_settles_at_the_bottleneck() -> None:
    """A small model's rounds through a 100 Mbit/s link with a deep queue, from the
    1000 Mbit/s ceiling: the first round cuts the rate to ~95; from then on the trains last
    ~50 ms (long windows) and the rate probes up until the queue shows again (beyond
    ``(1 + queue_tolerance) x`` the send window plus ``jitter_s``: ~1.25x the link here)."""
    n, size, capacity_mbit = 440, 1400, 100.0
    rc = RateController(max_rate_mbit=1000.0)
    rates = []
    for _ in range(10):
        send_s = n * size * 8 / 1e6 / rc.rate_mbit
        recv_s = max(send_s, n * size * 8 / 1e6 / capacity_mbit)
        rates.append(rc.decide([_report(n, size, send_s, n, recv_s)])[0])
    assert rates[0] == pytest.approx(95.0, rel=1e-6), rates
    assert all(0.9 * capacity_mbit <= r <= 1.3 * capacity_mbit for r in rates), rates


def test_the_send_window_is_the_trains_paced_time() -> None:
    """The pacer lets two bursts (2 x 64 KiB) leave at once, so a 252 kB train at 97 Mbit/s
    measures a 10 ms send window though it takes 21 ms at the rate; arriving over 20 ms it
    is no queue (the rate probes up). Seen through netem: such trains read as a queue."""
    n, size = 180, 1400  # 252 kB: 20.8 ms at 97 Mbit/s
    rc = RateController(max_rate_mbit=1000.0, initial_rate_mbit=97.0)
    rc.bottleneck_mbit = 100.0  # after a first cut
    rate, why = rc.decide([_report(n, size, 0.010, n, 0.020)])
    assert rate == pytest.approx(1.05 * 100.0) and "probing up" in why, why
    # the same train at 53.6 Mbit/s: 38 ms at the rate, 15 ms measured: a long window, probing up
    rc = RateController(max_rate_mbit=1000.0, initial_rate_mbit=53.6)
    rc.bottleneck_mbit = 56.0
    rate, why = rc.decide([_report(n, size, 0.015, n, 0.038)])
    assert rate == pytest.approx(1.05 * 56.0) and "probing up" in why, why
    # a queue still shows: the train of 21 ms at the rate received over 40 ms
    rc = RateController(max_rate_mbit=1000.0, initial_rate_mbit=97.0)
    rate, why = rc.decide([_report(n, size, 0.009, n, 0.04)])
    assert rate == pytest.approx(0.95 * n * size * 8 / 1e6 / 0.04) and why.startswith("queue: received over 0.040 s")


def test_no_report_keeps_the_rate() -> None:
    rc = RateController(max_rate_mbit=50.0)
    assert rc.decide([])[0] == 50.0


def test_socket_buffers_follow_rate_and_rtt() -> None:
    assert socket_buffer_bytes(100.0, 0.08) == int(2 * 100e6 / 8 * 0.08)  # 2 MB
    assert socket_buffer_bytes(1.0, 0.001) == 256 << 10  # floor
    assert socket_buffer_bytes(100_000.0, 1.0) == 64 << 20  # ceiling
    assert socket_buffer_bytes(95.0, 0.08, stall_s=1.0) == int(95e6 / 8)  # the receive socket: 1 s of traffic
    assert socket_buffer_bytes(95.0, 0.08, stall_s=0.1) == int(2 * 95e6 / 8 * 0.08)  # never below 2 RTT


def test_the_receive_socket_holds_a_stall_of_traffic() -> None:
    from dtrain.transports.datagram import DatagramTransport

    t = DatagramTransport(DatagramTransportConfig(max_rate_mbit=95.0, rtt_s=0.08, recv_stall_s=1.0))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        t._size_buffers(s)
        # Linux doubles the value for its bookkeeping; without root it is capped by rmem_max
        got = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        cap = int(Path("/proc/sys/net/core/rmem_max").read_text()) if os.geteuid() else 1 << 40
        assert got >= min(cap, int(95e6 / 8)), got
    finally:
        s.close()
    with pytest.raises(ValueError, match="recv_stall_s"):
        DatagramTransportConfig(recv_stall_s=-1.0)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp16", "int8", "int4"])
def test_datagram_chunk_fits_exactly_one_datagram(codec: str) -> None:
    """The largest chunk that fits, in whole blocks for the blockwise codecs (one more block does not fit)."""
    chunk = datagram_chunk_bytes(codec, 1400)
    c = get_codec(codec)
    room = max_body_bytes(1400) - 8  # the mean's senders bitmap of 64 members
    step = getattr(c, "_bs", 1) if codec in ("int8", "int4") else 2
    assert HEADER_BYTES + c._body_bytes(chunk // 4) <= room < HEADER_BYTES + c._body_bytes(chunk // 4 + step)
    if codec in ("int8", "int4"):
        assert (chunk // 4) % c._bs == 0


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="zstd"):
        datagram_chunk_bytes("int8+zstd")
    with pytest.raises(ValueError, match="max_datagram_bytes"):
        DatagramTransportConfig(max_datagram_bytes=100)
    with pytest.raises(ValueError, match="min_rate_mbit"):
        DatagramTransportConfig(max_rate_mbit=1.0, min_rate_mbit=2.0)
    with pytest.raises(ValueError, match="test_drop"):
        DatagramTransportConfig(test_drop=1.0)


def test_worker_config_data_path() -> None:
    from dtrain.app.config import WORKER

    with pytest.raises(ValueError, match="data_path"):
        WORKER.build({"net.data_path": "udp"})
    cfg = WORKER.build({"net.data_path": "datagram", "diloco.rounds.codec.name": "int8"})
    assert cfg.diloco_config().buckets.chunk_bytes == datagram_chunk_bytes("int8")
    assert WORKER.build({}).diloco_config().buckets.chunk_bytes == 1 << 20
    with pytest.raises(ValueError, match="data_path 'datagram'"):
        WORKER.build({"data_path": "datagram", "codec": "int8+zstd"})
    # jumbo frames: a chunk fills an 8,900-byte datagram (6.4x the elements of a 1,400-byte one)
    jumbo = WORKER.build({"data_path": "datagram", "codec": "int8", "max_datagram_bytes": 8900})
    assert jumbo.diloco_config().buckets.chunk_bytes == datagram_chunk_bytes("int8", 8900)
    assert datagram_chunk_bytes("int8", 8900) > 6 * datagram_chunk_bytes("int8")
    for bad in (100, 70000, 1400.5, True):
        with pytest.raises(ValueError, match=r"max_datagram_bytes.*\[256, 65507\]"):
            WORKER.build({"max_datagram_bytes": bad})


def test_datagram_size_for_an_mtu_and_the_worker_passes_it_to_its_transport() -> None:
    from dtrain.app.config import WORKER
    from dtrain.app.worker import _transport_and_rendezvous
    from dtrain.transports.datagram import max_datagram_bytes_for_mtu

    assert max_datagram_bytes_for_mtu(1500) == DatagramTransportConfig().max_datagram_bytes == 1400
    assert max_datagram_bytes_for_mtu(9000) == 8900
    for bad in (300, 70000):
        with pytest.raises(ValueError, match=r"mtu_bytes must be in \[356, 65607\], got " + str(bad)):
            max_datagram_bytes_for_mtu(bad)
    cfg = WORKER.build({"data_path": "datagram", "codec": "int8", "max_datagram_bytes": 8900})
    transport, rendezvous = _transport_and_rendezvous(cfg)  # nothing bound or dialled until started
    try:
        assert transport.config.max_datagram_bytes == 8900 and transport._batch_datagrams == 7
    finally:
        rendezvous.close()


def test_a_paced_send_stays_within_the_burst_whatever_the_datagram_size() -> None:
    from dtrain.transports.datagram import DatagramTransport

    assert DatagramTransport(DatagramTransportConfig())._batch_datagrams == 46  # 46 x 1,400 B <= 64 KiB
    t = DatagramTransport(DatagramTransportConfig(max_datagram_bytes=8900))
    assert t._batch_datagrams == 7 and 7 * 8900 <= t.config.burst_bytes
    assert DatagramTransport(DatagramTransportConfig(max_datagram_bytes=65507))._batch_datagrams == 1


def test_yield_decision_lets_a_second_class_send_go_only_in_a_gap() -> None:
    from dtrain.transports.pacing import yield_decision

    # a first-class reservation due at t=10.0: a mean waits until 5 ms after it
    assert yield_decision(now=9.99, first_due=10.0, gap_s=0.005, deadline=20.0) == (
        pytest.approx(0.015),
        "first-class sends pending",
    )
    assert yield_decision(now=10.006, first_due=10.0, gap_s=0.005, deadline=20.0) == (
        0.0,
        "no first-class send pending",
    )
    # never past the deadline: there it goes regardless
    assert yield_decision(now=9.99, first_due=10.0, gap_s=0.005, deadline=10.0) == (
        pytest.approx(0.01),
        "first-class sends pending",
    )
    assert yield_decision(now=10.0, first_due=30.0, gap_s=0.005, deadline=10.0) == (0.0, "deadline reached")
    # no first-class send ever: at once
    assert yield_decision(now=1.0, first_due=float("-inf"), gap_s=0.005, deadline=2.0)[0] == 0.0


def test_a_second_class_send_waits_while_first_class_sends_stream() -> None:
    """A thread streaming first-class batches (contributions) keeps a second-class send (a mean)
    waiting until it stops; the second-class send then goes, and nothing is lost."""
    import threading

    from dtrain.transports.pacing import Pacer

    # 1 MB/s: a 1,000-byte batch every 1 ms; a 1 s gap, so a loaded machine's scheduling
    # pauses in the stream are not mistaken for its end
    p = Pacer(8.0, burst_bytes=1000, yield_gap_s=1.0)
    order: list[str] = []
    first_done = threading.Event()

    def first() -> None:
        for _ in range(20):
            assert p.wait(1000, deadline=time.monotonic() + 10)
            order.append("first")
        first_done.set()

    t = threading.Thread(target=first)
    t.start()
    while not order:  # the stream has begun
        time.sleep(0.001)
    assert p.wait(1000, deadline=time.monotonic() + 10, second=True)
    order.append("second")
    t.join()
    assert first_done.is_set() and order.count("first") == 20
    assert order.index("second") == 20, order  # it went after the stream, not between its batches
    assert p.num_yields >= 1 and p.num_sends == 21
