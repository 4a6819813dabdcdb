"""Faults on the in-process transport: chunk loss (unbiased mean, error feedback
delivers what was lost), an owner dying mid-round, missed broadcasts (repair and
keep-stale), a killed site."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.codecs import CodecConfig, get_codec
from dtrain.codecs.native import kernels
from dtrain.diloco import DiLoCo
from dtrain.errors import LeftBehind
from dtrain.rounds import BucketOutcome, RoundConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config, fast_rendezvous_config
from dtrain.transports.inproc import FaultRule, InprocFaults

P = 1024  # parameters of the toy model
BUCKETS = BucketConfig(bucket_bytes=1024, chunk_bytes=256)  # 4 buckets of 256 elements, 4 chunks of 64 each
FP32 = CodecConfig(name="fp32")


class Vec(torch.nn.Module):
    """One flat parameter; the tests set its gradient to a chosen contribution."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(P))


def inner_sgd_lr1(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=1.0)  # local = θ − g: the test chooses Δ = g


def outer_sgd_lr1(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0, momentum=0.0)  # θ ← θ − mean: θ's change is the applied mean


def contribute(site: Site, g: torch.Tensor) -> torch.Tensor:
    """One inner step with gradient ``g`` (H=1, so the round runs inside it).
    Returns Δ exactly as the engine computes it: θ − fl(θ − g)."""
    w = site.model.w
    delta = w.detach() - (w.detach() - g)
    w.grad = g.clone()
    site.optimizer.step()
    w.grad = None
    return delta


def lossy_rendezvous(num_sites: int):
    # A lost chunk cannot be told from a late one, so in every lossy round the owner
    # waits reduce_timeout_s: short, but long enough that on a loaded 2-core machine
    # the pushes are not late (late chunks would only count as more loss). 0.4 s was
    # not: under CI's full load every push of one round came after it (0.318 lost at 30%).
    return fast_rendezvous_config(num_sites, reduce_timeout_s=1.0, broadcast_timeout_s=2.0)


def expected_inv_k_minus_inv_n(n: int, p: float) -> float:
    """E[1/k − 1/N] where k = 1 + Binomial(N − 1, 1 − p): the owner's own
    contribution always arrives, each other one is lost with probability p."""
    total = 0.0
    for j in range(n):
        prob = math.comb(n - 1, j) * (1 - p) ** j * p ** (n - 1 - j)
        total += prob * (1.0 / (1 + j) - 1.0 / n)
    return total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss", [0.1, 0.3])
