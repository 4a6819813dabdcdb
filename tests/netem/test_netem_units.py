"""Pure parts of the netem harness: profiles, rule rendering, schedules, statistics.

No root needed: these run everywhere.
"""

from __future__ import annotations

import pytest

from netem import PROFILES, Capabilities, LinkParams, NetemUnavailable, Profile, _rules, choose_backends, get_profile
from netem.measure import binomial_interval
from netem.topology import TopologyConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"delay_ms": -1.0}, "delay_ms"),
        ({"delay_ms": float("nan")}, "delay_ms"),
        ({"delay_ms": 5.0, "jitter_ms": 6.0}, "jitter_ms"),
        ({"loss_pct": 101.0}, "loss_pct"),
        ({"rate_mbit": 0.0}, "rate_mbit"),
        ({"flap_period_s": 1.0, "flap_down_s": 1.0}, "flap_down_s"),
        ({"flap_down_s": 1.0}, "flap_down_s"),
        ({"reorder_pct": 120.0, "reorder_gap_ms": 30.0}, "reorder_pct"),
        ({"reorder_pct": 20.0}, "reorder_gap_ms"),
        ({"reorder_gap_ms": 30.0}, "reorder_pct"),
    ],
)
def test_link_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LinkParams(**kwargs)


def test_link_params_roundtrip_and_unknown_fields():
    p = LinkParams(delay_ms=40.0, jitter_ms=1.0, loss_pct=0.1, rate_mbit=200.0)
    assert LinkParams.from_dict(p.to_dict()) == p
    assert p.needs_delay and not LinkParams(loss_pct=5.0).needs_delay
    assert LinkParams(reorder_pct=20.0, reorder_gap_ms=30.0).needs_delay  # held on the delayer's queue
    with pytest.raises(ValueError, match="unknown LinkParams fields"):
        LinkParams.from_dict({"delay": 1})


def test_cloud_profiles_say_their_source_and_what_the_emulator_reaches():
    """Issue 31: MTU 1,500 between regions (GCP's default VPC 1,460), AWS's 5 Gbit/s per flow, and
    same-continent < cross-coast < transoceanic RTT classes, each naming its source."""
    cloud = [get_profile(n) for n in ("cloud-continent", "cloud-cross-coast", "cloud-transoceanic")]
    assert [p.mtu_bytes for p in cloud] == [1460, 1500, 1500]
    assert [2 * p.link.delay_ms for p in cloud] == [25.0, 65.0, 90.0]  # RTT between two sites of the preset
    assert [p.per_flow_mbit for p in cloud] == [None, 5000.0, 5000.0]
    assert all(p.link.rate_mbit == p.per_flow_mbit for p in cloud)  # the emulator's cap stands for the flow's
    for p in cloud:
        assert "km" in p.source and ("AWS" in p.source or "Google" in p.source), p.name
        assert "measured" in p.measured_here and "Mbit/s" in p.measured_here, p.name
    assert all(p.mtu_bytes == 1500 and not p.source for n, p in PROFILES.items() if not n.startswith("cloud-"))
    with pytest.raises(ValueError, match=r"mtu_bytes must be an int in \[1280, 9000\]"):
        Profile(name="x", link=LinkParams(), description="x", mtu_bytes=576)
    with pytest.raises(ValueError, match="link.rate_mbit must equal per_flow_mbit"):
        Profile(name="x", link=LinkParams(), description="x", per_flow_mbit=5000.0)


def test_profiles_match_the_issue():
    assert set(PROFILES) - {"cloud-continent", "cloud-cross-coast", "cloud-transoceanic", "lossy30"} == {
        "lan",
        "continental",
        "transatlantic",
        "lossy",
        "flaky",
    }
    assert get_profile("lan").link == LinkParams()
    c = get_profile("continental").link
    assert (c.delay_ms, c.rate_mbit) == (15.0, 1000.0)
    t = get_profile("transatlantic").link
    assert (t.delay_ms, t.loss_pct, t.rate_mbit) == (40.0, 0.1, 200.0)
    v = get_profile("lossy30").link  # issue 32's reliability benchmark: 30% loss
    assert (v.delay_ms, v.loss_pct, v.rate_mbit) == (10.0, 30.0, 100.0)
    assert get_profile("lossy").link.loss_pct == 10.0
    f = get_profile("flaky").link
    assert 0 < f.flap_down_s < f.flap_period_s
    with pytest.raises(ValueError, match="transatlantic"):
        get_profile("nope")


def test_topology_config_validation():
    with pytest.raises(ValueError, match="num_sites"):
        TopologyConfig(num_sites=0, name="x")
    with pytest.raises(ValueError, match="profile"):
        TopologyConfig(num_sites=2, name="x", profile="moon")
    with pytest.raises(ValueError, match="name"):
        TopologyConfig(num_sites=2, name="Bad-Name")
    with pytest.raises(ValueError, match="filter_backend"):
        TopologyConfig(num_sites=2, name="x", filter_backend="pf")
    for mtu in (1000, 9001, 1500.0):
        with pytest.raises(ValueError, match=r"mtu_bytes must be an int in \[1280, 9000\]"):
            TopologyConfig(num_sites=2, name="x", mtu_bytes=mtu)


