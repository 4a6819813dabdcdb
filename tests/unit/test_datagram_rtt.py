"""The datagram path's measured round trip per peer (``dtrain.transports.datagram_rtt``):
RFC 6298's SRTT / RTTVAR / RTO."""

from __future__ import annotations

import pytest

from dtrain.transports.datagram_rtt import RttEstimator

pytestmark = pytest.mark.timeout(30)


def test_before_a_sample_the_configured_rtt_is_assumed() -> None:
    e = RttEstimator(0.1).get("site-1")
    assert (e.srtt_s, e.rttvar_s, e.samples) == (0.1, 0.05, 0)
    assert e.rto_s == pytest.approx(0.1 + 4 * 0.05)  # RFC 6298 2.1


def test_samples_follow_rfc_6298_and_a_lan_gets_its_floor() -> None:
    est = RttEstimator(0.1)
    est.observe("a", 0.2)  # 2.2: SRTT = R, RTTVAR = R / 2
    e = est.get("a")
    assert (e.srtt_s, e.rttvar_s, e.samples) == (0.2, 0.1, 1)
    est.observe("a", 0.1)  # 2.3: RTTVAR = 3/4 0.1 + 1/4 |0.2 - 0.1|, then SRTT = 7/8 0.2 + 1/8 0.1
    e = est.get("a")
    assert e.rttvar_s == pytest.approx(0.1), e
    assert e.srtt_s == pytest.approx(0.1875)
    assert e.rto_s == pytest.approx(0.1875 + 0.4)
    lan = RttEstimator(0.1)
    for _ in range(50):
        lan.observe("b", 0.0002)
    assert lan.rto_s("b") == 0.01  # min_rto_s: a scheduler, not the wire, sets the floor
    assert est.rto_s("c") == pytest.approx(0.3)  # other peers keep their own (here: none)
    assert est.worst_srtt_s() == pytest.approx(0.1875)


def test_a_long_path_converges_and_bad_samples_are_ignored() -> None:
    est = RttEstimator(0.1)
    for _ in range(40):
        est.observe("far", 0.3)
    assert est.get("far").srtt_s == pytest.approx(0.3, rel=1e-3)
    assert est.rto_s("far") == pytest.approx(0.3, abs=0.01)  # RTTVAR decays on a steady path
    for bad in (-1.0, float("nan"), float("inf")):
        est.observe("far", bad)
    assert est.get("far").samples == 40


@pytest.mark.parametrize("kw", [dict(initial_s=0.0), dict(initial_s=0.1, min_rto_s=2.0, max_rto_s=1.0)])
def test_bad_bounds_are_refused(kw) -> None:
    with pytest.raises(ValueError, match="initial_s|min_rto_s"):
        RttEstimator(**kw)