def test_chunk_loss_mean_is_unbiased(loss: float) -> None:
    """Partial mean per chunk (error feedback off: the paper's estimator).

    Site i contributes v = μ + σ·ε (ε ~ N(0, 1) iid per site, round and element).
    The owner divides by the k contributions that arrived; given the set that
    arrived, z = mean_S − mean_all has E[z] = 0 and Var[z] = σ²(1/k − 1/N).
    Over n elements·rounds the average of z has standard deviation
    σ·sqrt(E[1/k − 1/N] / n); we allow 5 of those. Dividing by N instead of k
    would be off by μ·(N − E[k])/N = 0.067 (10%) or 0.2 (30%), far outside.
    """
    N, R, mu, sigma = 3, 8, 1.0, 1.0
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32, error_feedback=False)),
        faults=InprocFaults(push_loss=loss, seed=7),
        rendezvous=lossy_rendezvous(N),
    )
    deltas: dict[tuple[int, int], torch.Tensor] = {}
    observed: dict[tuple[int, int], torch.Tensor] = {}

    def step(site: Site, r: int) -> None:
        g = torch.Generator().manual_seed(1000 * r + site.index)
        before = site.theta()
        deltas[(site.index, r)] = contribute(site, mu + sigma * torch.randn(P, generator=g))
        observed[(site.index, r)] = before - site.theta()

    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        c.run_steps(step, R, timeout_s=50)
        assert all(s.diloco.round == R for s in c.sites)
        assert len(set(c.checksums())) == 1  # every site received every bucket: identical θ
        included = [res.included_fraction for s in c.sites for res in s.results]
    # losses happened at about the configured rate (a site's own chunks are never lost;
    # a late chunk would count as lost too, hence the looser upper side)
    lost = 1 - sum(included) / len(included)
    assert loss * (N - 1) / N - 0.04 < lost < loss * (N - 1) / N + 0.1, lost
    z = []
    for r in range(R):
        full = sum(deltas[(i, r)] for i in range(N)) / N
        for i in range(N):
            assert torch.equal(observed[(i, r)], observed[(0, r)])  # all sites applied the same mean
        z.append(observed[(0, r)] - full)
    z = torch.cat(z).double()
    n = z.numel()
    # late chunks (a loaded machine) add loss; bound with the loss actually measured
    p_eff = max(loss, lost * N / (N - 1))
    bound = 5 * sigma * math.sqrt(expected_inv_k_minus_inv_n(N, p_eff) / n)
    assert abs(float(z.mean())) < bound, (float(z.mean()), bound)
    assert bound < 0.3 * mu * loss * (N - 1) / N  # dividing by N instead of k would fail this test
    assert float(z.abs().max()) > 0.1  # some chunks' means were over fewer senders


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss,codec", [(0.1, "fp32"), (0.3, "fp32"), (0.3, "int8")])
def test_error_feedback_delivers_what_was_lost(loss: float, codec: str) -> None:
    """With error feedback the lost contributions arrive later and nothing counts twice.

    Outer SGD lr=1, momentum 0: θ's total change is the sum of the applied means.
    After R lossy rounds, F rounds without loss and with Δ = 0 flush the residuals.
    Exactly (to fp32 rounding): θ_0 − θ_end + Σ_i residual_i / N equals the true sum
    Σ_r mean_i Δ_{i,r}, and what is left in the residuals is ~0 (fp32: 0; int8:
    the quantisation error of the last, small residual). The broadcast is fp32
    so that only the reduce codec is lossy.
    """
    N, R, F = 3, 6, 2
    rounds = RoundConfig(
        codec=CodecConfig(name=codec, **({"block_size": 8} if codec in ("int8", "int4") else {})), broadcast_codec=FP32
    )
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=rounds),
        faults=InprocFaults(push_loss=loss, seed=11),
        rendezvous=lossy_rendezvous(N),
    )
    deltas: dict[tuple[int, int], torch.Tensor] = {}

    def step(site: Site, r: int) -> None:
        if r == R:  # everyone has finished the lossy rounds before the flush starts
            site.engine.transport.network.set_faults(InprocFaults())
        g = torch.Generator().manual_seed(77 * r + site.index)
        v = torch.randn(P, generator=g) + 0.5 if r < R else torch.zeros(P)
        deltas[(site.index, r)] = contribute(site, v)

    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        theta0 = c.sites[0].theta()
        c.run_steps(step, R + F, timeout_s=50)
        assert len(set(c.checksums())) == 1
        lossy = [res.included_fraction for s in c.sites for res in s.results[:R]]
        assert min(lossy) < 1.0  # chunks were lost
        assert all(res.included_fraction == 1.0 for s in c.sites for res in s.results[-1:])
        applied = theta0 - c.sites[0].theta()
        leftover = sum(torch.cat([t for t in s.state.residuals]) for s in c.sites)
    true_sum = sum(deltas[(i, r)] for i in range(N) for r in range(R + F)) / N
    assert float(true_sum.abs().max()) > 1.0
    err = (applied + leftover / N - true_sum).abs().max().item()
    assert err < 1e-5, err
    assert leftover.abs().max().item() < (1e-7 if codec == "fp32" else 0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [FP32, CodecConfig(name="int8", block_size=8)], ids=["fp32", "int8"])
def test_owner_failing_mid_round_keeps_its_buckets_alike(codec: CodecConfig) -> None:
    """The owner dies after the reduce, before serving its means: survivors keep
    those θ_b unchanged and equal, their contributions stay in their residuals (bit for
    bit: int8's encode settled them in place and the settle restores them), and the next
    round (without the dead site) applies them."""
    N = 3
    rounds = RoundConfig(codec=codec, broadcast_codec=FP32)
    cfg = ClusterConfig(num_sites=N, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=rounds))
    if codec.name == "int8" and kernels() is not None:  # the path under test: each bucket's 4 chunks of 64
        assert get_codec(codec).settles_in_place(torch.zeros(256), [(o, 64) for o in range(0, 256, 64)])
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        owners = c.owners()
        victim = next(i for i, s in enumerate(c.sites) if owners.count(s.site_id) >= 1)
        vid = c.sites[victim].site_id
        dead_buckets = [b for b, o in enumerate(owners) if o == vid]
        live_buckets = [b for b, o in enumerate(owners) if o != vid]
        assert dead_buckets and live_buckets
        c.kill_during_round(victim, round=1)
        snap: dict[int, list[torch.Tensor]] = {}
        kept: dict[int, list[torch.Tensor | None]] = {}
        deltas: dict[tuple[int, int], torch.Tensor] = {}

        def step(site: Site, r: int) -> None:
            if r == 1:
                snap[site.index] = [t.detach().clone() for t in site.state.theta]
                kept[site.index] = [None if t is None else t.clone() for t in site.state.residuals]  # int8: round 0's
            g = torch.Generator().manual_seed(31 * r + site.index)
            deltas[(site.index, r)] = contribute(site, torch.randn(P, generator=g))
            if r == 1 and not site.killed.is_set():
                # after round 1, before round 2: what survived of round 1
                res = site.results[-1]
                assert res.round == 1 and res.members == tuple(s.site_id for s in c.sites)
                assert res.skipped_buckets == len(dead_buckets) and res.stale_buckets == 0
                assert [res.bucket_outcome[b] for b in dead_buckets] == [BucketOutcome.OWNER_LOST] * len(dead_buckets)
                for b in dead_buckets:
                    assert torch.equal(site.state.theta[b].detach(), snap[site.index][b])  # unchanged
                    lay = site.state.layout.buckets[b]
                    want = torch.cat(
                        [deltas[(site.index, 1)][sg.tensor_offset : sg.tensor_offset + sg.numel] for sg in lay.segments]
                    )
                    if kept[site.index][b] is not None:  # what round 0 left (int8's quantization error), plus Δ
                        want = kept[site.index][b] + want
                    assert torch.equal(site.state.residuals[b], want)  # contribution kept whole
                for b in live_buckets:
                    assert not torch.equal(site.state.theta[b].detach(), snap[site.index][b])  # applied

        c.run_steps(step, 3, timeout_s=50)
        survivors = [s for s in c.sites if s.site_id != vid]
        assert c.sites[victim].killed.is_set()
        assert [s.site_id for s in c.live_sites] == [s.site_id for s in survivors]
        assert all(s.diloco.round == 3 for s in survivors)
        assert len(set(c.checksums(survivors))) == 1
        r2 = [s.results[-1] for s in survivors]
        assert all(res.members == tuple(s.site_id for s in survivors) for res in r2)  # round 2 without the dead site
        # Round 2 delivered round 1's kept contributions for the dead owner's buckets:
        # θ's change there = round 0 (all three) + round 2 (survivors, carrying round 1).
        # (For the other buckets round 1 may or may not include the victim's chunks,
        # depending on whether it pushed before it died, so they are only compared.)
        r0 = sum(deltas[(i, 0)] for i in range(N)) / N
        r12 = sum(deltas[(s.index, 1)] + deltas[(s.index, 2)] for s in survivors) / len(survivors)
        mask = torch.zeros(P, dtype=torch.bool)
        for b in dead_buckets:
            for sg in survivors[0].state.layout.buckets[b].segments:
                mask[sg.tensor_offset : sg.tensor_offset + sg.numel] = True
        moved = -survivors[0].theta()  # θ started at 0
        tol = 1e-5 if codec.name == "fp32" else 0.05  # int8: what the last rounds' quantization left in residuals
        assert (moved[mask] - (r0 + r12)[mask]).abs().max().item() < tol


