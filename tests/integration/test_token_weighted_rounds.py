"""Token-weighted rounds end to end in one process (issue 34): two sites whose claims differ
3:1 apply θ ← θ − lr·(1·Δ₀ + 3·Δ₁)/4, alike on both (equal checksums), over gRPC's message
mapping's in-process twin; the owners report the claims they accepted."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from dtrain.configs import AggregationConfig, RoundConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config


class Vec(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0]))


GRADS = {0: [1.0, 0.0, 2.0, -1.0], 1: [3.0, -1.0, 0.0, 1.0]}


@pytest.mark.timeout(30)
def test_two_sites_weighted_three_to_one() -> None:
    rounds = RoundConfig(aggregation=AggregationConfig(token_weighted=True))
    cfg = ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=1, rounds=rounds))
    sgd1 = lambda ps: torch.optim.SGD(ps, lr=1.0)  # noqa: E731  outer step = the mean itself

    def step(site: Site, k: int) -> None:
        site.model.w.grad = torch.tensor(GRADS[site.index])
        site.optimizer.step()  # inner SGD lr 0.1; the hook runs a round every step

    with InprocCluster(Vec, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), cfg, outer_optimizer=sgd1) as c:
        d1 = c.sites[1].diloco
        d1.config = dataclasses.replace(d1.config, tokens_per_step=3)
        c.run_steps(step, 1, timeout_s=20)
        got = [s.theta() for s in c.sites]
        results = [s.results[-1] for s in c.sites]
        assert len(set(c.checksums())) == 1
    theta0 = torch.tensor([1.0, -2.0, 0.5, 3.0])
    d0, d1_ = 0.1 * torch.tensor(GRADS[0]), 0.1 * torch.tensor(GRADS[1])
    want = theta0 - (1 * d0 + 3 * d1_) / 4
    for g in got:
        assert torch.allclose(g, want, atol=1e-6), (g, want)
    assert [r.tokens for r in results] == [1, 3]
    owner = next(r for r in results if r.owned_buckets)
    assert owner.claims == {"site-0": 1, "site-1": 3} and owner.weight_refused == {}


@pytest.mark.timeout(60)
def test_time_based_rounds_slow_site_trains_fewer_steps_and_all_agree() -> None:
    """round_window_s: a site 4x slower trains about a quarter of the inner steps in each
    round's window, both reach every round (no straggler), their claims say so, and θ is
    bit-identical on both."""
    rounds = RoundConfig(aggregation=AggregationConfig(token_weighted=True))
    diloco = fast_diloco_config(sync_every=50, round_window_s=0.12, rounds=rounds)
    cfg = ClusterConfig(num_sites=2, diloco=diloco)
    step_sleep_s = {0: 0.004, 1: 0.016}
    num_rounds = 4

    def train(site: Site) -> None:
        while site.diloco.round < num_rounds and not site.killed.is_set():
            time.sleep(step_sleep_s[site.index])
            site.model.w.grad = torch.tensor(GRADS[site.index])
            site.optimizer.step()

    with InprocCluster(Vec, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), cfg) as c:
        c.run(train, timeout_s=40)
        assert len(set(c.checksums())) == 1
        results = [s.results for s in c.sites]
        statuses = [[o.status.value for o in s.outcomes] for s in c.sites]
    assert statuses == [["applied"] * num_rounds] * 2
    for r in range(1, num_rounds):  # round 0's step time is a first guess
        fast, slow = results[0][r].tokens, results[1][r].tokens
        assert 1 <= slow <= 50 and slow * 2 <= fast <= 50, (r, fast, slow)
    owner_claims = [res.claims for rs in results for res in rs[1:] if res.owned_buckets]
    assert owner_claims and all(set(cl) == {"site-0", "site-1"} for cl in owner_claims)
