"""A site that falls behind always catches up (issue 33): a state pull may span any number of
rounds (the rounds it missed are replayed from the means the members keep), its buckets come
from every live member, and a donor lost mid-transfer costs only its part. In-process sites
(one network, one rendezvous); the donors are slowed by their test fault hook."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.configs import DiLoCoConfig, GroupConfig, RoundConfig
from dtrain.diloco import DiLoCo
from dtrain.errors import PeerUnavailable
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.rounds.outcome import RoundStatus
from dtrain.transports.inproc import InprocNetwork, InprocTransport

pytestmark = pytest.mark.timeout(90)

H = 2
# Rounds of means the members keep in the first test. A staged bucket is replayed forward each
# time a donor stream is free (2 streams, 3 donor rounds per bucket pull), so it falls behind the
# donors' rounds by about 3 at most. Under load, CI runs saw buckets pulled again: a "not yet"
# mean sent the bucket behind every queued pull, and a summary older than a pulled bucket
# dropped it (both fixed, each with a unit test in tests/unit/test_catchup.py). 7 keeps the
# test's claim, a pull longer than what is kept with no bucket pulled twice.
KEEP = 7


def _site(
    site_id: str, net: InprocNetwork, core: RendezvousCore, *, history_rounds: int = 16, pull_s: float = 10.0
) -> DiLoCo:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)  # 136 parameters: 9 buckets of 64 bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = DiLoCoConfig(
        site_id=site_id,
        sync_every=H,
        hook_optimizer=False,
        buckets=BucketConfig(bucket_bytes=64, chunk_bytes=64),
        rounds=RoundConfig(history_rounds=history_rounds),
        group=GroupConfig(state_pull_timeout_s=pull_s, state_pull_streams=1, ready_poll_s=0.2),
    )
    return DiLoCo(model, opt, config=cfg, transport=InprocTransport(net), rendezvous=InprocRendezvousClient(core))


def _round(d: DiLoCo, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = d.inner_optimizer
    for _ in range(H):
        d.model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        d.step()


def _train(d: DiLoCo, until: list[int], seed: int) -> threading.Thread:
    """Rounds in a thread until ``d`` reaches round ``until[0]`` (read each round)."""

    def loop() -> None:
        while d.round < until[0]:
            _round(d, seed + d.round)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def _slow_serving(d: DiLoCo, sleep_s: float) -> None:
    d.engine.fault_hook = lambda phase, _b: time.sleep(sleep_s) if phase == "serve_state" else None


def _rounds_per_bucket(d: DiLoCo, n: int, until: list[int]):
    """A fault hook: serving a bucket's state takes ``n`` of ``d``'s rounds (at most 5 s), none
    once ``d`` trained its last round (``until[0]``): a pull after that (a joiner cut from a
    round as it caught up, resyncing) waited 5 s per bucket for rounds that never came."""

    def hook(phase: str, _bucket: int) -> None:
        if phase == "serve_state":
            start, t0 = d.round, time.monotonic()
            while d.round < min(start + n, until[0]) and time.monotonic() - t0 < 5.0:
                time.sleep(0.01)

    return hook


def _core() -> RendezvousCore:
    return RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.3, heartbeat_interval_s=0.1))


def test_a_joiner_whose_pull_spans_ten_rounds_replays_them_and_ends_equal():
    """The members keep 7 rounds; the pull takes ~15: each bucket is replayed forward as the
    others arrive, so none falls out of what is kept."""
    net, core = InprocNetwork(), _core()
    a, b = _site("a", net, core, history_rounds=KEEP), _site("b", net, core, history_rounds=KEEP)
    until = [10**6]
    group = [_train(a, until, 100), _train(b, until, 200)]
    j = None
    try:
        while min(a.round, b.round) < 2 * KEEP:  # round 0 no longer kept: the joiner must pull
            time.sleep(0.05)
        for d in (a, b):  # each bucket takes 2 rounds: 9 over 2 donors, one stream each: ~10 rounds
            d.engine.fault_hook = _rounds_per_bucket(d, 3, until)
        reasons: list[str] = []
        a.on_round.append(lambda o: reasons.append(o.reason))
        r0 = a.round
        j = _site("j", net, core, history_rounds=KEEP)
        joined_at = j.round
        stats = j.site.last_catch_up
        print(f"pull from round {r0} to {joined_at}: {stats}")
        assert joined_at - r0 > KEEP, (r0, joined_at)  # the pull spanned more rounds than are kept
        # j's heartbeats said how long its pull had to go: rounds did not wait the quorum timeout for it
        assert any("['j'] pulling state past the quorum wait" in r for r in reasons), reasons
        assert stats.means_replayed >= 9 and stats.repulled == 0 and stats.own_buckets == 0
        assert sum(stats.buckets_from.values()) == 9
        until[0] = joined_at + 3
        mine = _train(j, until, 300)
        for t in (*group, mine):
            t.join(timeout=30)
        assert a.round == b.round == j.round == until[0]
        assert a.site_checksum() == b.site_checksum() == j.site_checksum()
    finally:
        until[0] = 0
        for d in (a, b, j):
            if d is not None:
                d.close(wait=False)


def _static_group(net: InprocNetwork, core: RendezvousCore) -> tuple[DiLoCo, DiLoCo]:
    """a and b run 4 rounds together (keeping 2), then stand by serving."""
    a, b = _site("a", net, core, history_rounds=2), _site("b", net, core, history_rounds=2)
    until = [4]
    for t in [_train(a, until, 1), _train(b, until, 2)]:
        t.join(timeout=30)
    assert a.round == b.round == 4 and a.site_checksum() == b.site_checksum()
    return a, b


def test_four_joiners_at_once_pull_from_both_donors_and_end_equal():
    net, core = InprocNetwork(), _core()
    a, b = _static_group(net, core)
    for d in (a, b):
        _slow_serving(d, 0.05)
    joiners: dict[str, DiLoCo] = {}

    def join(name: str) -> None:
        joiners[name] = _site(name, net, core, history_rounds=2)

    threads = [threading.Thread(target=join, args=(f"j{i}",)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(joiners) == 4
        for name, j in joiners.items():
            stats = j.site.last_catch_up
            assert sorted(stats.buckets_from) == ["a", "b"], (name, stats)
            assert sum(stats.buckets_from.values()) == 9 and stats.repulled == 0
            assert j.round == 4 and j.site_checksum() == a.site_checksum()
    finally:
        for d in (a, b, *joiners.values()):
            d.close(wait=False)


def test_a_donor_lost_mid_transfer_costs_only_its_part():
    net, core = InprocNetwork(), _core()
    a, b = _static_group(net, core)
    _slow_serving(a, 0.05)
    served = []

    def dies_at_its_third(phase: str, bucket: int) -> None:
        if phase != "serve_state":
            return
        time.sleep(0.05)
        served.append(bucket)
        if len(served) == 3:  # b goes down while serving its third bucket
            net.set_down(b.engine.address)
            raise PeerUnavailable("b died mid-transfer (test)")

    b.engine.fault_hook = dies_at_its_third
    j = None
    try:
        j = _site("j", net, core, history_rounds=2)
        stats = j.site.last_catch_up
        assert stats.donors_lost == ["b"]
        assert stats.buckets_from["b"] == 2  # what b delivered before it died is kept
        assert stats.buckets_from["a"] == 7 and stats.repulled == 0  # the rest from a, nothing twice
        assert j.round == 4 and j.site_checksum() == a.site_checksum()
    finally:
        for d in (a, b, j):
            if d is not None:
                d.close(wait=False)


def test_a_straggler_cut_from_a_round_replays_it_from_its_own_theta_pulling_nothing_whole():
    net, core = InprocNetwork(), _core()
    a, b = _site("a", net, core), _site("b", net, core)
    try:
        until = [2]
        for t in [_train(a, until, 1), _train(b, until, 2)]:
            t.join(timeout=30)
        _round(a, seed=5)  # round 2 without b (cut as a straggler)
        _round(b, seed=6)  # b: missed round 2, resyncs
        stats = b.site.last_catch_up
        assert b.last_outcome.status == RoundStatus.RESYNCED and b.round == a.round == 3
        assert stats.buckets_from == {} and stats.own_buckets == 9 and stats.means_replayed == 9
        assert b.site_checksum() == a.site_checksum()
    finally:
        a.close(wait=False)
        b.close(wait=False)
