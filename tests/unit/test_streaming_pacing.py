"""Pacing of fragment rounds (issue 15): the pure pacing decision, the window a round's
sends spread over, and a paced 2-site run whose sends waited (a count) yet ends with θ
equal to the unpaced run's."""

from __future__ import annotations

import time

import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.configs import DiLoCoConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config
from dtrain.state import GlobalState
from dtrain.streaming import StreamingSync, pace_window_s
from dtrain.transports.pacing import pace_decision, pace_rate_Bps

pytestmark = pytest.mark.timeout(60)


def test_pace_decision_waits_for_the_bytes_over_budget():
    kw = dict(rate_Bps=1000.0, burst_bytes=100, deadline=10.0)
    # within one burst: at once; the clock advances by the bytes' time at the rate
    d = pace_decision(50, clock_s=0.0, now=0.0, **kw)
    assert d.send and d.wait_s == 0.0 and d.clock_s == pytest.approx(0.05)
    # 500 bytes at 1000 B/s leave one burst (0.1 s) before they are due at 0.5 s
    d = pace_decision(500, clock_s=0.0, now=0.0, **kw)
    assert d.send and d.wait_s == pytest.approx(0.4) and d.clock_s == pytest.approx(0.5)
    # after an idle period the pacer lends one burst, not the idle time
    d = pace_decision(300, clock_s=-10.0, now=0.0, **kw)
    assert d.wait_s == pytest.approx(0.1) and d.clock_s == pytest.approx(0.2)
    # due after the deadline: nothing reserved
    d = pace_decision(20_000, clock_s=0.0, now=0.0, **kw)
    assert not d.send and d.clock_s == 0.0 and "deadline" in d.reason


def test_back_to_back_sends_wait_once_the_burst_is_spent():
    clock, waits = 0.0, 0
    for _ in range(10):  # ten 100-byte sends issued at t = 0 (a burst is 100 bytes)
        d = pace_decision(100, rate_Bps=1000.0, clock_s=clock, now=0.0, burst_bytes=100, deadline=10.0)
        clock, waits = d.clock_s, waits + (d.wait_s > 0)
    assert waits == 9 and clock == pytest.approx(1.0)


def test_rate_budget_is_bytes_over_the_window():
    assert pace_rate_Bps(4e6, 2.0) == 2e6
    assert pace_rate_Bps(10, 2.0) == 1e5  # the floor: a tiny estimate never stalls a round
    with pytest.raises(ValueError, match="window_s"):
        pace_rate_Bps(1, 0.0)


def test_pace_window_is_the_fraction_of_tau_steps():
    assert pace_window_s(overlap_steps=4, step_s=0.2, pace_fraction=0.5) == pytest.approx(0.4)
    assert pace_window_s(overlap_steps=0, step_s=0.2, pace_fraction=0.5) is None  # blocking: unpaced
    assert pace_window_s(overlap_steps=4, step_s=None, pace_fraction=0.5) is None  # no step measured yet
    assert pace_window_s(overlap_steps=4, step_s=0.2, pace_fraction=0.0) is None  # pacing off
    with pytest.raises(ValueError, match="pace_fraction"):
        DiLoCoConfig(pace_fraction=1.0)


def _deferred():
    from dtrain.rounds.outcome import RoundStatus, SyncOutcome

    return SyncOutcome(status=RoundStatus.DEFERRED, reason="test")


def test_streaming_sync_passes_a_window_with_overlap_and_none_when_blocking():
    windows: list[float | None] = []

    def sync(tensors, *, buckets, fragment, pace_window_s, tokens=0):
        windows.append(pace_window_s)
        return _deferred()

    cfg = DiLoCoConfig(sync_every=4, buckets=BucketConfig(bucket_bytes=4, chunk_bytes=4))
    for tau, want_paced in ((2, True), (0, False)):
        w = torch.zeros(2)
        layout = BucketLayout([2], ["param"], cfg.buckets)
        st = GlobalState(layout, [w])
        ss = StreamingSync(
            sync,
            "s",
            layout,
            st,
            lambda: [w],
            sync_every=4,
            num_fragments=2,
            overlap_steps=tau,
            merge_alpha=0.0,
            pace_fraction=0.5,
        )
        windows.clear()
        for step in range(1, 7):
            time.sleep(0.01)
            ss.on_step(step)
        ss.close()
        assert len(windows) == 3  # rounds at steps 2, 4, 6
        assert all((x is not None and x > 0) == want_paced for x in windows), windows
        assert ss.num_paced_rounds == (3 if want_paced else 0)


def _run(pace_fraction: float, tau: int) -> tuple[list[torch.Tensor], list[int]]:
    """2 sites, a 1 MiB model in 8 buckets of 16 KiB chunks, F = 2: θ and each site's pacer waits."""
    torch.manual_seed(0)
    cfg = ClusterConfig(
        num_sites=2,
        diloco=fast_diloco_config(
            sync_every=4,
            buckets=BucketConfig(bucket_bytes=128 << 10, chunk_bytes=16 << 10),
            num_fragments=2,
            overlap_steps=tau,
            merge_alpha=0.5,
            pace_fraction=pace_fraction,
        ),
    )
    cluster = InprocCluster(lambda: torch.nn.Linear(512, 512), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), cfg)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]

    def step(site: Site, k: int) -> None:
        time.sleep(0.05)  # τ = 2 steps of 0.05 s: the window is 0.05 s at pace_fraction 0.5
        loss = (site.model(torch.randn(4, 512, generator=gens[site.index])) ** 2).mean()
        loss.backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    with cluster:
        cluster.run_steps(step, 8, timeout_s=40)
        for s in cluster.sites:
            s.diloco.close()
        assert len(set(cluster.checksums())) == 1
        pacers = [s.diloco.engine.last_pacer for s in cluster.sites]
        return [s.theta() for s in cluster.sites], [p.num_waits if p is not None else -1 for p in pacers]


def test_a_paced_fragment_round_spreads_its_sends_and_changes_no_value():
    theta, waits = _run(0.5, tau=2)
    # 512 KiB a site per fragment round (256 KiB of chunks pushed, 256 KiB of means served) over
    # 0.05 s: far above one 64 KiB burst, so most 16 KiB chunk sends waited for the budget
    assert min(waits) >= 8, waits
    theta0, waits0 = _run(0.0, tau=2)
    assert waits0 == [-1, -1]  # pacing off: no pacer
    for a, b in zip(theta, theta0):
        assert torch.equal(a, b)  # pacing moves when bytes leave, never what they are


def test_blocking_rounds_are_never_paced():
    _, waits = _run(0.5, tau=0)
    assert waits == [-1, -1]
