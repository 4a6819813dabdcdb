"""The phi accrual failure detector (``dtrain.rendezvous.accrual``) and the in-memory
store's use of it: per-site silences that follow each site's heartbeat arrivals."""

from __future__ import annotations

import math
import random

import pytest

from dtrain.protocol import HEARTBEATS_IN_FLIGHT
from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.accrual import AccrualConfig, ArrivalWindow, phi, silence_for_phi


@pytest.mark.parametrize("level", [1.0, 3.0, 8.0, 12.0])
def test_silence_for_phi_is_the_inverse_of_phi(level: float) -> None:
    t = silence_for_phi(level, mean_s=1.2, std_s=0.3)
    assert phi(t, mean_s=1.2, std_s=0.3) == pytest.approx(level, rel=1e-6)


def test_phi_grows_with_silence_and_is_0_3_at_the_mean() -> None:
    assert phi(1.0, mean_s=1.0, std_s=0.1) == pytest.approx(-math.log10(0.5))
    values = [phi(t, mean_s=1.0, std_s=0.1) for t in (0.5, 1.0, 1.2, 1.5, 2.0)]
    assert values == sorted(values) and values[-1] > 8


def test_a_regular_sender_is_declared_dead_after_mean_plus_pause_plus_a_few_min_stds() -> None:
    cfg = AccrualConfig()  # dead_phi 8, min_std 0.1 s, acceptable pause 3 s
    w = ArrivalWindow(cfg)
    for _ in range(50):
        w.add(1.0)
    # σ measured 0 -> min_std 0.1; Φ⁻¹(1 - 1e-8) = 5.612
    assert w.silence_s(8.0) == pytest.approx(1.0 + 3.0 + 0.1 * 5.612, abs=1e-3)
    assert w.phi(4.0) == pytest.approx(-math.log10(0.5))


def test_a_new_site_is_given_the_warmup_silence_until_its_window_has_seen_its_link() -> None:
    w = ArrivalWindow(AccrualConfig())  # warm-up: 30 gaps, at least 10 s
    for _ in range(29):
        w.add(1.0)
    assert w.silence_s(8.0) == 10.0
    w.add(1.0)
    assert w.silence_s(8.0) == pytest.approx(4.561, abs=1e-3)


def test_before_two_gaps_the_configured_interval_stands_for_the_arrivals() -> None:
    w = ArrivalWindow(AccrualConfig(first_interval_s=2.0))
    assert w.stats() == (2.0, 0.5)
    w.add(0.5)
    assert w.stats() == (2.0, 0.5)
    w.add(1.5)
    assert w.stats() == pytest.approx((1.0, 0.5))


def test_the_window_keeps_the_latest_gaps_only() -> None:
    w = ArrivalWindow(AccrualConfig(window=3))
    for g in (10.0, 10.0, 1.0, 1.0, 1.0):
        w.add(g)
    assert len(w) == 3 and w.stats() == pytest.approx((1.0, 0.0), abs=1e-6)


def _lossy_gaps(n: int, *, loss: float, connections: int, seed: int, rto_s: float = 0.2) -> list[float]:
    """Inter-arrival times at the rendezvous of heartbeats sent every second, each on the
    next of ``connections`` TCP connections, through a link losing each segment with
    probability ``loss``: a lost one arrives after 1, 2, 4... RTOs (Linux's exponential
    backoff) and the later heartbeats on its connection queue behind it (head-of-line)."""
    rng = random.Random(seed)
    last, arrivals = [0.0] * connections, []
    for i in range(n):
        t, rto = float(i), rto_s
        while rng.random() < loss:
            t += rto
            rto *= 2
        c = i % connections
        last[c] = max(last[c], t)
        arrivals.append(last[c])
    arrivals.sort()
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if b > a]


def _false_deaths(gaps: list[float]) -> int:
    """How many gaps exceeded the silence the detector allowed just before them."""
    cfg = RendezvousConfig(heartbeat_interval_s=1.0).accrual_for_sites()
    w, n = ArrivalWindow(cfg), 0
    for g in gaps:
        n += g > w.silence_s(cfg.dead_phi)
        w.add(g)
    return n


@pytest.mark.parametrize("loss", [0.1, 0.2])
def test_heartbeats_through_a_10_or_20_percent_loss_link_are_never_declared_dead(loss: float) -> None:
    for seed in range(20):
        assert _false_deaths(_lossy_gaps(3000, loss=loss, connections=HEARTBEATS_IN_FLIGHT, seed=seed)) == 0


