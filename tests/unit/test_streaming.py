"""Streaming DiLoCo (dtrain/streaming.py): the fragment schedule, a 2-site F = 2 example
computed by hand, F = 1 τ = 0 through the new path equal to today's rounds bit for bit,
and an overlapped round that no inner step waits for."""

from __future__ import annotations

import time

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.configs import AggregationConfig, DiLoCoConfig, RoundConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config
from dtrain.streaming import fragment_buckets, fragment_of_round, step_actions
from dtrain.transports.inproc import InprocFaults
from experiments.delayed_momentum import LR, MOMENTUM, OVERLAP, ROUNDS, SITES, UPDATE, H, final_loss
from experiments.lab import Point

pytestmark = pytest.mark.timeout(60)

ONE_ELEMENT_BUCKETS = BucketConfig(bucket_bytes=4, chunk_bytes=4)  # bucket b = element b of the model


class Vec(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def outer_sgd_half(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.0)  # θ ← θ − 0.5·mean(Δ)


# ------------------------------------------------------------------ the schedule
def test_fragments_are_contiguous_groups_of_buckets():
    assert fragment_buckets(5, 2) == [(0, 1, 2), (3, 4)]
    assert fragment_buckets(4, 4) == [(0,), (1,), (2,), (3,)]
    assert fragment_buckets(3, 1) == [(0, 1, 2)]
    with pytest.raises(ValueError, match="num_fragments"):
        fragment_buckets(2, 3)


def test_round_r_syncs_fragment_r_plus_1_mod_f():
    # rounds at steps H/F, 2H/F, ...: fragment f at f*H/F + k*H (F = 4, H = 8: steps 2, 4, 6, 8, 10)
    assert [fragment_of_round(r, 4) for r in range(5)] == [1, 2, 3, 0, 1]
    assert [fragment_of_round(r, 1) for r in range(3)] == [0, 0, 0]


def test_step_actions_start_every_period_and_apply_tau_later():
    assert step_actions(2, period=2, overlap_steps=0, apply_at=None) == ("start", "apply")
    assert step_actions(1, period=2, overlap_steps=1, apply_at=None) == ()
    assert step_actions(2, period=2, overlap_steps=1, apply_at=None) == ("start",)
    assert step_actions(3, period=2, overlap_steps=1, apply_at=3) == ("apply",)
    # τ = H/F, F > 1: the round in flight (another fragment) is merged, then the next one starts
    assert step_actions(4, period=2, overlap_steps=2, apply_at=4, num_fragments=2) == ("apply", "start")
    # τ = H, F = 1 (one-step-delayed): Δ measured first, then the previous round merged, then sent
    assert step_actions(8, period=4, overlap_steps=4, apply_at=8, num_fragments=1) == ("measure", "apply", "submit")
    assert step_actions(4, period=4, overlap_steps=4, apply_at=None, num_fragments=1) == ("measure", "apply", "submit")


def test_config_refuses_bad_streaming_fields():
    with pytest.raises(ValueError, match="num_fragments"):
        DiLoCoConfig(sync_every=10, num_fragments=3)
    with pytest.raises(ValueError, match="overlap_steps"):
        DiLoCoConfig(sync_every=10, num_fragments=2, overlap_steps=6)
    with pytest.raises(ValueError, match="merge_alpha"):
        DiLoCoConfig(merge_alpha=1.5)
    # α in the one-step-delayed mode's eager merge would be silently ignored: refused, naming why
    with pytest.raises(ValueError, match="merge_alpha 0.5 has nothing to apply to .* use delayed_update stale"):
        DiLoCoConfig(sync_every=10, overlap_steps=10, merge_alpha=0.5)
    assert DiLoCoConfig(sync_every=10, overlap_steps=10, merge_alpha=0.5, delayed_update="stale").merge_alpha == 0.5
    assert not DiLoCoConfig().streaming and DiLoCoConfig(sync_every=4, overlap_steps=4).streaming


# ------------------------------------------------------------------ the example by hand
GRADS = ([1.0, 2.0], [3.0, 4.0])  # site i's constant gradient of w (inner SGD lr 1: local −= g_i per step)


def by_hand(tau: int, alpha: float, num_steps: int, H: int = 4, F: int = 2) -> list[float]:
    """The algorithm on paper (plain floats): θ per element; F = 2: each element its own
    fragment; F = 1: one fragment of both. At a start step: measure Δ against θ, merge the
    round that is due, then the outer step θ_new = θ − 0.5·mean(Δ) on the θ of that moment."""
    theta = [0.0, 0.0]
    local = [[0.0, 0.0], [0.0, 0.0]]
    pending = None  # (apply_at, elements, θ_new per element)
    rnd = 0

    def merge() -> None:
        nonlocal pending
        _, elems, new = pending
        for p, v in zip(elems, new):
            theta[p] = v
            for i in range(2):
                local[i][p] = (1 - alpha) * v + alpha * local[i][p]
        pending = None

    for s in range(1, num_steps + 1):
        for i, g in enumerate(GRADS):
            local[i] = [x - gi for x, gi in zip(local[i], g)]
        start = s % (H // F) == 0
        elems = [(rnd + 1) % F] if F == 2 else [0, 1]  # round r syncs fragment (r + 1) mod F
        mean_delta = [sum(theta[p] - local[i][p] for i in range(2)) / 2 for p in elems]  # Δ at the start step
        if pending and s == pending[0]:
            merge()
        elif start and F == 1 and tau == H:  # one-step-delayed, first round: restart from θ as it is
            for p in elems:
                for i in range(2):
                    local[i][p] = (1 - alpha) * theta[p] + alpha * local[i][p]
        if start:
            pending = (s + tau, elems, [theta[p] - 0.5 * d for p, d in zip(elems, mean_delta)])
            rnd += 1
            if tau == 0:
                merge()
    return theta


def test_by_hand_first_rounds():
    # τ = 0, α = 0 (worked out above by_hand's loop): step 2 syncs element 1: Δ = (4, 8), θ1 = −3;
    # step 4 element 0: Δ = (4, 12), θ0 = −4; step 6 element 1: locals −11, −19, Δ = (8, 16), θ1 = −9.
    assert by_hand(0, 0.0, 6) == [-4.0, -9.0]
    # τ = 1, α = 0.5: the step-2 round lands at step 3: θ1 = −3, locals (−6, −12) → (−4.5, −7.5).
    assert by_hand(1, 0.5, 3) == [0.0, -3.0]


def _run_cluster(tau: int, alpha: float, num_steps: int) -> InprocCluster:
    cfg = ClusterConfig(
        num_sites=2,
        diloco=fast_diloco_config(
            sync_every=4, buckets=ONE_ELEMENT_BUCKETS, num_fragments=2, overlap_steps=tau, merge_alpha=alpha
        ),
    )
    cluster = InprocCluster(
        lambda: Vec(2), lambda m: torch.optim.SGD(m.parameters(), lr=1.0), cfg, outer_optimizer=outer_sgd_half
    )

    def step(site: Site, k: int) -> None:
        site.model.w.grad = torch.tensor(GRADS[site.index])
        site.optimizer.step()
        site.model.w.grad = None

    cluster.run_steps(step, num_steps, timeout_s=40)
    return cluster


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_two_sites_two_fragments_match_the_example_by_hand(tau: int, alpha: float):
    num_steps = 12  # six fragment rounds (steps 2, 4, ..., 12); with τ = 1 the last is merged by close()
    with _run_cluster(tau, alpha, num_steps) as cluster:
        for site in cluster.sites:
            site.diloco.close()  # merges the round still in flight (τ = 1: the one started at step 12)
        want = by_hand(tau, alpha, num_steps + tau)
        for site in cluster.sites:
            assert site.theta().tolist() == pytest.approx(want, abs=1e-6)
            assert [r.fragment for r in site.results] == [1, 0, 1, 0, 1, 0]
            assert [r.buckets for r in site.results] == [[1], [0], [1], [0], [1], [0]]
        assert len(set(cluster.checksums())) == 1


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_one_step_delayed_mode_matches_the_example_by_hand(alpha: float):
    """F = 1, τ = H (DiLoCoX's one-step delay): round r's exchange runs during round r+1's inner
    phase; Δ of round r+1 is the model's own H steps (not the outer update merged meanwhile)."""
    # by hand, α = 0: step 4: Δ = (4, 8 | 12, 16), mean (8, 12), the models restart from θ = 0, and
    # θ = (−4, −6) lands at step 8; there Δ (the steps 5..8 from 0) = (4, 8 | 12, 16) is measured first,
    # then θ = (−4, −6) merged, then its outer step: θ = (−4, −6) − 0.5·(8, 12), landing at step 12.
    assert by_hand(4, 0.0, 8, H=4, F=1) == [-4.0, -6.0]
    assert by_hand(4, 0.0, 12, H=4, F=1) == [-8.0, -12.0]
    cfg = ClusterConfig(
        num_sites=2,
        diloco=fast_diloco_config(
            sync_every=4,
            buckets=ONE_ELEMENT_BUCKETS,
            num_fragments=1,
            overlap_steps=4,
            merge_alpha=alpha,
            delayed_update="stale",
        ),
    )
    with InprocCluster(
        lambda: Vec(2), lambda m: torch.optim.SGD(m.parameters(), lr=1.0), cfg, outer_optimizer=outer_sgd_half
    ) as cluster:

        def step(site: Site, k: int) -> None:
            site.model.w.grad = torch.tensor(GRADS[site.index])
            site.optimizer.step()
            site.model.w.grad = None

        cluster.run_steps(step, 16, timeout_s=40)
        for site in cluster.sites:
            site.diloco.close()
        want = by_hand(4, alpha, 20, H=4, F=1)  # the round started at step 16 is merged by close()
        for site in cluster.sites:
            assert site.theta().tolist() == pytest.approx(want, abs=1e-6)
            assert [r.fragment for r in site.results] == [0, 0, 0, 0]
        assert len(set(cluster.checksums())) == 1


def test_merge_keeps_alpha_of_the_local_steps():
    # τ = 1, α = 0.5 after the first merge (step 3): local element 1 = 0.5·θ1 + 0.5·local.
    with _run_cluster(1, 0.5, 3) as cluster:
        w = [s.model.w.detach().tolist() for s in cluster.sites]
        assert w[0] == pytest.approx([-3.0, 0.5 * -3.0 + 0.5 * -6.0])
        assert w[1] == pytest.approx([-9.0, 0.5 * -3.0 + 0.5 * -12.0])


# ------------------------------------------------------------------ F = 1, τ = 0 is today's round
def _theta_after(streaming_path: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    cfg = ClusterConfig(
        num_sites=2, diloco=fast_diloco_config(sync_every=3, buckets=BucketConfig(bucket_bytes=64, chunk_bytes=32))
    )
    cluster = InprocCluster(
        lambda: torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1)),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        cfg,
    )
    if streaming_path:  # the same rounds through dtrain.streaming with F = 1, τ = 0, α = 0
        for s in cluster.sites:
            assert not s.diloco.config.streaming  # F = 1, τ = 0, α = 0
            s.diloco.streaming = s.diloco._streaming_sync(s.diloco.config)
    gen = [torch.Generator().manual_seed(i) for i in range(2)]

    def step(site: Site, k: int) -> None:
        x = torch.randn(8, 6, generator=gen[site.index])
        loss = (site.model(x) ** 2).mean()
        loss.backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    with cluster:
        cluster.run_steps(step, 9, timeout_s=40)
        assert all(len(s.results) == 3 for s in cluster.sites)
        return [torch.cat([p.detach().flatten() for p in s.model.parameters()]) for s in cluster.sites] + [
            cluster.sites[0].theta()
        ]


def test_one_fragment_without_overlap_is_todays_round_bit_for_bit():
    old, new = _theta_after(False), _theta_after(True)
    for a, b in zip(old, new):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ overlap: no step waits
def _waited_steps(tau: int, delay_s: float) -> tuple[int, int]:
    cfg = ClusterConfig(
        num_sites=2,
        diloco=fast_diloco_config(sync_every=6, buckets=ONE_ELEMENT_BUCKETS, overlap_steps=tau, merge_alpha=0.5),
        faults=InprocFaults(delay_s=delay_s),
    )
    cluster = InprocCluster(lambda: Vec(2), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), cfg)

    def step(site: Site, k: int) -> None:
        time.sleep(0.1)  # an inner step of 0.1 s: τ = 5 steps is 25x the exchanges' 0.02 s
        site.model.w.grad = torch.ones(2)
        site.optimizer.step()
        site.model.w.grad = None

    with cluster:
        cluster.run_steps(step, 17, timeout_s=40)  # rounds start at steps 6 and 12, merged by 17
        waited = [s.diloco.streaming.num_waited_steps for s in cluster.sites]
        rounds = [len(s.results) for s in cluster.sites]
        assert len(set(cluster.checksums())) == 1
    return max(waited), min(rounds)