@pytest.mark.timeout(60)
def test_a_member_whose_mean_replies_are_lost_repairs_from_the_owner_in_the_same_round() -> None:
    """Round 1: every answer of one owner to one member's mean pulls is lost (the owner served
    it: on a lossy link the reply is retransmitted until the member's deadline), and with two
    sites no other member holds a copy. The owner keeps its means (a pull was served: the commit
    rule); the member heard from the owner in the broadcast (it pulled the member's means), so
    it does not take the owner as lost: it repairs those buckets from the owner after the
    deadline, and round 1 ends with one θ (before: OWNER_LOST at the member, θ unequal)."""
    N = 2
    cfg = ClusterConfig(
        num_sites=N, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32))
    )
    sums_after_1: dict[int, tuple[str, ...]] = {}
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        owners = c.owners()
        owner = next(i for i, s in enumerate(c.sites) if s.site_id in owners)
        oid = c.sites[owner].site_id
        victim = next(i for i, s in enumerate(c.sites) if i != owner and s.site_id in owners)  # owns buckets too
        its = [b for b, o in enumerate(owners) if o == oid]
        c.network.add_rule(
            FaultRule(
                kind="pull_mean",
                sender=c.sites[victim].site_id,
                dst=c.sites[owner].address,
                round=1,
                action="lose_reply",
            )
        )

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(17 * r + site.index)
            contribute(site, torch.randn(P, generator=g))
            if r == 1:
                res = site.results[-1]
                want = BucketOutcome.REPAIRED if site.index == victim else BucketOutcome.APPLIED
                assert [res.bucket_outcome[b] for b in its] == [want] * len(its), (site.index, res.bucket_outcome)
                sums_after_1[site.index] = tuple(site.state.checksums())

        c.run_steps(step, 2, timeout_s=50)
        assert len(sums_after_1) == N and len(set(sums_after_1.values())) == 1, "θ differs after round 1"


def last_round_unrepaired(c: InprocCluster) -> tuple[DiLoCo, DiLoCo, str, list[int]]:
    """Two sites, two rounds; in the last (1) the member loses every reply of the owner to its
    mean pulls and every state pull of its repair, so the owner's buckets stay STALE there with
    θ_b unlike the owner's. Returns the owner's and the member's DiLoCo, the member's id and
    the owner's buckets."""
    owners = c.owners()
    owner = next(i for i, s in enumerate(c.sites) if s.site_id in owners)
    victim = 1 - owner
    vid, addr = c.sites[victim].site_id, c.sites[owner].address
    c.network.add_rule(FaultRule(kind="pull_mean", sender=vid, dst=addr, round=1, action="lose_reply"))
    c.network.add_rule(FaultRule(kind="pull_state", sender=vid, dst=addr))

    def step(site: Site, r: int) -> None:
        contribute(site, torch.randn(P, generator=torch.Generator().manual_seed(17 * r + site.index)))

    c.run_steps(step, 2, timeout_s=50)
    its = [b for b, o in enumerate(owners) if o == c.sites[owner].site_id]
    o, v = c.sites[owner].diloco, c.sites[victim].diloco
    assert v.engine.unrepaired == its and o.site_checksum() != v.site_checksum()
    return o, v, vid, its


