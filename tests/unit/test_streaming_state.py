"""Streaming rounds and a site's state (issue 15): a state_dict taken while a fragment round is
in flight restores to the group's θ, and a hand-called DiLoCo.sync() with fragments configured
merges the round in flight, then syncs the whole model."""

from __future__ import annotations

import threading

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.configs import DiLoCoConfig
from dtrain.diloco import DiLoCo
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config
from dtrain.transports.inproc import InprocFaults

pytestmark = pytest.mark.timeout(60)

ONE_ELEMENT_BUCKETS = BucketConfig(bucket_bytes=4, chunk_bytes=4)
GRADS = ([1.0, 2.0], [3.0, 4.0])


class Vec(torch.nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def _cluster(tau: int, delay_s: float) -> InprocCluster:
    cfg = ClusterConfig(
        num_sites=2,
        diloco=fast_diloco_config(
            sync_every=4, buckets=ONE_ELEMENT_BUCKETS, num_fragments=2, overlap_steps=tau, merge_alpha=0.5
        ),
        faults=InprocFaults(delay_s=delay_s),
    )
    return InprocCluster(lambda: Vec(), lambda m: torch.optim.SGD(m.parameters(), lr=1.0), cfg, outer_optimizer=_outer)


def _outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _step(site: Site, k: int) -> None:
    site.model.w.grad = torch.tensor(GRADS[site.index])
    site.optimizer.step()
    site.model.w.grad = None


def test_state_dict_with_a_fragment_round_in_flight_restores_to_the_groups_theta():
    # τ = H/F = 2: at step 6 the round of step 4 is merged and fragment 0's round starts; each
    # message is delayed 0.2 s, so it is still in flight when the state_dicts are taken
    with _cluster(tau=2, delay_s=0.2) as cluster:
        cluster.run_steps(_step, 6, timeout_s=40)
        assert all(s.diloco.streaming.in_flight for s in cluster.sites)
        sds = [s.diloco.state_dict() for s in cluster.sites]
        for s in cluster.sites:
            s.diloco.close()  # merges the round (no further round runs)
        want = cluster.sites[1].checksums()
        assert len(set(cluster.checksums())) == 1
    for sd in sds:
        assert sd["round"] == 3  # rounds at steps 2, 4 and 6: the one in flight is in the state
        fresh = DiLoCo(
            Vec(),
            torch.optim.SGD(Vec().parameters(), lr=1.0),
            config=DiLoCoConfig(site_id="restored", sync_every=4, buckets=ONE_ELEMENT_BUCKETS),
            outer_optimizer=_outer,
        )
        with fresh:
            fresh.load_state_dict(sd)
            assert tuple(fresh.state.checksums()) == want and fresh.round == 3
            # the outer state came along too: the momentum buffers are the group's
            mom = [o.state[p]["momentum_buffer"] for o in fresh.state.optimizers for p in o.param_groups[0]["params"]]
            assert all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in mom)


def test_hand_called_sync_merges_the_round_in_flight_then_syncs_the_whole_model():
    with _cluster(tau=1, delay_s=0.05) as cluster:
        cluster.run_steps(_step, 4, timeout_s=40)  # rounds start at 2 (merged at 3) and 4 (in flight)
        assert all(s.diloco.streaming.in_flight for s in cluster.sites)
        outcomes: dict[int, object] = {}

        def sync(site: Site) -> None:
            outcomes[site.index] = site.diloco.sync()

        threads = [threading.Thread(target=sync, args=(s,)) for s in cluster.sites]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for s in cluster.sites:
            assert not s.diloco.streaming.in_flight  # the fragment round was merged first
            res = [r for r in s.results]
            assert [r.fragment for r in res] == [1, 0, None]  # two fragment rounds, then the whole model
            assert res[-1].buckets == [0, 1] and outcomes[s.index].status == "applied"
            assert s.model.w.detach().tolist() == s.theta().tolist()  # the model is the group's θ
            assert s.state.rounds_applied == 3
        assert len(set(cluster.checksums())) == 1
        # the schedule goes on alike: the next fragment round (round 3: fragment 0) at step 6
        cluster.run_steps(_step, 3, timeout_s=40)
        for s in cluster.sites:
            s.diloco.close()
            assert [r.fragment for r in s.results] == [1, 0, None, 0]
        assert len(set(cluster.checksums())) == 1


def test_eager_delayed_mode_keeps_the_models_own_steps_on_the_merged_theta():
    """F = 1, τ = H, eager merge, by hand (outer SGD lr 0.5, site i's gradient g_i constant, inner
    lr 1): at step 4 each Δ_i = 4·g_i is sent; at step 8 θ_1 = −0.5·mean(4·g) = (−4, −6) is
    merged and each model keeps its own steps 5..8: local_i = θ_1 − 4·g_i; at step 12 likewise
    on θ_2 = (−8, −12): local_i = θ_2 − 4·g_i (the stale merge would restart both at θ_2)."""
    cfg = ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=4, buckets=ONE_ELEMENT_BUCKETS, num_fragments=1, overlap_steps=4, delayed_update="eager"))  # fmt: skip
    with InprocCluster(
        lambda: Vec(),
        lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
        cfg,
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
    ) as cluster:
        cluster.run_steps(_step, 12, timeout_s=40)
        want = {0: [-8.0 - 4.0, -12.0 - 8.0], 1: [-8.0 - 12.0, -12.0 - 16.0]}
        for s in cluster.sites:
            assert s.model.w.detach().tolist() == pytest.approx(want[s.index], abs=1e-6)
        for s in cluster.sites:
            s.diloco.close()  # merges the round sent at step 12: θ_3 = θ_2 − 0.5·mean(4·g)
        for s in cluster.sites:
            assert s.theta().tolist() == pytest.approx([-12.0, -18.0], abs=1e-6)
        assert len(set(cluster.checksums())) == 1


def test_the_delayed_mode_defaults_to_a_lower_outer_momentum():
    from dtrain.state import DELAYED_OUTER_MOMENTUM  # noqa: PLC0415

    cfg = DiLoCoConfig(sync_every=4, overlap_steps=4, buckets=ONE_ELEMENT_BUCKETS)
    assert cfg.one_step_delayed and cfg.delayed_update == "eager"
    with DiLoCo(Vec(), torch.optim.SGD(Vec().parameters(), lr=1.0), config=cfg) as d:
        assert d.state.optimizers[0].param_groups[0]["momentum"] == DELAYED_OUTER_MOMENTUM < 0.9
    with DiLoCo(Vec(), torch.optim.SGD(Vec().parameters(), lr=1.0), config=DiLoCoConfig(sync_every=4)) as d:
        assert d.state.optimizers[0].param_groups[0]["momentum"] == 0.9
