"""The delay backends: the compiled NFQUEUE delayer (``nfqueue-c``) and its Python fallback.

Build tests need no root; the others (marked ``netem``) build topologies.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import statistics
import struct
import time
from pathlib import Path

import pytest

from netem import Topology, _cdelay
from netem.measure import ping

HAVE_TOOLCHAIN = shutil.which("gcc") is not None and Path("/usr/include/libnetfilter_queue").is_dir()
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: kernel receive time as a struct timespec


def needs_toolchain(fn):
    """Skip without gcc + libnetfilter_queue headers; fail instead in CI (DTRAIN_NETEM_REQUIRED=1,
    where netem/ci_setup.sh installed them), so the compiled delayer cannot go untested there."""
    if HAVE_TOOLCHAIN:
        return fn
    if os.environ.get("DTRAIN_NETEM_REQUIRED") == "1":
        return pytest.mark.usefixtures("_toolchain_required")(fn)
    return pytest.mark.skip(reason="gcc or libnetfilter_queue headers missing")(fn)


@pytest.fixture
def _toolchain_required():
    pytest.fail("gcc or libnetfilter_queue headers missing (DTRAIN_NETEM_REQUIRED=1; run netem/ci_setup.sh)")


@pytest.fixture
def default_env(monkeypatch):
    """The default delayer choice (compiled where it builds), whatever this shell sets."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(_cdelay.DELAYER_ENV, raising=False)


@pytest.fixture
def own_cache(tmp_path, monkeypatch, default_env):
    """An empty build cache (a compile each time: only for the build tests)."""
    monkeypatch.setenv("DTRAIN_NETEM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---------------------------------------------------------------- building (no root)
@needs_toolchain
@pytest.mark.timeout(120)
def test_build_compiles_once_and_reuses_the_cached_binary(own_cache):
    first = _cdelay.build_delayer()
    assert first is not None and first.parent == own_cache and os.access(first, os.X_OK)
    mtime = first.stat().st_mtime_ns
    assert _cdelay.build_delayer() == first
    assert first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in own_cache.iterdir()] == [first.name]  # no temporary files left


@pytest.mark.timeout(30)
def test_build_failure_returns_none_and_says_why(own_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="netem._cdelay"):
        assert _cdelay.build_delayer() is None
    assert "falling back to the Python delayer" in caplog.text and "/bin/false" in caplog.text, caplog.text
    assert not own_cache.exists() or list(own_cache.iterdir()) == []


@pytest.mark.timeout(30)
def test_python_delayer_can_be_forced(own_cache, monkeypatch):
    monkeypatch.setenv(_cdelay.DELAYER_ENV, "python")
    assert _cdelay.build_delayer() is None
    assert not own_cache.exists()  # nothing compiled


# ---------------------------------------------------------------- topologies (root)
def _rtt_ok(measured_ms: float, one_way_ms: float) -> bool:
    """Within 10% (+2 ms) of twice the one-way delay (as test_netem_links)."""
    return abs(measured_ms - 2 * one_way_ms) <= 0.2 * one_way_ms + 2.0


@needs_toolchain
@pytest.mark.netem
@pytest.mark.timeout(60)
def test_compiled_delayer_is_chosen_and_delays(default_env):
    with Topology(2, "lan") as topo:
        assert topo.backends()["delay"] == "nfqueue-c" and topo.backends()["jitter"] == "nfqueue-c"
        topo.set_link(None, delay_ms=15.0)
        rtt = ping(topo, 0, 1, count=20, interval_s=0.01)
        stats = topo.stats()
        agent_pid, delayer_pid = stats["pid"], stats["delayer_pid"]
        assert _ppid(delayer_pid) == agent_pid
        assert os.sched_getscheduler(delayer_pid) == os.SCHED_FIFO  # inherited from the agent
    assert _rtt_ok(rtt.avg_ms, 15.0), (rtt, stats)
    # 20 echo requests delayed towards site 1 and 20 replies towards site 0
    assert [s["delayed"] for s in stats["sites"]] == [20, 20], stats
    assert all(s["held"] == 0 and s["overflow"] == 0 and s["max_held"] >= 1 for s in stats["sites"]), stats
    assert not _alive(delayer_pid, b"netem-delayer")  # closed with the topology


