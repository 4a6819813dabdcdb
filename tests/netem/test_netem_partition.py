"""Partitions: explicit (per site and per pair) and periodic (the flaky profile)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from netem import Topology
from netem._rules import flap_down_sites

pytestmark = pytest.mark.netem


def _connect(topo: Topology, src: int, dst_addr: tuple[str, int], timeout_s: float) -> socket.socket:
    s = topo.socket(src)
    s.settimeout(timeout_s)
    try:
        s.connect(dst_addr)
    except BaseException:
        s.close()
        raise
    return s


def _udp_reaches(topo: Topology, src: int, dst: int, *, tries: int = 5, wait_s: float = 0.3) -> bool:
    """True when one of ``tries`` datagrams from ``src`` arrives at ``dst``."""
    with (
        topo.socket(dst, socket.AF_INET, socket.SOCK_DGRAM) as rx,
        topo.socket(src, socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        rx.bind((topo.address(dst), 0))
        rx.settimeout(wait_s)
        for _ in range(tries):
            tx.sendto(b"x", rx.getsockname())
            try:
                rx.recv(16)
                return True
            except socket.timeout:
                continue
    return False


@pytest.mark.timeout(40)
def test_partition_blocks_new_and_existing_connections_and_lifting_restores():
    with Topology(3, "lan") as topo:
        topo.set_link(None, delay_ms=5.0)
        srv = topo.socket(1)
        srv.bind((topo.address(1), 0))
        srv.listen(4)
        srv.settimeout(5.0)
        addr = srv.getsockname()
        cli = _connect(topo, 0, addr, 5.0)
        conn, _ = srv.accept()
        conn.settimeout(5.0)
        cli.sendall(b"hello")
        assert conn.recv(16) == b"hello"

        topo.partition(1, True)
        assert topo.partitions() == {(0, 1), (1, 2)}
        # existing connection: data sent now does not arrive
        cli.sendall(b"during")
        conn.settimeout(1.0)
        with pytest.raises(socket.timeout):
            conn.recv(16)
        # new connection: times out
        with pytest.raises((socket.timeout, TimeoutError)):
            _connect(topo, 0, addr, 1.0).close()
        # other sites are unaffected
        assert _udp_reaches(topo, 0, 2) and _udp_reaches(topo, 2, 0)
        assert not _udp_reaches(topo, 2, 1, tries=2)

        topo.partition(1, False)
        assert topo.partitions() == set()
        conn.settimeout(8.0)  # TCP retransmits with backoff: the data arrives
        assert conn.recv(16) == b"during"
        new = _connect(topo, 0, addr, 5.0)
        extra, _ = srv.accept()
        new.sendall(b"again")
        extra.settimeout(5.0)
        assert extra.recv(16) == b"again"
        for s in (new, extra, cli, conn, srv):
            s.close()


@pytest.mark.timeout(30)
def test_partition_between_one_pair_only():
    with Topology(3, "lan") as topo:
        topo.partition(0, True, peers=[1])
        assert topo.partitions() == {(0, 1)}
        assert not _udp_reaches(topo, 0, 1, tries=2)
        assert not _udp_reaches(topo, 1, 0, tries=2)
        assert _udp_reaches(topo, 0, 2) and _udp_reaches(topo, 1, 2)
        topo.partition(1, False)  # lifting from the other side removes the pair too
        assert topo.partitions() == set()
        assert _udp_reaches(topo, 0, 1)


@pytest.mark.timeout(40)
def test_flaky_outages_follow_the_schedule():
    period_s, down_s, probe_s = 1.5, 0.4, 0.01
    with Topology(3, "flaky") as topo:
        topo.set_link(None, flap_period_s=period_s, flap_down_s=down_s, loss_pct=0.0)
        links = [topo.link(i) for i in range(3)]
        epoch = topo.flap_epoch
        received: set[int] = set()
        sent_at: list[float] = []
        with (
            topo.socket(0, socket.AF_INET, socket.SOCK_DGRAM) as rx,
            topo.socket(1, socket.AF_INET, socket.SOCK_DGRAM) as tx,
        ):
            rx.bind((topo.address(0), 0))
            rx.settimeout(0.05)
            stop = threading.Event()

            def receive() -> None:
                while not stop.is_set():
                    try:
                        received.add(int.from_bytes(rx.recv(16)[:4], "big"))
                    except socket.timeout:
                        pass

            t = threading.Thread(target=receive, daemon=True)
            t.start()
            start = time.monotonic()
            for seq in range(int(2 * period_s / probe_s)):
                delay = start + seq * probe_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent_at.append(time.time())
                tx.sendto(seq.to_bytes(4, "big"), rx.getsockname())
            time.sleep(0.3)
            stop.set()
            t.join(2.0)
        stats = topo.stats()
    # A probe from site 1 to site 0 is lost while site 0 or site 1 is in an outage.
    # Probes within 60 ms of an outage edge are not judged (rule update + 15 ms delay).
    inside = outside = lost_inside = lost_outside = 0
    for seq, ts in enumerate(sent_at):
        states = {bool({0, 1} & set(flap_down_sites(links, epoch, ts + dt))) for dt in (-0.06, 0.0, 0.06)}
        if len(states) > 1:
            continue
        if states.pop():
            inside += 1
            lost_inside += seq not in received
        else:
            outside += 1
            lost_outside += seq not in received
    report = f"inside outages {lost_inside}/{inside} lost, outside {lost_outside}/{outside} lost; agent {stats}"
    print(report)
    assert inside >= 60 and outside >= 60, report  # both sites' outages were sampled
    assert lost_inside >= 0.95 * inside, report
    assert lost_outside <= 0.02 * outside, report