def test_nft_rules_for_partitions_and_loss():
    script = _rules.nft_chain("part", _rules.part_matches({(2, 0)}))
    assert script.splitlines() == [
        "flush chain inet dtrain_netem part",
        'add rule inet dtrain_netem part iifname "s0" oifname "s2" drop',
        'add rule inet dtrain_netem part iifname "s2" oifname "s0" drop',
    ]
    links = [LinkParams(), LinkParams(loss_pct=0.1), LinkParams(loss_pct=100.0)]
    assert _rules.loss_matches(links) == [
        'oifname "s1" numgen random mod 1000000 < 1000',
        'oifname "s2" numgen random mod 1000000 < 1000000',
    ]
    assert _rules.isolate_pairs([1], 3) == {(0, 1), (1, 2)}


def test_iptables_rules():
    links = [LinkParams(delay_ms=5.0), LinkParams(loss_pct=10.0)]
    assert _rules.ipt_delay_rules(links) == ["-o s0 -j NFQUEUE --queue-num 0 --queue-bypass"]
    assert _rules.ipt_loss_rules(links) == ["-o s1 -m statistic --mode random --probability 0.100000 -j DROP"]
    assert _rules.ipt_part_rules({(0, 1)}) == ["-i s0 -o s1 -j DROP", "-i s1 -o s0 -j DROP"]
    text = _rules.ipt_chain("DTN-LOSS", [])
    assert text == "*filter\n:DTN-LOSS - [0:0]\nCOMMIT\n"
    base = _rules.ipt_hub_base(filters=False)
    assert "-A DTN-FWD -j DTN-DELAY" in base and "DTN-FWD -j DTN-LOSS" not in base


def test_tc_arguments():
    assert _rules.tbf_argv("eth0", None) == ["tc", "qdisc", "del", "dev", "eth0", "root"]
    argv = _rules.tbf_argv("s1", 40.0)
    assert argv[:9] == ["tc", "qdisc", "replace", "dev", "s1", "root", "tbf", "rate", "40mbit"]
    burst, limit = int(argv[10]), int(argv[12])
    assert burst == 16 * 1514 and limit > 64 * 1024
    jumbo = _rules.tbf_argv("s1", 40.0, mtu_bytes=9000)  # a frame larger than the burst would never pass
    assert int(jumbo[10]) == 16 * 9014 and int(jumbo[12]) > int(jumbo[10])
    netem = _rules.netem_argv("s0", LinkParams(delay_ms=40, jitter_ms=1, loss_pct=0.1, rate_mbit=200))
    assert netem[6:] == ["netem", "limit", "100000", "delay", "40ms", "1ms", "loss", "0.1%", "rate", "200mbit"]
    assert _rules.netem_argv("s0", LinkParams())[2] == "del"


def test_flap_schedule_is_staggered():
    link = LinkParams(flap_period_s=3.0, flap_down_s=1.0)
    links = [link, link, link]
    epoch = 1000.0
    assert _rules.flap_down_sites(links, epoch, 1000.5) == [0]
    assert _rules.flap_down_sites(links, epoch, 1001.5) == [1]
    assert _rules.flap_down_sites(links, epoch, 1002.5) == [2]
    assert _rules.flap_down_sites(links, epoch, 1003.2) == [0]
    assert _rules.flap_next_change(links, epoch, 1000.5) == pytest.approx(1001.0)
    assert _rules.flap_next_change([LinkParams()], epoch, 1000.5) is None


def _caps(**over):
    base = dict(
        kernel_netem=False,
        tbf=True,
        nftables=True,
        iptables_nfqueue=True,
        iptables_statistic=True,
        ethtool=True,
        netfilterqueue=True,
    )
    return Capabilities(**{**base, **over})


def test_backend_choice():
    assert choose_backends(_caps()) == {
        "delay": "nfqueue-userspace",
        "jitter": "nfqueue-userspace",
        "reorder": "nfqueue-userspace",
        "loss": "nftables",
        "rate": "tbf",
        "partition": "nftables",
        "flap": "agent+nftables",
    }
    netem = choose_backends(_caps(kernel_netem=True))
    assert netem["delay"] == "netem" and netem["loss"] == "netem" and netem["reorder"] is None
    assert choose_backends(_caps(kernel_netem=True), kernel_netem=False)["delay"] == ("nfqueue-userspace")
    fallback = choose_backends(_caps(nftables=False))
    assert fallback["loss"] == "iptables" and fallback["partition"] == "iptables"
    assert choose_backends(_caps(netfilterqueue=False))["delay"] is None
    with pytest.raises(NetemUnavailable, match="kernel_netem"):
        choose_backends(_caps(), kernel_netem=True)
    with pytest.raises(NetemUnavailable, match="iptables"):
        choose_backends(_caps(iptables_statistic=False), filter_backend="iptables")


def test_compiled_delayer_backend_choice():
    compiled = choose_backends(_caps(), compiled_delayer=True)
    assert compiled["delay"] == compiled["jitter"] == "nfqueue-c"
    # the compiled delayer does not need the netfilterqueue package, only the NFQUEUE target
    assert choose_backends(_caps(netfilterqueue=False), compiled_delayer=True)["delay"] == "nfqueue-c"
    assert choose_backends(_caps(iptables_nfqueue=False), compiled_delayer=True)["delay"] is None
    assert choose_backends(_caps(kernel_netem=True), compiled_delayer=True)["delay"] == "netem"


def test_binomial_interval():
    assert binomial_interval(10, 0.5) == (1, 9)  # P(X=0) = 1/1024 < 0.5%, P(X<=1) > 0.5%
    lo, hi = binomial_interval(2000, 0.1)
    assert (lo, hi) == (166, 235)  # normal approximation: 200 -/+ 2.576 * 13.4
    assert binomial_interval(2000, 0.0) == (0, 0)
    assert binomial_interval(2000, 0.001) == (0, 6)