TWO_SITES = ClusterConfig(
    num_sites=2, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32))
)


@pytest.mark.timeout(60)
def test_a_site_whose_last_round_left_a_bucket_unrepaired_does_not_close_done() -> None:
    """The run's last round leaves a bucket STALE at a member (:func:`last_round_unrepaired`):
    no later round can repair it, and its catch-up from the owner fails too (the owner, which
    waited for it, has left). Its close raises LeftBehind naming it, the round its θ is behind
    at and why (the worker exits non-zero), never "done"; the others close normally."""
    with InprocCluster(Vec, inner_sgd_lr1, TWO_SITES, outer_optimizer=outer_sgd_lr1) as c:
        o, v, vid, its = last_round_unrepaired(c)
        o.close()  # the owner: done
        with pytest.raises(
            LeftBehind,
            match=rf"{vid} is left behind at round 1 \(the group is at round 2\): its last round left {len(its)} "
            r"bucket\(s\) stale and unrepaired .*, and catching them up failed: every donor failed",
        ):
            v.close()


@pytest.mark.timeout(60)
def test_a_site_whose_last_round_left_buckets_unrepaired_catches_up_from_a_member_that_waits() -> None:
    """As above, but the link heals once the round is over: the member's heartbeats say it has
    not finished round 1, so the owner keeps serving at close; the member takes round 1's mean
    of each stale bucket again from the owner's kept history (replayed: its θ_b was the
    owner's before the round), before it would export θ, and both close on one θ, the model
    holding it too; the member is no longer LeftBehind."""
    with InprocCluster(Vec, inner_sgd_lr1, TWO_SITES, outer_optimizer=outer_sgd_lr1) as c:
        o, v, vid, its = last_round_unrepaired(c)
        c.network.clear_rules()  # the link heals
        closing = threading.Thread(target=o.close)
        closing.start()
        time.sleep(0.3)
        assert closing.is_alive()  # the owner waits: the member has not finished round 1
        assert v.catch_up_last_round() is None  # what the worker runs before its export and summary
        assert v.site_checksum() == o.site_checksum() and v.round == o.round == 2
        assert v.site.last_catch_up.means_replayed == len(its) and not v.site.last_catch_up.buckets_from
        model = torch.cat([t.detach().flatten() for t in v.local_tensors()])
        assert torch.equal(model, torch.cat([t.flatten() for t in v.state.theta]))
        v.close()  # the same answer: no second catch-up
        closing.join(timeout=20)
        assert not closing.is_alive()


@pytest.mark.timeout(60)
def test_a_round_that_leaves_buckets_unrepaired_mid_run_is_caught_up_before_the_next_inner_phase() -> None:
    """Mid-run, round 1 loses the owner's replies to the member's mean pulls and the member's
    repairs: its buckets stay STALE there. The link heals once the round is over; before the
    next inner phase the member takes round 1's mean of each again from the owner's kept
    history (replayed: its θ_b was the owner's before the round), so round 1 ends with one θ on
    both sites, and round 2 is applied with nothing stale. Left stale, each later round's mean
    missed the member's checksum before and the θ stayed unequal until a repair fitted a round."""
    with InprocCluster(Vec, inner_sgd_lr1, TWO_SITES, outer_optimizer=outer_sgd_lr1) as c:
        owners = c.owners()
        owner = next(i for i, s in enumerate(c.sites) if s.site_id in owners)
        victim = 1 - owner
        vid, addr = c.sites[victim].site_id, c.sites[owner].address
        its = [b for b, o in enumerate(owners) if o == c.sites[owner].site_id]
        c.network.add_rule(FaultRule(kind="pull_mean", sender=vid, dst=addr, round=1, action="lose_reply"))
        c.network.add_rule(FaultRule(kind="pull_state", sender=vid, dst=addr))
        site = c.sites[victim].diloco.site
        catch_up = site.catch_up_last_round

        def healed(outcome):  # the round is over at the member: the link heals
            c.network.clear_rules()
            return catch_up(outcome)

        site.catch_up_last_round = healed
        seen: dict[str, list] = {s.site_id: [] for s in c.sites}
        for s in c.sites:
            s.diloco.on_round.append(seen[s.site_id].append)

        def step(site: Site, r: int) -> None:
            contribute(site, torch.randn(P, generator=torch.Generator().manual_seed(17 * r + site.index)))

        c.run_steps(step, 3, timeout_s=50)
        o, v = c.sites[owner].diloco, c.sites[victim].diloco
        mine = seen[vid][1].result
        assert mine is not None and mine.stale_buckets == len(its) and mine.repaired_buckets == 0
        assert v.site.last_catch_up.means_replayed == len(its) and not v.site.last_catch_up.buckets_from
        sums = [[x.site_checksum for x in seen[s.site_id]] for s in c.sites]
        assert sums[0] == sums[1] and len(sums[0]) == 3  # round 1 too: caught up before it was recorded
        assert seen[vid][2].result is not None and seen[vid][2].result.stale_buckets == 0
        assert v.engine.unrepaired == [] and v.site_checksum() == o.site_checksum()
        model = torch.cat([t.detach().flatten() for t in v.local_tensors()])
        assert torch.equal(model, torch.cat([t.flatten() for t in v.state.theta]))


