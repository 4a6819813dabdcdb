"""Thread-pool starvation by a rogue client that holds the valid token (issue 13, item 1).

With a thread per call, 80 Ready long polls made the rendezvous declare every
site dead (heartbeats queued behind them), and 24 idle Push streams stalled a
site's round. The servers are asynchronous now: a waiting call holds no thread.
Each rogue here is bounded in count (``RogueFlood.keep``) and time (every call
has a deadline; ``stop()`` cancels them).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from rogue_flood import RogueFlood

from dtrain.buckets import BucketConfig, BucketLayout, assign_owners
from dtrain.membership import GroupConfig
from dtrain.protocol import Member, RoundPlan
from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.grpc import GrpcRendezvousClient, serve_rendezvous
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.site import Site
from dtrain.sitegroup import LocalSiteComm
from dtrain.state import GlobalState
from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

TOKEN = "starvation-test-token"
NUMEL = 4096
LAYOUT_CFG = BucketConfig(bucket_bytes=4096, chunk_bytes=1024)  # 4 buckets of 4 chunks


class CountingCore(RendezvousCore):
    """A core that counts the Ready calls that reached it."""

    def __init__(self, config: RendezvousConfig) -> None:
        super().__init__(config)
        self.num_ready_calls = 0

    def ready(self, site_id: str, round: int, *, now: float):
        self.num_ready_calls += 1
        return super().ready(site_id, round, now=now)


def _wait_until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _engine(site_id: str, **round_kw) -> RoundEngine:
    layout = BucketLayout([NUMEL], ["param"], LAYOUT_CFG)
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    rcfg = RoundConfig(plan_wait_s=1.0, repair_timeout_s=1.0, **round_kw)
    engine = RoundEngine(site_id, GlobalState(layout, [theta]), GrpcTransport(GrpcTransportConfig(token=TOKEN)), rcfg)
    engine.start()
    return engine


def _step(engine: RoundEngine, gen: torch.Generator) -> list[torch.Tensor]:
    """A local model after some inner steps: θ moved by a little noise."""
    theta = torch.cat([t.detach() for t in engine.state.theta])
    return [theta - 0.01 * torch.randn(NUMEL, generator=gen)]


@pytest.mark.timeout(60)
def test_ready_long_polls_from_a_token_holder_do_not_starve_heartbeats():
    """80 Ready long polls in flight (the CLI's rendezvous: 64 server threads
    before): every site's heartbeat is still answered, none is declared dead, and
    the three sites form a round together."""
    rcfg = RendezvousConfig(
        min_sites=3, initial_sites=3, quorum_timeout_s=10.0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5
    )
    core = CountingCore(rcfg)
    server = serve_rendezvous(core, GrpcTransportConfig(token=TOKEN, num_server_threads=64), tick_s=0.05)
    sites = {f"site-{i}": GrpcRendezvousClient(server.address, token=TOKEN, rpc_timeout_s=1.0) for i in range(3)}
    rogue = RogueFlood(server.address, TOKEN)
    try:
        for i, (sid, client) in enumerate(sites.items()):
            client.join(sid, f"127.0.0.1:{1000 + i}")
        for k in range(80):
            rogue.keep(1, lambda k=k: rogue.long_poll(f"rogue-{k}"))
        _wait_until(lambda: core.num_ready_calls >= 64, 10, "the rogue's polls to reach the core")
        end = time.monotonic() + 2 * rcfg.heartbeat_timeout_s
        while time.monotonic() < end:
            for sid, client in sites.items():
                hb = client.heartbeat(sid)  # RendezvousError (DEADLINE_EXCEEDED) when starved
                assert hb.known and not hb.resync_required, f"{sid}: {hb.reason}"
            time.sleep(rcfg.heartbeat_interval_s)
        assert rogue.num_in_flight() == 80, rogue.codes
        decisions: dict[str, object] = {}
        threads = [
            threading.Thread(target=lambda s=s, c=c: decisions.update({s: c.ready(s, 0, timeout_s=5)}))
            for s, c in sites.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert {s: (d.status, d.plan.site_ids) for s, d in decisions.items()} == {
            s: ("plan", tuple(sites)) for s in sites
        }
        assert not any(core.snapshot(time.monotonic())["sites"][s]["needs_resync"] for s in sites)
    finally:
        rogue.stop()
        for client in sites.values():
            client.close()
        server.stop(0)


@pytest.mark.timeout(60)
def test_idle_push_streams_from_a_token_holder_do_not_stall_a_round():
    """24 idle Push streams (the Peer server had 16 threads) and 8 pulls waiting
    for a round not open yet: the honest site's push is still taken, every bucket
    finalizes as soon as complete, and both sites apply every mean."""
    victim, honest = _engine("victim"), _engine("honest")
    rogue = RogueFlood(victim.address, TOKEN)
    gen = torch.Generator().manual_seed(1)
    try:
        rogue.keep(24, rogue.idle_push)
        rogue.keep(8, rogue.waiting_pull(lambda: 1, bucket=0, requester="rogue"))
        _wait_until(lambda: rogue.num_in_flight() == 32, 10, "the rogue's streams to open")
        time.sleep(0.3)  # let the server start their handlers
        members = (Member(site_id="victim", address=victim.address), Member(site_id="honest", address=honest.address))
        plan = RoundPlan(round=0, members=members, reduce_timeout_s=20.0, broadcast_timeout_s=25.0)
        futs = [e.start_round(plan) for e in (victim, honest) if e.add_pseudo_gradient(_step(e, gen))]
        results = [f.result(timeout=30) for f in futs]
        assert rogue.num_in_flight() >= 24, rogue.codes  # the flood was on all along
        owners = assign_owners(len(victim.state.layout), ["honest", "victim"])
        for res in results:
            assert res.reduce_arrived_fraction == 1.0, res  # nothing waited out the reduce deadline
            assert res.applied_buckets == len(owners) and res.stale_buckets == 0, res
            # finished because every bucket was complete, not by waiting out its deadline; the
            # deadline is far (20 s) so that only a round that waits for it fails, not a slow machine
            assert res.total_s < plan.reduce_timeout_s, res
        assert victim.state.checksums() == honest.state.checksums()
    finally:
        rogue.stop()
        victim.stop(0.1)
        honest.stop(0.1)


def _pull_engine(site_id: str, **transport_kw) -> RoundEngine:
    layout = BucketLayout([NUMEL], ["param"], LAYOUT_CFG)
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    transport = GrpcTransport(GrpcTransportConfig(token=TOKEN, **transport_kw))
    engine = RoundEngine(site_id, GlobalState(layout, [theta]), transport, RoundConfig(plan_wait_s=1.0))
    engine.start()
    return engine


@pytest.mark.timeout(60)
def test_pulls_waiting_under_many_requester_names_hold_no_thread():
    """40 PullMean calls under 40 requester names (each within max_streams_per_sender)
    wait for a round not open yet, on a Peer server with 4 threads per method: a waiting
    pull held one of them, so the honest site's pulls queued behind the rogue's. Now a
    waiting pull is a coroutine: the round applies every mean, before its deadline."""
    victim, honest = _pull_engine("victim", num_server_threads=4), _pull_engine("honest", num_server_threads=4)
    rogue = RogueFlood(victim.address, TOKEN)
    gen = torch.Generator().manual_seed(2)
    try:
        for k in range(40):
            rogue.keep(1, rogue.waiting_pull(lambda: 1, bucket=0, requester=f"rogue-{k}"))
        _wait_until(lambda: rogue.num_in_flight() == 40, 10, "the rogue's pulls to open")
        time.sleep(0.3)
        members = (Member(site_id="victim", address=victim.address), Member(site_id="honest", address=honest.address))
        plan = RoundPlan(round=0, members=members, reduce_timeout_s=20.0, broadcast_timeout_s=25.0)
        futs = [e.start_round(plan) for e in (victim, honest) if e.add_pseudo_gradient(_step(e, gen))]
        results = [f.result(timeout=30) for f in futs]
        assert rogue.num_in_flight() >= 30, rogue.codes  # the rogue's pulls were waiting all along
        for res in results:
            assert res.broadcast_arrived_fraction == 1.0 and res.stale_buckets == 0, res
            assert res.total_s < plan.reduce_timeout_s, res
        assert victim.state.checksums() == honest.state.checksums()
    finally:
        rogue.stop()
        victim.stop(0.1)
        honest.stop(0.1)


@pytest.mark.timeout(60)
def test_a_pull_past_max_waiting_pulls_is_refused_at_once():
    """A token holder claiming a new requester name per call fills max_waiting_pulls (12
    here): the next PullMean is answered RESOURCE_EXHAUSTED at once (its own deadline is
    60 s), naming the limit; a PullState is still served."""
    import grpc

    from dtrain._proto.dtrain.v1 import peer_pb2

    site = _pull_engine("victim", max_waiting_pulls=12)
    rogue = RogueFlood(site.address, TOKEN)
    try:
        for k in range(12):  # round 0 is not open: each waits up to plan_wait_s, then is re-opened
            rogue.keep(1, rogue.waiting_pull(lambda: 0, bucket=0, requester=f"name-{k}"))
        _wait_until(lambda: rogue.num_in_flight() == 12, 10, "the rogue's pulls to open")
        time.sleep(0.2)
        call = rogue._pull(
            peer_pb2.PullMeanRequest(round=0, bucket=0, requester="one-more", timeout_ms=60_000),
            timeout=60,
            metadata=rogue.metadata,
        )
        with pytest.raises(grpc.RpcError) as ei:
            list(call)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_pulls" in ei.value.details()
        client = GrpcTransport(GrpcTransportConfig(token=TOKEN, num_attempts=1))
        try:
            st = client.pull_state(site.address, 0, requester="honest", timeout_s=10)
            assert st.bucket == 0 and st.checksum == site.state.bucket_state(0).checksum
        finally:
            client.stop(0.1)
    finally:
        rogue.stop()
        site.stop(0.1)


@pytest.mark.timeout(120)
def test_three_sites_with_200_rogue_streams_and_200_long_polls_in_flight():
    """A 3-site run over gRPC (rendezvous + Site + RoundEngine) while a token
    holder keeps 200 streams on the sites' Peer servers (idle Pushes and pulls
    waiting for the next round) and 200 Ready long polls at the rendezvous: no
    healthy site is declared dead, every round has all three sites, every
    contribution and mean arrives and every round ends before its deadlines."""
    num_rounds = 4
    rcfg = RendezvousConfig(
        min_sites=3,
        initial_sites=3,
        quorum_timeout_s=5.0,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=1.5,
        reduce_timeout_s=3.0,
        broadcast_timeout_s=6.0,
    )
    core = CountingCore(rcfg)
    server = serve_rendezvous(core, GrpcTransportConfig(token=TOKEN), tick_s=0.05)
    engines = [_engine(f"site-{i}") for i in range(3)]
    floods = [RogueFlood(server.address, TOKEN)] + [RogueFlood(e.address, TOKEN) for e in engines]
    gcfg = GroupConfig(quorum_wait_s=30.0, ready_poll_s=1.0, rendezvous_retry_s=2.0)
    clients = [GrpcRendezvousClient(server.address, token=TOKEN, rpc_timeout_s=2.0) for _ in engines]
    groups = [Site(e, LocalSiteComm(), c, gcfg) for e, c in zip(engines, clients)]
    outcomes: dict[str, list] = {e.site_id: [] for e in engines}
    try:
        for k in range(200):
            floods[0].keep(1, lambda k=k: floods[0].long_poll(f"rogue-{k}"))
        for i, (flood, e) in enumerate(zip(floods[1:], engines)):
            n_pull = 16 if i == 0 else 17  # 200 in all: 3 x 50 idle Pushes + 50 waiting pulls
            flood.keep(50, flood.idle_push)
            for j in range(n_pull):
                next_round = lambda e=e: e.state.rounds_applied + 1  # noqa: E731
                flood.keep(1, flood.waiting_pull(next_round, bucket=j % 4, requester=f"rogue-{j % 3}"))
        _wait_until(lambda: floods[0].num_in_flight() == 200, 15, "200 long polls in flight")
        _wait_until(lambda: sum(f.num_in_flight() for f in floods[1:]) >= 190, 15, "the rogue streams in flight")

        def site(group: Site) -> None:
            gen = torch.Generator().manual_seed(hash(group.site_id) % 1000)
            group.join()
            for _ in range(num_rounds):
                outcomes[group.site_id].append(group.sync(_step(group.engine, gen)))

        threads = [threading.Thread(target=site, args=(g,), daemon=True) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a site hung"
        assert floods[0].num_in_flight() >= 190, floods[0].codes
        assert sum(f.num_in_flight() for f in floods[1:]) >= 150, [f.codes for f in floods[1:]]
        site_ids = tuple(e.site_id for e in engines)
        for sid, outs in outcomes.items():
            assert [o.status for o in outs] == ["applied"] * num_rounds, (sid, [(o.status, o.reason) for o in outs])
            for o in outs:
                res = o.result
                assert res.members == site_ids, res
                assert res.reduce_arrived_fraction == 1.0 and res.broadcast_arrived_fraction == 1.0, res
                assert res.stale_buckets == 0 and res.skipped_buckets == 0, res
                assert res.total_s < rcfg.reduce_timeout_s, res  # ended before its deadlines
        snap = core.snapshot(time.monotonic())["sites"]
        assert not any(snap[s]["needs_resync"] for s in site_ids), {s: snap[s]["resync_reason"] for s in site_ids}
        assert len({tuple(e.state.checksums()) for e in engines}) == 1
        assert all(e.state.rounds_applied == num_rounds for e in engines)
    finally:
        for g in groups:
            g.leave()
        for f in floods:
            f.stop()
        for c in clients:
            c.close()
        for e in engines:
            e.stop(0.1)
        server.stop(0)