def test_with_overlap_no_inner_step_waits_on_a_delayed_network():
    waited, rounds = _waited_steps(tau=5, delay_s=0.02)
    assert rounds == 2 and waited == 0
    # the same delay without overlap (τ = 0): every round waits
    waited0, rounds0 = _waited_steps(tau=0, delay_s=0.02)
    assert rounds0 == 2 and waited0 == 2


# ------------------------------------------------------------------ time-based fragment rounds
@pytest.mark.parametrize(
    "num_fragments, overlap_steps",
    [(2, 1), (1, 30)],  # F = 2, τ = 1; the one-step-delayed mode (F = 1, τ = H: τ is every period's length)
)
def test_time_based_fragment_rounds_with_one_site_slowed(num_fragments: int, overlap_steps: int):
    """round_window_s with fragments and overlap (issue 34, "a fragment's window"): a fragment
    round every W/F seconds of compute at each site. The site 5x slower trains fewer steps a
    fragment period, both sync the same fragment in every round, θ agrees after every merge,
    each claim is the steps its site trained since that fragment's last round, and the run
    ends after the configured rounds however many steps that took."""
    num_rounds, step_sleep_s, F = 6, {0: 0.004, 1: 0.020}, num_fragments
    rounds_cfg = RoundConfig(aggregation=AggregationConfig(token_weighted=True))
    diloco = fast_diloco_config(
        sync_every=30 * F,  # the bound: H/F = 30 steps a period
        buckets=ONE_ELEMENT_BUCKETS,
        num_fragments=F,
        overlap_steps=overlap_steps,
        round_window_s=0.08 * F,  # a fragment round every 0.08 s of compute: ~20 fast steps, ~5 slow ones
        rounds=rounds_cfg,
    )
    cfg = ClusterConfig(num_sites=2, diloco=diloco)
    starts: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # per site: (round started, its inner step)

    def train(site: Site) -> None:
        d = site.diloco
        while not (d.streaming.started_round is not None and d.streaming.started_round >= num_rounds - 1):
            time.sleep(step_sleep_s[site.index])
            site.model.w.grad = torch.ones(4) * (site.index + 1)
            site.optimizer.step()
            site.model.w.grad = None
            if d.streaming.started_round is not None and (
                not starts[site.index] or starts[site.index][-1][0] != d.streaming.started_round
            ):
                starts[site.index].append((d.streaming.started_round, d.inner_steps))
        d.flush()  # the last round, merged at its start step (as dtrain worker ends a run)

    with InprocCluster(lambda: Vec(4), lambda m: torch.optim.SGD(m.parameters(), lr=0.01), cfg) as c:
        c.run(train, timeout_s=40)
        outcomes = [s.outcomes for s in c.sites]
        assert [s.diloco.model_round for s in c.sites] == [num_rounds] * 2
    for i in (0, 1):
        assert [r for r, _ in starts[i]] == list(range(num_rounds)), starts[i]
        assert [o.status.value for o in outcomes[i]] == ["applied"] * num_rounds
        assert [o.result.fragment for o in outcomes[i]] == [(r + 1) % F for r in range(num_rounds)]
        assert [o.result.round for o in outcomes[i]] == list(range(num_rounds))
        # the claim: the steps since that fragment's last round started (its first: since step 0)
        steps = [k for _, k in starts[i]]
        want = [steps[r] - (steps[r - F] if r >= F else 0) for r in range(num_rounds)]
        assert [o.result.tokens for o in outcomes[i]] == want, (i, steps)
    for r in range(num_rounds):  # θ agrees after every merge
        assert outcomes[0][r].site_checksum == outcomes[1][r].site_checksum, r
    periods = {i: [b - a for (_, a), (_, b) in zip(starts[i], starts[i][1:])] for i in (0, 1)}
    assert all(1 <= p <= 30 for ps in periods.values() for p in ps), periods
    # after the first period (no step time measured yet) the slow site trains fewer steps a period
    assert all(slow < fast for fast, slow in zip(periods[0][1:], periods[1][1:])), periods
    assert 2 * sum(periods[1][1:]) <= sum(periods[0][1:]), periods


# ------------------------------------------------------------------ one-step delay: Δ is the model's own steps
def _regression_loss(delayed: bool) -> float:
    """θ's loss on fresh data after 160 inner steps of 2 sites (H = 8, outer step = plain averaging,
    the stale merge): the task of experiments/delayed_momentum.py, seed 0."""
    settings = {SITES: 2, H: 8, ROUNDS: 20, MOMENTUM: 0.0, LR: 1.0, UPDATE: "stale", OVERLAP: 8 if delayed else 0}
    point = Point(experiment="delayed_momentum", config="delayed" if delayed else "blocking", seed=0, settings=settings)
    return float(final_loss(point).row["final_loss"])


def test_one_step_delayed_mode_learns_as_blocking_rounds_do_with_plain_averaging():
    """With θ ← mean of the sites' models (outer SGD lr 1) a one-round delay costs little: 0.1682
    against 0.1677 when measured. Without the snapshot's shift (Δ measured against a θ that already
    holds the merged round) it was 0.1901: the outer update counted twice."""
    blocking, delayed = _regression_loss(False), _regression_loss(True)
    assert abs(delayed - blocking) / blocking < 0.03, (blocking, delayed)
