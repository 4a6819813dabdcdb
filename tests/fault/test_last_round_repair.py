"""A member that finds a bucket stale in a run's last round repairs it from the owner
before the owner exits (docs/ARCHITECTURE.md, fault table). Found from a failed
``netem_loss.py --smoke``: in round 0 a lost SYN put both sites past the reduce
deadline, the member kept θ_b (owner_lost) while the owner applied its own mean, and
in the last round the member's repair was refused because the owner had exited 60 ms
after the member pulled its means. Now the member's pull says its θ_b checksum
(``have_checksum``) and the owner's close waits for the stale member's state pull too.
Sites are ``RoundEngine``s served by ``GrpcTransport`` (or ``DatagramTransport``, whose
member says its θ_b checksum in the MEAN_ACK the owner counts) on 127.0.0.1 in this process.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout, assign_owners
from dtrain.protocol import Member, RoundPlan
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.rounds.types import BucketOutcome
from dtrain.state import GlobalState
from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

NUMEL = 4096
LAYOUT_CFG = BucketConfig(bucket_bytes=4096, chunk_bytes=1024)  # 4 buckets of 4 chunks
REPAIR_DELAY_S = 1.0  # the member starts its repair this long after its pulls (a busy machine)


def _site(site_id: str, data_path: str) -> RoundEngine:
    layout = BucketLayout([NUMEL], ["param"], LAYOUT_CFG)
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    rcfg = RoundConfig(plan_wait_s=2.0, repair_timeout_s=10.0)
    grpc = GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0)
    transport = (
        GrpcTransport(grpc)
        if data_path == "grpc"
        else DatagramTransport(DatagramTransportConfig(grpc=grpc, max_rate_mbit=200.0, rtt_s=0.01))
    )
    engine = RoundEngine(site_id, GlobalState(layout, [theta]), transport, rcfg)
    engine.start()
    return engine


def _step(engine: RoundEngine, seed: int) -> None:
    local = torch.cat([t.detach() for t in engine.state.theta])
    local -= 0.01 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    assert engine.add_pseudo_gradient([local])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_path", ["grpc", "datagram"])
def test_owner_closing_after_the_last_round_waits_for_a_stale_members_repair(data_path: str):
    owner, member = _site("site-0", data_path), _site("site-1", data_path)
    members = (Member(site_id="site-0", address=owner.address), Member(site_id="site-1", address=member.address))
    owners = assign_owners(len(owner.state.layout), ["site-0", "site-1"])
    stale = [b for b, o in enumerate(owners) if o == "site-0"]
    assert stale
    # the member missed an earlier mean of the owner's buckets: its θ_b differs there
    for b in stale:
        with torch.no_grad():
            member.state.theta[b].add_(1e-3)
    member.state.invalidate_checksums()
    repair = member._repair

    def late_repair(run) -> None:  # the member repairs only after the owner could have exited
        time.sleep(REPAIR_DELAY_S)
        repair(run)

    member._repair = late_repair
    try:
        for i, e in enumerate((owner, member)):
            _step(e, i)
        plan = RoundPlan(
            round=0, members=members, reduce_timeout_s=20.0, broadcast_timeout_s=30.0, datagram_key=os.urandom(32)
        )
        f_owner, f_member = owner.start_round(plan), member.start_round(plan)
        f_owner.result(timeout=30)
        waited = owner.mean_pulls.wait_pulled(timeout_s=20.0)  # what DiLoCo.close() waits for
        # then it stops as DiLoCo.close() does: new calls are refused, replies in flight get a grace
        owner.stop(max(0.5, owner.mean_pulls.time_left_s(time.monotonic())))
        res = f_member.result(timeout=30)
        assert waited.missing == {} and waited.waited_s >= 0.5 * REPAIR_DELAY_S, waited
        for b in stale:
            assert res.bucket_outcome[b] is BucketOutcome.REPAIRED, (b, res.bucket_outcome)
        assert member.state.checksums() == owner.state.checksums()
    finally:
        owner.stop(0.1)
        member.stop(0.1)