@pytest.mark.netem
@pytest.mark.timeout(60)
def test_fallback_is_named_when_the_compile_fails(own_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="netem._cdelay"):
        with Topology(2, "lan") as topo:
            assert topo.backends()["delay"] == "nfqueue-userspace"
            topo.set_link(None, delay_ms=10.0)
            rtt = ping(topo, 0, 1, count=10, interval_s=0.01)
            stats = topo.stats()
    assert "falling back to the Python delayer" in caplog.text, caplog.text
    assert stats["delayer_pid"] is None and [s["delayed"] for s in stats["sites"]] == [10, 10], stats
    assert _rtt_ok(rtt.avg_ms, 10.0), rtt


@needs_toolchain
@pytest.mark.netem
@pytest.mark.timeout(60)
def test_compiled_delayer_dies_with_its_agent(default_env):
    with Topology(2, "lan") as topo:
        topo.set_link(None, delay_ms=5.0)
        stats = topo.stats()
        agent_pid, delayer_pid = stats["pid"], stats["delayer_pid"]
        assert _alive(delayer_pid, b"netem-delayer")
        os.kill(agent_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _alive(delayer_pid, b"netem-delayer") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(delayer_pid, b"netem-delayer"), "the delayer outlived its SIGKILLed agent"
        assert topo.stats() == {"agent": None}
    # leaving the block removes the rest; the guard fixture checks nothing is left


@pytest.mark.netem
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["nfqueue-c", "nfqueue-userspace"])
def test_jitter_is_applied_and_packets_stay_in_order(default_env, monkeypatch, backend):
    """Sparse probes (10 ms apart, jitter ±5 ms) see the whole jitter range; a dense burst
    (500 datagrams sent back to back) arrives in send order. Kernel receive timestamps, so
    a slow receiver cannot change the measured delays."""
    _select_delayer(backend, monkeypatch)
    with Topology(2, "lan") as topo:
        assert topo.backends()["delay"] == backend
        topo.set_link(1, delay_ms=20.0, jitter_ms=5.0)
        delays_ms, order = _send_and_receive(topo, num_sparse=100, num_dense=500)
    assert len(delays_ms) == 100 and sorted(order) == list(range(500)), (len(delays_ms), len(order))
    assert order == list(range(500)), "reordered"
    assert min(delays_ms) >= 15.0 - 0.3, delays_ms  # load can only lengthen a delay
    assert max(delays_ms) - min(delays_ms) >= 4.0, delays_ms  # the jitter is there
    assert statistics.median(delays_ms) <= 25.0 + 2.0, delays_ms


@pytest.mark.netem
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["nfqueue-c", "nfqueue-userspace"])
def test_held_packets_are_bounded_per_site(default_env, monkeypatch, backend):
    """With the bound at 50 and a 1 s delay, a burst of 200 datagrams keeps 50: the kernel drops the rest."""
    _select_delayer(backend, monkeypatch)
    monkeypatch.setenv("DTRAIN_NETEM_MAX_QUEUE_LEN", "50")  # read by the agent at start
    with Topology(2, "lan") as topo:
        assert topo.backends()["delay"] == backend
        topo.set_link(1, delay_ms=1000.0)
        rx = topo.socket(1, socket.AF_INET, socket.SOCK_DGRAM)
        tx = topo.socket(0, socket.AF_INET, socket.SOCK_DGRAM)
        with rx, tx:
            rx.bind((topo.address(1), 0))
            for i in range(200):
                tx.sendto(struct.pack("!I", i), rx.getsockname())
            held = topo.stats()["sites"][1]
            received = []
            rx.settimeout(3.0)
            while len(received) < 200:
                try:
                    received.append(struct.unpack("!I", rx.recv(64)[:4])[0])
                except TimeoutError:
                    break
                rx.settimeout(0.5)  # after the first, the held ones follow at once
    assert held["held"] == 50 and held["max_held"] == 50, held
    assert received == list(range(50)), received  # the first 50, in order; the rest dropped