def cut_off_an_owner(c: InprocCluster, round: int) -> tuple[int, str, list[int]]:
    """Cut every mean pull to the first site that owns buckets, in ``round``: its index, id and buckets."""
    owners = c.owners()
    cut = next(i for i, s in enumerate(c.sites) if s.site_id in owners)
    cid = c.sites[cut].site_id
    c.network.add_rule(FaultRule(kind="pull_mean", dst=c.sites[cut].address, round=round, action="cut"))
    return cut, cid, [b for b, o in enumerate(owners) if o == cid]


@pytest.mark.timeout(60)
def test_an_owner_cut_off_from_the_members_withdraws_its_means_and_every_site_keeps_theta_alike() -> None:
    """Every mean pull to one owner is cut in round 1 (a partition after its reduce: its
    pushes and its own pulls still work). The members give its buckets OWNER_LOST at
    their broadcast deadline; the owner, whose means no member took, withdraws them (the
    commit rule) and rolls θ_b back, so all three sites end round 1 with one θ, and the
    contributions that no mean included are applied in round 2: nothing is lost."""
    N = 3
    cfg = ClusterConfig(
        num_sites=N, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32))
    )
    deltas: dict[tuple[int, int], torch.Tensor] = {}
    sums_after_1: dict[int, tuple[str, ...]] = {}
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        cut, cid, cut_buckets = cut_off_an_owner(c, round=1)
        before: dict[int, list[str]] = {}

        def step(site: Site, r: int) -> None:
            if r == 1:
                before[site.index] = list(site.state.checksums())
            g = torch.Generator().manual_seed(17 * r + site.index)
            deltas[(site.index, r)] = contribute(site, torch.randn(P, generator=g))
            if r == 1:
                res = site.results[-1]
                assert res.round == 1 and len(res.members) == N
                assert [res.bucket_outcome[b] for b in cut_buckets] == [BucketOutcome.OWNER_LOST] * len(cut_buckets)
                assert [site.state.checksum(b) for b in cut_buckets] == [before[site.index][b] for b in cut_buckets]
                sums_after_1[site.index] = tuple(site.state.checksums())

        c.run_steps(step, 3, timeout_s=50)
        assert len(set(sums_after_1.values())) == 1, "θ differs between sites after round 1"
        assert len(set(c.checksums())) == 1
        want = sum(deltas[(i, r)] for i in range(N) for r in range(3)) / N
        assert (-c.sites[cut].theta() - want).abs().max().item() < 1e-5


@pytest.mark.timeout(60)
def test_pulls_from_an_owner_declared_lost_are_given_up_at_once_not_at_the_broadcast_deadline() -> None:
    """As above, every mean pull to one owner is cut in round 1 (its kernel accepts the call,
    nothing answers: a SIGSTOPped owner), and shortly after the members start pulling they
    are told the owner is lost (the rendezvous holds it dead, or rank 0's notice). They give
    its pulls up then, not at the broadcast deadline: its buckets are OWNER_LOST, every
    other bucket applied, and the owner withdraws the means nobody took, so θ is one."""
    N, broadcast_timeout_s = 3, 4.0
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32)),
        rendezvous=fast_rendezvous_config(N, broadcast_timeout_s=broadcast_timeout_s),
    )
    sums_after_1: dict[int, tuple[str, ...]] = {}
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        owners = c.owners()
        cut, cid, cut_buckets = cut_off_an_owner(c, round=1)
        for site in c.sites:
            if site.index != cut:

                def notice(phase: str, r: int, engine=site.engine) -> None:
                    if phase == "before_pull" and r == 1:  # the notice comes while the pulls wait
                        threading.Timer(0.2, engine.members_lost, args=([cid],), kwargs={"why": "test notice"}).start()

                site.engine.fault_hook = notice

        def step(site: Site, r: int) -> None:
            contribute(site, torch.randn(P, generator=torch.Generator().manual_seed(17 * r + site.index)))
            if r == 1:
                res = site.results[-1]
                sums_after_1[site.index] = tuple(site.state.checksums())
                if site.index == cut:
                    return
                assert [res.bucket_outcome[b] for b in cut_buckets] == [BucketOutcome.OWNER_LOST] * len(cut_buckets)
                assert res.calls_given_up == len(cut_buckets), res
                assert res.bucket_outcomes["applied"] == len(owners) - len(cut_buckets), res.bucket_outcomes
                # given up by the notice (0.2 s in), not the deadline: the old wait was the whole 5 s
                assert res.means_s < broadcast_timeout_s / 2, res.means_s

        c.run_steps(step, 2, timeout_s=50)
        assert len(set(sums_after_1.values())) == 1, "θ differs between sites after round 1"