def test_at_30_percent_loss_heartbeats_on_several_connections_are_almost_never_declared_dead() -> None:
    """20 x 3,000 heartbeats through a link losing 30% of segments: on one connection
    (head-of-line blocking behind each retransmission, stalls of up to 52 s) the detector
    would declare the site dead 113 times; with the Group's HEARTBEATS_IN_FLIGHT
    connections once (a 7.2 s stall: six losses of one segment in a row)."""
    one = sum(_false_deaths(_lossy_gaps(3000, loss=0.3, connections=1, seed=s)) for s in range(20))
    several = sum(
        _false_deaths(_lossy_gaps(3000, loss=0.3, connections=HEARTBEATS_IN_FLIGHT, seed=s)) for s in range(20)
    )
    assert one > 100, one
    assert several <= 1, several


def test_a_suspected_site_gets_the_floor_on_a_regular_link_and_its_own_tail_on_a_lossy_one() -> None:
    """Once a member found a site unreachable it is dead after the silence at which φ over its own
    arrivals reaches the suspect level (3), at least the floor (1.5 s): a LAN site's regular
    heartbeats give the floor (a killed one is dead that soon); at 30% loss the gaps spread, and
    the site gets their tail instead of being declared dead at the first 2 s gap."""
    cfg = RendezvousConfig(heartbeat_interval_s=1.0).accrual_for_sites()
    regular, lossy = ArrivalWindow(cfg), ArrivalWindow(cfg)
    assert regular.suspected_silence_s(3.0, floor_s=1.5) == 1.5  # warming up: the floor
    for _ in range(40):
        regular.add(1.0)
    assert regular.suspected_silence_s(3.0, floor_s=1.5) == 1.5
    for g in _lossy_gaps(200, loss=0.3, connections=HEARTBEATS_IN_FLIGHT, seed=1):
        lossy.add(g)
    mean, std = lossy.stats()
    got = lossy.suspected_silence_s(3.0, floor_s=1.5)
    assert got == pytest.approx(silence_for_phi(3.0, mean_s=mean, std_s=std)) and got > 2.0, (got, mean, std)
    assert got < lossy.silence_s(cfg.dead_phi)  # still sooner than an unsuspected site's death


def test_the_store_declares_a_regular_site_dead_once_its_phi_passes_8() -> None:
    core = RendezvousCore(RendezvousConfig(heartbeat_interval_s=1.0))
    core.join("a", "127.0.0.1:1", now=0.0)
    core.join("b", "127.0.0.1:2", now=0.0)
    for t in range(1, 41):  # past the warm-up (30 gaps)
        core.heartbeat("a", now=float(t))
        core.heartbeat("b", now=float(t))
    # b goes silent at t=40; a keeps heartbeating
    for t in range(41, 45):
        core.heartbeat("a", now=float(t))
    assert core.heartbeat("a", now=44.5).dead == ()  # 4.5 s of silence: φ < 8
    assert 3 < core.snapshot(44.5)["sites"]["b"]["phi"] < 8  # suspected, not dead
    core.heartbeat("a", now=45.0)
    assert core.heartbeat("a", now=45.0).dead == ("b",)  # 5 s: past μ + pause + 5.6 σ = 4.56 s
    row = core.snapshot(45.0)["sites"]["b"]
    assert not row["alive"] and row["phi"] > 8 and row["dead_after_s"] == pytest.approx(4.561, abs=1e-3)


def test_an_explicit_heartbeat_timeout_is_a_fixed_rule() -> None:
    core = RendezvousCore(RendezvousConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0))
    core.join("a", "127.0.0.1:1", now=0.0)
    core.join("b", "127.0.0.1:2", now=0.0)
    for t in range(1, 21):
        core.heartbeat("a", now=float(t))
        core.heartbeat("b", now=float(t))
    for t in range(21, 25):
        core.heartbeat("a", now=float(t))
    assert core.heartbeat("a", now=24.5).dead == ()  # b silent 4.5 s
    assert core.snapshot(24.5)["sites"]["b"]["phi"] is None
    core.heartbeat("a", now=25.0)
    assert core.heartbeat("a", now=25.6).dead == ("b",)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("dead_phi", 0.0, "dead_phi must be a finite number > 0"),
        ("suspect_phi", 9.0, r"suspect_phi must be in \(0, dead_phi=8.0\)"),
        ("window", 1, "window must be an int >= 2"),
        ("min_std_s", 0.0, "min_std_s must be a number of seconds > 0"),
        ("acceptable_pause_s", -1.0, "acceptable_pause_s must be a number of seconds >= 0"),
        ("warmup_silence_s", 40.0, r"warmup_silence_s must be in \[0, max_silence_s=30.0\]"),
    ],
)
def test_bad_accrual_settings_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AccrualConfig(**{field: value})


def test_a_heartbeat_timeout_not_above_the_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=r"heartbeat_timeout_s must be none \(the accrual detector\)"):
        RendezvousConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)