@pytest.mark.netem
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["nfqueue-c", "nfqueue-userspace"])
def test_reordering_holds_back_a_share_of_the_packets(default_env, monkeypatch, backend):
    """reorder_pct=20, reorder_gap_ms=10 on a 5 ms link: about a fifth of 400 datagrams sent 0.5 ms
    apart arrive after later ones (each held 10 ms more: overtaken by ~20), none is lost, and the
    delayer counts the packets it held back."""
    _select_delayer(backend, monkeypatch)
    with Topology(2, "lan") as topo:
        assert topo.backends()["reorder"] == backend
        topo.set_link(1, delay_ms=5.0, reorder_pct=20.0, reorder_gap_ms=10.0)
        rx = topo.socket(1, socket.AF_INET, socket.SOCK_DGRAM)
        tx = topo.socket(0, socket.AF_INET, socket.SOCK_DGRAM)
        with rx, tx:
            rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            rx.bind((topo.address(1), 0))
            for i in range(400):
                tx.sendto(struct.pack("!I", i), rx.getsockname())
                time.sleep(0.0005)
            time.sleep(0.3)
            rx.setblocking(False)
            order = []
            while True:
                try:
                    order.append(struct.unpack("!I", rx.recv(64)[:4])[0])
                except BlockingIOError:
                    break
        held_back = topo.stats()["sites"][1]["reordered"]
    assert sorted(order) == list(range(400)), "lost or duplicated"
    overtaken = sum(1 for pos, i in enumerate(order) if i < max(order[: pos + 1]))
    assert 40 <= overtaken <= 120, overtaken  # 20% of 400 = 80 (binomial sd 8)
    assert overtaken - 3 <= held_back <= overtaken + 3, (held_back, overtaken)  # the last few may not be overtaken


def _select_delayer(backend: str, monkeypatch) -> None:
    """Make the next Topology use ``backend`` (the compiled one needs the toolchain)."""
    if backend == "nfqueue-userspace":
        monkeypatch.setenv(_cdelay.DELAYER_ENV, "python")
    elif not HAVE_TOOLCHAIN:
        if os.environ.get("DTRAIN_NETEM_REQUIRED") == "1":
            pytest.fail("gcc or libnetfilter_queue headers missing (DTRAIN_NETEM_REQUIRED=1)")
        pytest.skip("gcc or libnetfilter_queue headers missing")


def _send_and_receive(topo: Topology, *, num_sparse: int, num_dense: int) -> tuple[list[float], list[int]]:
    rx = topo.socket(1, socket.AF_INET, socket.SOCK_DGRAM)
    tx = topo.socket(0, socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        rx.bind((topo.address(1), 0))
        dest = rx.getsockname()
        sent_at = []
        for i in range(num_sparse):
            time.sleep(0.01)
            sent_at.append(time.time())
            tx.sendto(struct.pack("!II", 0, i), dest)
        for i in range(num_dense):
            tx.sendto(struct.pack("!II", 1, i), dest)
        time.sleep(0.5)
        rx.setblocking(False)
        delays_ms, order = [], []
        for _ in range(num_sparse + num_dense):
            try:
                data, anc, _, _ = rx.recvmsg(64, 64)
            except BlockingIOError:
                break
            kind, i = struct.unpack("!II", data[:8])
            if kind == 1:
                order.append(i)
                continue
            sec, nsec = struct.unpack("qq", anc[0][2][:16])
            delays_ms.append((sec + nsec / 1e9 - sent_at[i]) * 1000)
    return delays_ms, order


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