@pytest.mark.timeout(60)
def test_a_site_that_reads_its_plan_after_the_reduce_deadline_takes_the_round_as_missed() -> None:
    """One site stalls (as if SIGSTOPped) between asking for round 1 and reading its plan,
    longer than the plan's reduce timeout. The plan's deadlines are the round's, not the
    moment the site reads it: the site does not run the round (no push refused as late, no
    mean of its own applied alone); it resyncs after it, and every site ends equal."""
    N, R = 3, 1
    rdv = fast_rendezvous_config(N)
    stall_s = rdv.reduce_timeout_s + 0.5
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32)),
        rendezvous=rdv,
    )
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        slow = c.sites[0]
        ready = slow.rendezvous.ready

        def stalled_ready(site_id: str, round: int, timeout_s: float):
            d = ready(site_id, round, timeout_s)
            if d.status == "plan" and d.plan is not None and d.plan.round == R:
                time.sleep(stall_s)  # stopped while the answer waited to be read
                d = ready(site_id, round, timeout_s)  # the same plan, now stall_s older
                assert d.plan is not None and d.plan.age_s >= stall_s
            return d

        slow.rendezvous.ready = stalled_ready  # type: ignore[method-assign]

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(23 * r + site.index)
            contribute(site, torch.randn(P, generator=g))

        c.run_steps(step, 4, timeout_s=50)
        assert len(set(c.checksums())) == 1
        mine = [o for o in slow.outcomes if o.result is None and "past its reduce deadline" in o.reason]
        assert mine and mine[0].status.value == "resynced", [(o.status, o.reason) for o in slow.outcomes]
        assert R not in [res.round for res in slow.results]
        for s in c.sites[1:]:
            r1 = next(res for res in s.results if res.round == R)
            assert slow.site_id in r1.members and not r1.rejected, r1.rejected
            assert r1.stale_buckets == 0


def _owner_and_victim(c: InprocCluster) -> tuple[int, int, int]:
    """(bucket 0, index of its owner, index of another site)."""
    owner = next(s.index for s in c.sites if s.site_id == c.owners()[0])
    return 0, owner, (owner + 1) % len(c.sites)


@pytest.mark.timeout(60)
def test_a_mean_whose_owner_link_stalls_arrives_late_from_a_member_within_the_round() -> None:
    """Every pull of one bucket's mean from its owner stalls (a TCP connection in
    retransmission back-off, as at 30% loss): the late pulls give the owner a short wait,
    then ask a member that holds the mean. The bucket is applied in its own round (a late
    mean, nothing stale), and every site ends with one θ. Before, the owner's one late pull
    waited out the whole late-pull window, the member was never asked, and the bucket was
    stale for the round (measured: a 3-site launch at 30% loss, θ unequal in round 0)."""
    cfg = ClusterConfig(
        num_sites=3, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32))
    )
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        b, owner, victim = _owner_and_victim(c)
        vid, addr = c.sites[victim].site_id, c.sites[owner].address
        c.network.add_rule(FaultRule(kind="pull_mean", sender=vid, dst=addr, round=1, bucket=b, action="cut"))

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(7 * r + site.index)
            contribute(site, torch.randn(P, generator=g))

        c.run_steps(step, 3, timeout_s=50)
        assert len(set(c.checksums())) == 1
        r1 = next(res for res in c.sites[victim].results if res.round == 1)
        assert r1.late_means == 1 and r1.stale_buckets == 0, r1
        assert r1.bucket_outcome[b] is BucketOutcome.APPLIED


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_sites", [2, 3])
def test_missed_broadcast_is_repaired_from_the_owner(num_sites: int, caplog: pytest.LogCaptureFixture) -> None:
    """A site that misses one bucket's mean (every pull of it dropped) marks it
    stale, pulls it whole from the owner and ends with the owner's checksum; its
    included contribution is not sent again. The engine's log lines name the site."""
    caplog.set_level(logging.INFO, logger="dtrain.rounds")
    cfg = ClusterConfig(
        num_sites=num_sites, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32))
    )
    deltas: dict[tuple[int, int], torch.Tensor] = {}
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        b, owner, victim = _owner_and_victim(c)
        c.drop_broadcast(victim, round=1, bucket=b)  # from the owner and from any peer

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(5 * r + site.index)
            deltas[(site.index, r)] = contribute(site, torch.randn(P, generator=g))
            if r == 1:
                res = site.results[-1]
                if site.index == victim:
                    assert res.stale_buckets == 1 and res.repaired_buckets == 1, res
                    assert res.bucket_outcome[b] is BucketOutcome.REPAIRED and res.bucket_outcomes["repaired"] == 1
                else:
                    assert res.stale_buckets == 0
                # a finalized mean included the victim's chunks: its residual for b is consumed
                assert site.state.residuals[b] is None or float(site.state.residuals[b].abs().max()) == 0.0

        c.run_steps(step, 3, timeout_s=50)
        assert len(set(c.checksums())) == 1
        assert c.sites[victim].checksums()[b] == c.sites[owner].checksums()[b]
        # several sites share this process: every engine line says which one it is
        ids = {site.site_id for site in c.sites}
        lines = [rec for rec in caplog.records if rec.name == "dtrain.rounds.engine"]
        assert lines and all(rec.site_id in ids and rec.getMessage().startswith(f"{rec.site_id}: ") for rec in lines)
        vid = c.sites[victim].site_id
        mine = [rec.getMessage() for rec in lines if rec.site_id == vid]
        assert any(m.startswith(f"{vid}: round 1: bucket {b} stale: its mean never arrived from ") for m in mine), mine
        assert any(m.startswith(f"{vid}: round 1: bucket {b} repaired from ") for m in mine), mine
        assert all(res.stale_buckets == 0 for s in c.sites for res in s.results[2:])
        # nothing counted twice: θ moved by exactly the mean of every Δ
        want = sum(deltas[(i, r)] for i in range(num_sites) for r in range(3)) / num_sites
        assert (-c.sites[victim].theta() - want).abs().max().item() < 1e-5


