"""The training-position snapshot joiners heal from (dtrain.diloco, issue 13): refreshed
in place each round (state.copy_reusing), never torn while a PullState serializes it."""

from __future__ import annotations

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.configs import DiLoCoConfig
from dtrain.diloco import DiLoCo
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.state import copy_reusing, decode_position
from dtrain.transports.inproc import InprocNetwork, InprocTransport

pytestmark = pytest.mark.timeout(60)


def test_copy_reusing_writes_into_matching_tensors_and_clones_the_rest():
    live = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
    }
    first = copy_reusing(None, live)
    assert first["state"][0]["exp_avg"] is not live["state"][0]["exp_avg"]  # a copy, not the live tensor
    buf = first["state"][0]["exp_avg"]
    live["state"][0]["exp_avg"].mul_(5)
    live["state"][1] = {"exp_avg": torch.zeros(2)}
    live["groups"][0]["lr"] = 0.2
    second = copy_reusing(first, live)
    assert second["state"][0]["exp_avg"] is buf and torch.equal(buf, torch.full((4,), 5.0))  # reused, refreshed
    assert torch.equal(second["state"][1]["exp_avg"], torch.zeros(2))  # new entry: cloned
    assert second["groups"] == [{"lr": 0.2, "betas": (0.9, 0.99)}] and second["groups"] is not live["groups"]
    grown = copy_reusing(second, {"state": {0: {"exp_avg": torch.ones(6)}}})
    assert grown["state"][0]["exp_avg"].shape == (6,) and grown["state"][0]["exp_avg"] is not buf


def test_snapshot_is_refreshed_in_place_and_served_as_of_the_round_start():
    """The AdamW state in the snapshot keeps its tensors from round to round (no second
    copy is built), and the PullState answer is the state at the round's start, not the
    live state the next inner steps moved on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = DiLoCo(
        model,
        opt,
        config=DiLoCoConfig(site_id="a", sync_every=2, buckets=BucketConfig(bucket_bytes=512, chunk_bytes=256)),
        transport=InprocTransport(InprocNetwork()),
        rendezvous=InprocRendezvousClient(RendezvousCore(RendezvousConfig(min_sites=1))),
    )
    gen = torch.Generator().manual_seed(1)

    def steps(n):
        for _ in range(n):
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            opt.step()  # the DiLoCo hook runs the round after every 2nd step
            opt.zero_grad()

    try:
        steps(2)
        bufs = [s["exp_avg"] for s in d._position["inner_optimizer"]["state"].values()]
        steps(2)
        after = d._position["inner_optimizer"]["state"]
        assert all(a is b for a, b in zip((s["exp_avg"] for s in after.values()), bufs, strict=True))
        want = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
        assert all(torch.equal(after[k]["exp_avg"], w) for k, w in want.items())
        steps(1)  # the live state moves on; the snapshot stays at the round's start
        served = decode_position(d.engine.position_source(len(d.state)))
        assert served["round"] == 2 and served["inner_steps"] == 4
        assert all(torch.equal(served["inner_optimizer"]["state"][k]["exp_avg"], w) for k, w in want.items())
        assert not all(torch.equal(opt.state_dict()["state"][k]["exp_avg"], w) for k, w in want.items())
    finally:
        d.close(wait=False)
