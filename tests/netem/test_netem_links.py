"""Emulated links measured against every profile: RTT, one-way loss, TCP goodput."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from netem import PROFILES, Topology, probe
from netem.measure import UdpLoss, binomial_interval, ping, tcp_goodput_mbit, udp_loss

pytestmark = pytest.mark.netem

GOODPUT_CAP_MBIT = 40.0  # modest cap so the goodput check is quick on 2 cores
NUM_LOSS_PROBES = 2000


def _loss_in_interval(
    topo: Topology, loss_pct: float, drain_s: float, *, segments: int = 1, interval_s: float = 0.0005
) -> tuple[bool, list[UdpLoss]]:
    """One-way loss of 2,000 probes (``segments`` a write: :func:`~netem.measure.udp_loss`)
    inside the binomial 99% interval of ``loss_pct``; every batch's counts.

    A second batch is sent only if the first falls outside, so a correct link fails
    with probability ~1e-4 instead of 1e-2 per check, while a wrong loss rate still
    fails both batches.
    """
    lo, hi = binomial_interval(NUM_LOSS_PROBES, loss_pct / 100, 0.99)
    tries = []
    for _ in range(2):
        r = udp_loss(topo, 0, 1, count=NUM_LOSS_PROBES, interval_s=interval_s, drain_s=drain_s, segments=segments)
        tries.append(r)
        if lo <= r.sent - r.received <= hi:
            return True, tries
    return False, tries


def _goodput_in_band(topo: Topology) -> tuple[bool, list[float]]:
    """TCP goodput within 15% of ``GOODPUT_CAP_MBIT`` (the cap set on every link).

    As with the loss probes, a second measurement is made only if the first falls outside:
    the delayer releases packets from user space, and on a loaded host it ran late (CI:
    3,550 packets more than 1 ms late, up to 17 ms on a 15 ms one-way delay), which cut one
    3.5 s BBR measurement to 30.5 Mbit/s. A link whose rate is wrong fails both."""
    tries: list[float] = []
    for _ in range(2):
        tries.append(tcp_goodput_mbit(topo, 0, 1, duration_s=3.5, warmup_s=1.0))
        if abs(tries[-1] - GOODPUT_CAP_MBIT) <= 0.15 * GOODPUT_CAP_MBIT:
            return True, tries
    return False, tries


def _rtt_ok(measured_ms: float, one_way_ms: float) -> bool:
    """Within 10% (+2 ms) of twice the one-way delay (the issue's criterion)."""
    expected = 2 * one_way_ms
    return abs(measured_ms - expected) <= 0.1 * expected + 2.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_rtt_loss_goodput(profile):
    link = PROFILES[profile].link
    with Topology(2, profile) as topo:
        if link.flap_period_s:  # outages are tested in test_partition.py; measure the link
            topo.set_link(None, flap_period_s=0.0, flap_down_s=0.0)
        if link.needs_delay:
            assert topo.backends()["delay"] in ("nfqueue-c", "nfqueue-userspace", "netem")
        rtt = ping(topo, 0, 1, count=30, interval_s=0.01)
        loss_ok, loss_tries = _loss_in_interval(topo, link.loss_pct, drain_s=0.3 + 2 * link.delay_ms / 1000)
        goodput_ok, goodput = True, None
        if link.rate_mbit is not None and link.loss_pct <= 1.0:
            topo.set_link(None, rate_mbit=GOODPUT_CAP_MBIT)
            goodput_ok, goodput = _goodput_in_band(topo)
        stats = topo.stats()
    report = (
        f"{profile}: rtt avg {rtt.avg_ms:.2f} ms (want 2x{link.delay_ms}), "
        f"loss {loss_tries}, goodput {goodput} Mbit/s "
        f"(cap {GOODPUT_CAP_MBIT}); agent {stats}"
    )
    print(report)
    assert _rtt_ok(rtt.avg_ms, link.delay_ms), report
    assert loss_ok, report
    assert goodput_ok, report


@pytest.mark.timeout(30)
def test_delay_changes_while_traffic_flows():
    with Topology(2, "lan") as topo:
        argv = topo.exec_argv(0, ["ping", "-n", "-c", "120", "-i", "0.01", topo.address(1)])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        topo.set_link(None, delay_ms=20.0)
        out, _ = proc.communicate(timeout=20)
        assert topo.link(0).delay_ms == 20.0
        stats = topo.stats()
        if topo.backends()["delay"] == "nfqueue-c" and os.geteuid() == 0:
            # It must not wait behind the processes whose packets it holds (see delayer.c).
            assert os.sched_getscheduler(stats["delayer_pid"]) == os.SCHED_FIFO, stats
    rtts = [float(x) for x in re.findall(r"time=([\d.]+)", out)]
    assert len(rtts) >= 110, out[-500:]
    assert max(rtts[:20]) < 2.0, rtts[:20]  # before the change: plain veth RTT
    # The delayer's own count of late releases says whether a miss was its doing or the host's.
    off = [(len(rtts) - 40 + k, r) for k, r in enumerate(rtts[-40:]) if not _rtt_ok(r, 20.0)]
    assert not off, f"(ping seq, RTT ms) off 40 +- 6: {off} of {len(rtts)}; delayer: {stats}"


@pytest.mark.timeout(30)
def test_round_trip_is_the_sum_of_both_sites_delays():
    with Topology(3, "lan") as topo:
        topo.set_link(0, delay_ms=10.0)
        topo.set_link(1, delay_ms=30.0)
        assert topo.link(2).delay_ms == 0.0
        r01 = ping(topo, 0, 1, count=10)
        r12 = ping(topo, 1, 2, count=10)
        r02 = ping(topo, 0, 2, count=10)
    assert abs(r01.avg_ms - 40.0) <= 0.1 * 40 + 2, r01
    assert abs(r12.avg_ms - 30.0) <= 0.1 * 30 + 2, r12
    assert abs(r02.avg_ms - 10.0) <= 0.1 * 10 + 2, r02


@pytest.mark.timeout(40)
def test_iptables_fallback_for_loss_and_rate():
    if not probe().iptables_statistic:
        pytest.skip("iptables statistic match does not work here")
    with Topology(2, "lan", filter_backend="iptables") as topo:
        assert topo.backends()["loss"] == "iptables"
        topo.set_link(1, loss_pct=10.0)
        loss_ok, loss_tries = _loss_in_interval(topo, 10.0, drain_s=0.3)
        topo.set_link(None, loss_pct=0.0, rate_mbit=20.0)
        goodput = tcp_goodput_mbit(topo, 0, 1, duration_s=3.0, warmup_s=1.0)
    assert loss_ok, loss_tries
    assert abs(goodput - 20.0) <= 0.15 * 20.0, goodput


@pytest.mark.timeout(40)
def test_jumbo_links_carry_9000_byte_packets_whole_through_the_rate_cap_and_delay():
    """``mtu_bytes=9000``: a ping of 9,000 bytes with don't-fragment set crosses a rate-capped,
    delayed link (tbf's burst holds 16 such frames); one byte more is refused at the sender."""
    with Topology(2, "lan", mtu_bytes=9000) as topo:
        topo.set_link(None, delay_ms=5.0, rate_mbit=100.0)

        def ping_df(payload_bytes: int) -> subprocess.CompletedProcess:
            argv = ["ping", "-n", "-c", "5", "-i", "0.05", "-M", "do", "-s", str(payload_bytes), topo.address(1)]
            return subprocess.run(topo.exec_argv(0, argv), capture_output=True, text=True, timeout=20)

        whole = ping_df(9000 - 28)  # 20 B IPv4 + 8 B ICMP headers
        too_big = ping_df(9000 - 27)
    assert whole.returncode == 0 and " 0% packet loss" in whole.stdout, whole.stdout + whole.stderr
    rtts = [float(x) for x in re.findall(r"time=([\d.]+)", whole.stdout)]
    serialize_ms = 2 * 9014 * 8 / 100e6 * 1e3  # the frame at 100 Mbit/s, each way: 1.4 ms
    assert len(rtts) == 5 and all(10.0 <= r <= 10.0 + serialize_ms + 3.0 for r in rtts), rtts
    assert too_big.returncode != 0 and "mtu=9000" in (too_big.stdout + too_big.stderr), too_big.stdout + too_big.stderr


@pytest.mark.timeout(40)
def test_loss_falls_on_each_datagram_of_a_segmentation_offload_write():
    """The datagram data path sends 40 datagrams a ``UDP_SEGMENT`` write. With the veth's UDP
    segmentation offload on (``ethtool -K ... gso off`` leaves it on), the write crossed the hub
    as one 56 KB buffer and 10% loss dropped whole writes: 200 of 2,000 lost in 5 runs (a CI run
    of the datagram loss experiment lost nothing at all). Per datagram: about 180 runs."""
    with Topology(2, "lan") as topo:
        topo.set_link(1, loss_pct=10.0)
        loss_ok, tries = _loss_in_interval(topo, 10.0, drain_s=0.3, segments=40, interval_s=0.005)
    assert loss_ok, tries
    # independent loss: ~lost * 0.9 runs (sd ~4); whole writes: lost / 40
    r = tries[-1]
    assert r.lost_runs >= 0.75 * (r.sent - r.received), tries