@pytest.mark.timeout(60)
def test_pull_loss_everyone_ends_equal() -> None:
    """Random loss of half the mean replies: the late pulls, pass after pass over the owner
    and the members, get every lost mean within the round (none is left to repair), and
    every site ends with the same θ. (The repair of a mean no late pull gets:
    ``test_missed_broadcast_is_repaired_from_the_owner``.)"""
    N = 3
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32)),
        faults=InprocFaults(pull_loss=0.5, seed=3),
    )
    with InprocCluster(Vec, inner_sgd_lr1, cfg) as c:

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(9 * r + site.index)
            contribute(site, torch.randn(P, generator=g))

        c.run_steps(step, 8, timeout_s=50)
        assert len(set(c.checksums())) == 1
        late = sum(res.late_means for s in c.sites for res in s.results)
        stale = sum(res.stale_buckets for s in c.sites for res in s.results)
        assert late > 0 and stale == 0, (late, stale)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_keep_stale_without_repair_drift_stays_bounded(momentum: float) -> None:
    """RoundConfig(repair=False): a site that missed a broadcast keeps its old θ_b
    (stale, as in arXiv 2507.07114 §4.2) but keeps applying later means, so its
    distance to the owner stays bounded: constant with momentum 0, and with
    Nesterov momentum μ it settles (the missed step's momentum decays as μ^k)."""
    N, R = 2, 10
    outer = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=momentum, nesterov=momentum > 0)  # noqa: E731
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32, repair=False)),
    )
    drift: list[float] = []
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer) as c:
        b, owner, victim = _owner_and_victim(c)
        c.drop_broadcast(victim, round=1, bucket=b)
        step_size: list[float] = []

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(3 * r + site.index)
            before = site.state.theta[b].detach().clone()
            contribute(site, torch.randn(P, generator=g) * 0.1)
            if site.index == owner:
                step_size.append(float((site.state.theta[b].detach() - before).norm()))

        for r in range(R):  # one round at a time, so the drift is measured after each
            c.run_steps(lambda site, _k: step(site, r), 1, timeout_s=20)
            drift.append(
                float((c.sites[owner].state.theta[b].detach() - c.sites[victim].state.theta[b].detach()).norm())
            )
        stale = [res.stale_buckets for res in c.sites[victim].results]
        others = [i for i in range(len(c.sites[0].state)) if i != b]
        assert all(c.sites[owner].checksums()[i] == c.sites[victim].checksums()[i] for i in others)
    assert drift[0] == 0.0 and drift[1] > 0.0  # the miss made it stale ...
    assert stale[0] == 0 and all(s == 1 for s in stale[1:])  # ... and it stays stale (no repair)
    assert max(drift) < 3 * max(step_size) / (1 - momentum)  # bounded by a few missed steps
    if momentum == 0.0:
        assert all(abs(d - drift[1]) < 1e-5 for d in drift[1:])  # exactly the one missed step
    else:
        assert abs(drift[-1] - drift[-2]) < 0.2 * drift[-1]  # settling, not growing


@pytest.mark.timeout(60)
def test_killed_site_is_dropped_and_the_rest_continue() -> None:
    """A site killed between rounds: once its heartbeats stop the others form the
    next rounds without it, and end equal."""
    N = 3
    cfg = ClusterConfig(
        num_sites=N, diloco=fast_diloco_config(sync_every=2, buckets=BUCKETS, rounds=RoundConfig(codec=FP32))
    )
    with InprocCluster(Vec, inner_sgd_lr1, cfg) as c:

        def step(site: Site, k: int) -> None:
            if k == 4 and site.index == 2:
                c.kill(2)
                return
            g = torch.Generator().manual_seed(k + 100 * site.index)
            contribute(site, torch.randn(P, generator=g) * 0.1)

        c.run_steps(step, 8, timeout_s=50)
        live = c.live_sites
        assert [s.index for s in live] == [0, 1]
        assert all(s.diloco.round == 4 for s in live)
        assert len(set(c.checksums())) == 1
        assert live[0].results[-1].members == ("site-0", "site-1")
        assert c.sites[2].diloco.round == 2


@pytest.mark.timeout(60)
def test_owners_stop_waiting_for_a_member_the_rendezvous_declares_dead() -> None:
    """A member dies at its first push of round 1 (none of its chunks to that owner arrive).
    The owners would wait for its chunks until the reduce deadline; once the
    rendezvous holds it dead (no heartbeat for 0.5 s) their heartbeats say so and they
    finalize with what arrived: the round ends long before the deadline (6 s), every survivor
    applies it, and the survivors end equal."""
    N = 3
    rdv = fast_rendezvous_config(N, heartbeat_timeout_s=0.5, reduce_timeout_s=6.0, broadcast_timeout_s=12.0)
    cfg = ClusterConfig(
        num_sites=N,
        diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=RoundConfig(codec=FP32)),
        rendezvous=rdv,
    )
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        owners = c.owners()
        victim = min(range(N), key=lambda i: owners.count(c.sites[i].site_id))  # owns the fewest buckets
        vid = c.sites[victim].site_id
        lost_buckets = owners.count(vid)  # its means are never served: skipped alike by every survivor
        c.network.add_rule(FaultRule(kind="push", sender=vid, round=1, action="kill_src", times=1))

        def step(site: Site, r: int) -> None:
            g = torch.Generator().manual_seed(17 * r + site.index)
            contribute(site, torch.randn(P, generator=g))

        c.run_steps(step, 3, timeout_s=50)
        survivors = [s for s in c.sites if s.site_id != vid]
        assert c.sites[victim].killed.is_set()
        for s in survivors:
            r1 = next(res for res in s.results if res.round == 1)
            assert r1.members == tuple(x.site_id for x in c.sites)  # the victim was a member of round 1
            # its own buckets' means are skipped, unless it served one before its first remote push
            # killed it (on a loaded machine its push threads can start after the survivors' pushes
            # completed its bucket and one survivor pulled the mean): that survivor applied it and the
            # other finds it stale in round 2 and repairs it (the checksums below end equal)
            assert r1.applied_buckets + r1.skipped_buckets == len(owners) and r1.skipped_buckets <= lost_buckets
            assert r1.stale_buckets == 0
            if any(o == s.site_id for o in owners) and r1.reduce_arrived_fraction < 1.0:
                # an owner that lacked the victim's chunks was told by its heartbeat (one whose
                # chunks all arrived before the kill finalized at once and needed no telling:
                # the victim pushes to its owners concurrently, so which owner it reached first varies)
                assert r1.lost_members == [vid]
            # heartbeat timeout 0.5 s + a heartbeat or two (~0.55 s measured), far from the 6 s reduce deadline
            assert r1.total_s < 3.0, r1.total_s
        # the push the victim died in reached no chunk: at least one owner lacked its chunks
        assert any(next(res for res in s.results if res.round == 1).reduce_arrived_fraction < 1.0 for s in survivors)
        # Each survivor skipped the victim's buckets or applied their means: on a loaded machine
        # the victim's bucket can complete and be served to both survivors before its first
        # remote push kills it (then nobody skips it). Either way the survivors end equal (below).
        skipped = [next(res for res in s.results if res.round == 1).skipped_buckets for s in survivors]
        assert all(0 <= k <= lost_buckets for k in skipped), (skipped, lost_buckets)
        assert all(s.diloco.round == 3 for s in survivors)
        assert len(set(c.checksums(survivors))) == 1


@pytest.mark.timeout(60)
def test_what_a_trimmed_mean_cut_is_in_each_owners_round_result() -> None:
    """3 sites, trim_fraction 0.34 (one value cut at each end of every coordinate): one site
    sends a contribution 1000x the others'. Every owner's round result names it as cut at
    every element of the buckets it owns (the highest value everywhere), and θ stays one."""
    from dtrain.configs import AggregationConfig

    N = 3
    rounds = RoundConfig(codec=FP32, aggregation=AggregationConfig(trim_fraction=0.34))
    cfg = ClusterConfig(num_sites=N, diloco=fast_diloco_config(sync_every=1, buckets=BUCKETS, rounds=rounds))
    with InprocCluster(Vec, inner_sgd_lr1, cfg, outer_optimizer=outer_sgd_lr1) as c:
        owners, loud = c.owners(), c.sites[-1].site_id
        numel = {b: bk.numel for b, bk in enumerate(c.sites[0].state.layout.buckets)}

        def step(site: Site, r: int) -> None:
            g = torch.rand(P, generator=torch.Generator().manual_seed(r * N + site.index)) + 1.0
            contribute(site, g * (1000.0 if site.site_id == loud else 1.0))

        c.run_steps(step, 1, timeout_s=30)
        for site in c.sites:
            res = site.results[-1]
            mine = sum(numel[b] for b, o in enumerate(owners) if o == site.site_id)
            assert res.trimmed.get(loud, 0) == mine, (site.site_id, res.trimmed)
            # the other end of each coordinate: one of the two quiet sites, all of them together
            assert sum(n for s, n in res.trimmed.items() if s != loud) == mine, res.trimmed
        assert len(set(c.checksums())) == 1
