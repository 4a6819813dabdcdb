"""Token-weighted means (AggregationConfig.token_weighted, issue 34): equal claims give bit for
bit today's mean, the weighted mean is unbiased under random loss, an oversized claim is
refused and counted, and the combinations that cannot work are refused at start."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from dtrain.aggregation import (
    AggregationConfig,
    BucketAccumulator,
    claim_decision,
    mean_factor,
    partial_mean,
    weighted_trimmed_mean,
)
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import Contribution, Member, RoundPlan
from dtrain.rounds.owner import OpenRound

pytestmark = pytest.mark.timeout(60)

T0 = 100.0
CHUNKS = [((0, 5), (5, 5), (10, 3))]  # one bucket of three chunks, owned by "a"
SENDERS = ("a", "b", "c", "d")


def _round(tokens: int = 0, members=SENDERS, **agg) -> OpenRound:
    plan = RoundPlan(
        round=7,
        members=tuple(Member(site_id=s, address=f"inproc:{i}") for i, s in enumerate(members)),
        reduce_timeout_s=10.0,
        broadcast_timeout_s=20.0,
    )
    return OpenRound(
        plan=plan,
        owners=["a"],
        site_id="a",
        chunks=CHUNKS,
        aggregation=AggregationConfig(**agg),
        opened_at=T0,
        tokens=tokens,
    )


def _contribution(sender: str, chunk: int, tokens: int) -> Contribution:
    off, n = CHUNKS[0][chunk]
    return Contribution(
        round=7, bucket=0, chunk=chunk, offset=off, numel=n, codec="fp32", sender=sender, payload=b"", tokens=tokens
    )


def _digest(v: torch.Tensor) -> bytes:
    return hashlib.blake2b(v.numpy().tobytes(), digest_size=16).digest()


def _feed(o: OpenRound, values: dict[tuple[str, int], torch.Tensor], tokens: dict[str, int], order) -> None:
    """Check and accept each (sender, chunk) in ``order`` as the round engine does."""
    for s, c in order:
        o.check(_contribution(s, c, tokens.get(s, 0)))
        v = values[(s, c)]
        assert o.accept(s, 0, c, v, _digest(v), now=T0 + 1) is True


def _means(o: OpenRound) -> list[torch.Tensor | None]:
    o.close([0])
    return [r.mean for r in o.finalize(0)]


def _values(seed: int) -> dict[tuple[str, int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {(s, c): torch.randn(n, generator=g) * 3 for s in SENDERS for c, (_, n) in enumerate(CHUNKS[0])}


@pytest.mark.parametrize(
    "robust",
    [{}, {"norm_bound_ratio": 3.0}, {"max_norm": 100.0}, {"trim_fraction": 0.25}, {"trim_fraction": 0.3}],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_claims_give_bit_identical_means(seed: int, robust: dict) -> None:
    """Equal claims: every factor is 1.0 exactly, so the sums, divisors and means are today's,
    whatever the arrival order and whichever chunks were lost (the trimmed mean: chunk 0 has
    all four senders and trims one value at each end, the others three and trim none)."""
    values = _values(seed)
    g = torch.Generator().manual_seed(100 + seed)
    order = [(s, c) for s in SENDERS for c in range(3)]
    order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
    order = [x for x in order if not (x[0] == "c" and x[1] == 1) and x != ("d", 2)]  # two chunks lost
    plain = _round(**robust)
    _feed(plain, values, {}, order)
    weighted = _round(tokens=512, token_weighted=True, **robust)
    _feed(weighted, values, dict.fromkeys(SENDERS, 512), order)
    assert weighted.weights == dict.fromkeys(SENDERS, 1.0)
    for want, got in zip(_means(plain), _means(weighted)):
        assert torch.equal(want, got)  # bit for bit


def test_weighted_mean_is_sum_of_w_delta_over_sum_of_w_when_all_arrive() -> None:
    values = _values(5)
    tokens = {"a": 100, "b": 300, "c": 50, "d": 200}
    o = _round(tokens=100, token_weighted=True)
    _feed(o, values, tokens, [(s, c) for s in reversed(SENDERS) for c in range(3)])
    assert o.claims == tokens and o.weights == {"a": 1.0, "b": 3.0, "c": 0.5, "d": 2.0}
    for c, got in enumerate(_means(o)):
        want = sum(tokens[s] * values[(s, c)].double() for s in SENDERS) / sum(tokens.values())
        assert torch.allclose(got.double(), want, atol=1e-6)
    # the robust path (every contribution held, norm bound at finalize) gives the same mean
    r = _round(tokens=100, token_weighted=True, norm_bound_ratio=10.0)
    _feed(r, values, tokens, [(s, c) for s in SENDERS for c in range(3)])
    for c, got in enumerate(_means(r)):
        want = sum(tokens[s] * values[(s, c)].double() for s in SENDERS) / sum(tokens.values())
        assert torch.allclose(got.double(), want, atol=1e-6)


def test_weighted_mean_is_unbiased_under_random_drops() -> None:
    """Each sender's chunk arrives independently with probability 0.6 (fixed seed, 6,000
    trials): the owner's mean Σ fᵢΔᵢ / (k·f̄) averages to Σ wᵢΔᵢ / Σ wᵢ within 4 standard
    errors per element, while the ratio Σ fᵢΔᵢ / Σ fᵢ over the arrived misses it (so the
    test can tell the two apart)."""
    weights = {"a": 1.0, "b": 8.0, "c": 0.5, "d": 2.0}  # the factors of claims 100, 800, 50, 200
    delta = {"a": torch.tensor([0.0, 1.0, -2.0]), "b": torch.tensor([1.0, 0.0, 4.0])}
    delta |= {"c": torch.tensor([-3.0, 2.0, 0.0]), "d": torch.tensor([2.0, -1.0, 1.0])}
    target = sum(weights[s] * delta[s].double() for s in SENDERS) / sum(weights.values())
    g = torch.Generator().manual_seed(34)
    ours, ratio = [], []
    for _ in range(6000):
        arrived = [s for s, keep in zip(SENDERS, (torch.rand(4, generator=g) < 0.6).tolist()) if keep]
        if not arrived:
            continue
        acc = BucketAccumulator([3], AggregationConfig(token_weighted=True), order=SENDERS, weights=weights)
        for s in arrived:
            acc.add(s, 0, delta[s], _digest(delta[s]))
        ((mean, senders),) = ((r.mean, r.senders) for r in acc.finalize())
        assert senders == tuple(arrived)
        ours.append(mean.double())
        ratio.append(sum(weights[s] * delta[s].double() for s in arrived) / sum(weights[s] for s in arrived))
    ours_t, ratio_t = torch.stack(ours), torch.stack(ratio)
    se = ours_t.std(dim=0) / len(ours) ** 0.5
    assert ((ours_t.mean(dim=0) - target).abs() < 4 * se).all(), (ours_t.mean(dim=0), target, se)
    ratio_se = ratio_t.std(dim=0) / len(ratio) ** 0.5
    assert ((ratio_t.mean(dim=0) - target).abs() > 4 * ratio_se).any()  # the ratio is biased here


def test_oversized_claim_is_refused_on_every_chunk_and_counted() -> None:
    o = _round(tokens=100, token_weighted=True, max_weight_ratio=4.0)
    o.check(_contribution("b", 0, 300))  # within 4 x the median (100)
    o.check(_contribution("c", 0, 100))
    with pytest.raises(Rejected) as e:
        o.check(_contribution("d", 0, 500))  # above 4 x median(100, 300, 100) = 400
    assert e.value.code == RejectCode.INVALID_ARGUMENT
    assert "500 tokens, above max_weight_ratio 4 x the median claim 100" in e.value.reason
    o.reject("d", e.value.code, e.value.reason)
    with pytest.raises(Rejected, match="above max_weight_ratio"):  # its next chunk: refused alike
        o.check(_contribution("d", 1, 500))
    o.reject("d", RejectCode.INVALID_ARGUMENT, "again")
    assert set(o.refused_claims) == {"d"} and "d" not in o.claims and "d" in o.faulty_senders
    assert o.rejections.by_code() == {"INVALID_ARGUMENT": 2}
    with pytest.raises(Rejected, match="claims 301 tokens, 300 on its earlier chunks"):
        o.check(_contribution("b", 1, 301))  # a claim cannot change within a round
    with pytest.raises(Rejected, match="needs a claim > 0"):
        _round(token_weighted=True).check(_contribution("b", 0, 0))


def test_claim_decision_rule() -> None:
    assert claim_decision(10**9, [], 4.0)[0]  # nothing to compare with: accepted
    assert claim_decision(10**9, [5], 4.0)[0]  # one claim is one site's word (a slow owner's own)
    assert claim_decision(400, [100, 100], 4.0)[0]
    ok, why = claim_decision(401, [100, 100], 4.0)
    assert not ok and "401 tokens, above max_weight_ratio 4 x the median claim 100 of the round (400)" in why
    assert claim_decision(250, [50, 60, 1000], 4.0)[0] is False  # median 60, not the mean


def test_with_a_full_rounds_tokens_known_a_fast_honest_site_is_never_refused() -> None:
    """The runtime's bound: max_weight_ratio x a full round's tokens (sync_every x tokens_per_step).
    The fresh-user case: two owners at a fifth of the speed accepted claims of 1,900 each, and the
    median rule refused the fast site's honest 9,472 (and excluded it after repeats)."""
    full = 50 * 256  # H = 50 steps of 256 tokens
    assert claim_decision(9472, [1900, 1900], 4.0, full)[0]  # honest and fast: accepted
    assert claim_decision(full, [1, 1, 1], 1.0, full)[0]  # a full round, whatever the others did
    ok, why = claim_decision(4 * full + 1, [full, full], 4.0, full)
    assert not ok and f"above max_weight_ratio 4 x a full round's {full} tokens ({4 * full})" in why
    assert claim_decision(0, [], 4.0, full)[0] is False
    assert claim_decision(0, [100], 4.0)[0] is False and claim_decision(True, [], 4.0)[0] is False


def test_mean_factor_and_partial_mean_unweighted_unchanged() -> None:
    assert mean_factor(None) == 1.0 and mean_factor({}) == 1.0 and mean_factor({"a": 1.0, "b": 3.0}) == 2.0
    vals = {s: torch.randn(6, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SENDERS)}
    cfg = AggregationConfig()
    plain, _, _ = partial_mean(vals, cfg)
    same, _, _ = partial_mean(vals, cfg, dict.fromkeys(SENDERS, 1.0))
    assert torch.equal(plain, same)


def test_refused_combinations_say_why_and_the_others_combine() -> None:
    with pytest.raises(ValueError, match="token_weighted cannot be combined with sparse_mean"):
        AggregationConfig(token_weighted=True, sparse_mean=True)
    with pytest.raises(ValueError, match="max_weight_ratio must be a finite number >= 1"):
        AggregationConfig(token_weighted=True, max_weight_ratio=0.5)
    from dtrain.app.config import NetConfig, WorkerConfig
    from dtrain.configs import RoundConfig

    cfg = WorkerConfig()
    agg = AggregationConfig(token_weighted=True, trim_fraction=0.25)  # the weighted trimmed mean
    rounds = RoundConfig(aggregation=agg)
    built = dataclasses.replace(  # over datagrams: the claim rides in the sealed CONTRIB body
        cfg,
        diloco=dataclasses.replace(cfg.diloco, rounds=rounds),
        net=dataclasses.replace(NetConfig(), data_path="datagram"),
    )
    assert built.diloco.rounds.aggregation == agg and built.net.data_path == "datagram"


def _todays_trimmed_mean(values: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """partial_mean's trimmed mean before weights (commit 612eb69), verbatim."""
    k = int(trim_fraction * len(values))
    srt, _ = torch.sort(values, dim=0)
    return srt[k : len(values) - k].mean(dim=0)


@pytest.mark.parametrize("n", [3, 4, 5, 7, 10])
def test_weighted_trimmed_mean_with_equal_weights_is_todays_trimmed_mean(n: int) -> None:
    """Bit for bit, for integer and non-integer trim_fraction x n (today's drops
    int(trim_fraction x n) values from each end; so does the weighted one's k/n of the weight)."""
    g = torch.Generator().manual_seed(n)
    values = torch.randn(n, 257, generator=g) * torch.logspace(-3, 3, 257)
    for t in (0.1, 0.2, 0.25, 0.3, 1 / 3, 0.45):
        if int(t * n) == 0:
            continue
        want = _todays_trimmed_mean(values, t)
        for w in (1.0, 2.5, 1e-3):
            got = weighted_trimmed_mean(values, torch.full((n,), w), t)
            assert torch.equal(got, want), (n, t, w)
        mean, _, _ = partial_mean({f"s{i}": v for i, v in enumerate(values)}, AggregationConfig(trim_fraction=t))
        assert torch.equal(mean, want), (n, t)


def test_weighted_trimmed_mean_by_hand() -> None:
    """Four contributions, trim_fraction 0.25 (k = 1: a quarter of the weight off each end).
    Column 0: values 1, 2, 3, 100 with weights 2, 1, 1, 0.1 (W = 4.1, cut 1.025 at each end):
    the value 1 keeps 0.975 of its 2, the 2 all of its 1, the 3 keeps 0.075 (0.925 of the top
    cut after 100's 0.1), 100 nothing: (0.975 + 2 + 0.225) / 2.05 = 3.2 / 2.05. Column 1: the
    same weights on values 4, -1, 0, 2 (sorted: -1 w1, 0 w1, 2 w0.1, 4 w2): the -1 is cut
    whole, 0 keeps 0.975, 2 its 0.1, 4 keeps 0.975: (0 + 0.2 + 3.9) / 2.05."""
    values = torch.tensor([[1.0, 4.0], [2.0, -1.0], [3.0, 0.0], [100.0, 2.0]])
    w = torch.tensor([2.0, 1.0, 1.0, 0.1])
    got = weighted_trimmed_mean(values, w, 0.25).double()
    want = torch.tensor([3.2 / 2.05, 4.1 / 2.05], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # total: the kept mass is (1 - 2k/n) of it (partial_mean's Horvitz-Thompson divisor)
    torch.testing.assert_close(weighted_trimmed_mean(values, w, 0.25, total=8.2).double(), want / 2, rtol=0, atol=1e-6)
    # no trimming (k = 0): the weighted mean
    torch.testing.assert_close(
        weighted_trimmed_mean(values, w, 0.2).double(), (w.double() @ values.double()) / 4.1, rtol=0, atol=1e-6
    )
    with pytest.raises(ValueError, match="weights must be > 0"):
        weighted_trimmed_mean(values, torch.tensor([1.0, 0.0, 1.0, 1.0]), 0.25)
    with pytest.raises(ValueError, match="trim_fraction must be in"):
        weighted_trimmed_mean(values, w, 0.5)


def test_a_heavy_outlier_with_a_small_weight_is_trimmed() -> None:
    """An owner with token weighting and trim_fraction 0.2 (five senders: a fifth of the weight
    off each end): sender e sends 1e30 on every element with a tenth of a's claim; the top cut
    (a fifth of W = 4.1 + 0.1 = 0.84) takes it whole and not a rounding error of it leaks: the
    mean is the hand-computed weighted trimmed mean of the others, finite and small."""
    vals = {"a": [1.0, -1.0], "b": [2.0, 0.5], "c": [0.0, 0.0], "d": [-1.0, 3.0], "e": [1e30, 1e30]}
    tokens = {"a": 100, "b": 100, "c": 100, "d": 100, "e": 10}
    agg = AggregationConfig(token_weighted=True, trim_fraction=0.2)
    mean, senders, dropped = partial_mean(
        {s: torch.tensor(v) for s, v in vals.items()}, agg, {s: t / 100 for s, t in tokens.items()}
    )
    assert senders == tuple(vals) and dropped == {}
    # column 0 sorted: -1 (d), 0 (c), 1 (a), 2 (b), 1e30 (e, 0.1); cut 0.82 each end:
    # d keeps 0.18, c, a whole, b keeps 1 - 0.72 = 0.28, e none; kept mass 4.1 - 1.64 = 2.46
    # column 1 sorted: -1 (a), 0 (c), 0.5 (b), 3 (d), 1e30 (e): a keeps 0.18, d keeps 0.28
    want = torch.tensor([(-0.18 + 0 + 1 + 0.56) / 2.46, (-0.18 + 0 + 0.5 + 0.84) / 2.46], dtype=torch.float64)
    torch.testing.assert_close(mean.double(), want, rtol=0, atol=1e-6)
    # and end to end at an owner, the claims checked and the outlier's sender not otherwise refused
    members = ("a", "b", "c", "d", "e")
    o = _round(tokens=100, members=members, token_weighted=True, trim_fraction=0.2)
    chunk0 = {(s, 0): torch.tensor(vals[s] + [0.0, 0.0, 0.0]) for s in members}
    _feed(o, chunk0, tokens, [(s, 0) for s in members])
    o.close([0])
    red = o.finalize(0)[0]
    assert red.senders == members and red.dropped == {}
    torch.testing.assert_close(red.mean[:2].double(), want, rtol=0, atol=1e-6)


def test_grpc_wire_carries_the_claim() -> None:
    from dtrain.transports.grpc_wire import decode_contribution, encode_contribution

    c = dataclasses.replace(_contribution("b", 1, 4096), payload=b"\x01\x02\x03")
    assert decode_contribution(encode_contribution(c)) == c


def test_window_steps_rule() -> None:
    from dtrain.streaming import window_steps

    assert window_steps(window_s=10.0, step_s=0.1, done=1, max_steps=500)[0] == 100
    assert window_steps(window_s=10.0, step_s=0.2, done=1, max_steps=500)[0] == 50  # half speed: half the steps
    n, why = window_steps(window_s=10.0, step_s=0.01, done=1, max_steps=500)
    assert n == 500 and "1000 steps of 10.0 ms fit in 10 s, clamped to [1, 500]" == why
    assert window_steps(window_s=1.0, step_s=5.0, done=1, max_steps=500)[0] == 1  # at least one step
    assert window_steps(window_s=1.0, step_s=0.1, done=20, max_steps=500)[0] == 20  # never below what is done


def test_the_first_phase_of_time_based_rounds_fills_its_window_step_by_step() -> None:
    """With no step time measured yet, the first step (slow: allocations, cold caches) does
    not set the phase's count: it goes on step by step until one more step at the mean so
    far would pass the window (a fresh-user run trained 3 steps of a window that fits 20)."""
    from dtrain.configs import DiLoCoConfig
    from dtrain.diloco import DiLoCo
    from dtrain.sitegroup.comm import LocalSiteComm
    from dtrain.streaming import first_window_steps

    assert first_window_steps(window_s=1.0, elapsed_s=0.5, done=1, max_steps=100) == (None, "")  # 0.5 + 0.5 = 1.0
    assert first_window_steps(window_s=1.0, elapsed_s=0.9, done=9, max_steps=100) == (None, "")  # 0.9 + 0.1 = 1.0
    n, why = first_window_steps(window_s=1.0, elapsed_s=0.95, done=10, max_steps=100)
    assert n == 10 and "10 steps took 0.95 s of the 1 s window" in why
    assert first_window_steps(window_s=1.0, elapsed_s=0.2, done=8, max_steps=8)[0] == 8  # the bound
    d = DiLoCo.__new__(DiLoCo)  # only the phase decision's state
    d.config, d.rank, d.comm = DiLoCoConfig(sync_every=100, round_window_s=1.0), 0, LocalSiteComm()
    d.step_s, d.phase_reason, d._phase_target = None, "", None
    t, steps = 0.5, 1  # a first step of 0.5 s, then 0.04 s steps
    while steps < d.phase_target(steps, t):
        steps, t = steps + 1, t + 0.04
    # 12 steps took 0.94 s; a 13th at their mean (78 ms) would pass 1 s (11: 0.90 + 0.082 does not)
    assert steps == 12 and d.decided_phase[0] == 12, (steps, t)
    d.note_phase(steps, t)  # the next phase plans from the measured step time, at once
    assert d.step_s == pytest.approx(0.04)  # the warm-up step left out: not 0.94 s / 12 = 78 ms
    d._phase_target = None
    assert d.phase_target(1, 0.05) == int(1.0 / d.step_s) >= 24  # ~25 steps of 40 ms (78 ms: 12)


def test_fragment_period_rule() -> None:
    """Time-based fragment rounds: a fragment round every W/F seconds of compute, the period's
    steps from the measured step time, clamped to [max(1, done), H/F]; τ fits the period."""
    from dtrain.streaming import fragment_period

    kw = dict(window_s=1.0, done=1, elapsed_s=0.0, max_steps=50)
    assert fragment_period(num_fragments=1, step_s=0.01, **kw)[0] == 50  # F = 1: the blocking round's window
    assert fragment_period(num_fragments=2, step_s=0.01, **kw) == (
        50,
        "fragment period of 1 s / 2: 50 steps of 10.0 ms fit in 0.5 s",
    )
    assert fragment_period(num_fragments=4, step_s=0.01, **kw)[0] == 25  # W/F = 0.25 s
    assert fragment_period(num_fragments=4, step_s=0.02, **kw)[0] == 12  # half speed: half the steps
    n, why = fragment_period(num_fragments=2, step_s=0.001, **kw)  # 500 fit: the bound H/F
    assert n == 50 and why.endswith("clamped to [1, 50]")
    assert fragment_period(num_fragments=2, step_s=3.0, **kw)[0] == 1  # at least one step
    assert fragment_period(num_fragments=2, step_s=0.1, **{**kw, "done": 9})[0] == 9  # never below what is done
    # τ fits the period: a round in flight is merged at the period's end at the latest, and the reason says so
    n, why = fragment_period(num_fragments=2, step_s=0.2, overlap_steps=4, **kw)
    assert n == 2 and why.endswith("; overlap_steps 4 clamped to 2 (the round in flight merges at this period's end)")
    assert "clamped" not in fragment_period(num_fragments=2, step_s=0.2, overlap_steps=2, **kw)[1]
    # the first period, no step time measured: asked after every step until W/F is spent
    first = dict(window_s=1.0, num_fragments=2, step_s=None, max_steps=50, overlap_steps=1)
    assert fragment_period(done=1, elapsed_s=0.2, **first) == (None, "")  # 0.2 + 0.2 <= 0.5
    n, why = fragment_period(done=3, elapsed_s=0.45, **first)  # 0.45 + 0.15 > 0.5
    assert n == 3 and "3 steps took 0.45 s of the 0.5 s window" in why
    assert fragment_period(done=50, elapsed_s=0.1, **first)[0] == 50  # the bound


def test_step_actions_with_periods_decided_by_the_window() -> None:
    """Time-based periods: a round starts when the period's steps are taken (counted from the
    last start, not ``step % H/F``); a round in flight is merged by then (apply_at clamped)."""
    from dtrain.streaming import step_actions

    # periods of 3 then 5 steps, τ = 1: start at 3, merge at 4, start at 8, merge at 9
    assert step_actions(3, period=3, overlap_steps=1, apply_at=None, since_start=3) == ("start",)
    assert step_actions(4, period=5, overlap_steps=1, apply_at=4, since_start=1) == ("apply",)
    assert step_actions(6, period=5, overlap_steps=1, apply_at=None, since_start=3) == ()
    assert step_actions(8, period=5, overlap_steps=1, apply_at=None, since_start=5) == ("start",)
    # step 8 is a multiple of neither 3 nor 5: the period's count decides, not the step number
    assert step_actions(8, period=4, overlap_steps=1, apply_at=None, since_start=3) == ()
    # τ = 3 clamped to a 2-step period: merged at the period's end, before the next fragment starts
    assert step_actions(10, period=2, overlap_steps=3, apply_at=10, since_start=2) == ("apply", "start")
    assert step_actions(5, period=5, overlap_steps=0, apply_at=None, since_start=5) == ("start", "apply")
    # the one-step-delayed mode (F = 1, τ = H) stays itself whatever the period decided
    assert step_actions(7, period=7, overlap_steps=8, apply_at=7, num_fragments=1, since_start=7, delayed=True) == (
        "measure",
        "apply",
        "submit",
    )


def test_time_based_rounds_config() -> None:
    from dtrain.configs import DiLoCoConfig

    assert DiLoCoConfig(round_window_s=30.0).round_window_s == 30.0
    with pytest.raises(ValueError, match="round_window_s must be None"):
        DiLoCoConfig(round_window_s=0.0)
    # with streaming rounds (fragments, overlap, merge, the one-step-delayed mode): accepted
    for streaming in (
        dict(num_fragments=2),
        dict(num_fragments=2, overlap_steps=4),
        dict(overlap_steps=3, merge_alpha=0.5),
        dict(overlap_steps=8),
    ):
        c = DiLoCoConfig(round_window_s=30.0, sync_every=8, **streaming)
        assert c.streaming and c.round_window_s == 30.0
    # what is still refused names the field and the allowed values
    with pytest.raises(
        ValueError, match=r"overlap_steps \(tau\) must be an int in \[0, sync_every/num_fragments = 4\]"
    ):
        DiLoCoConfig(round_window_s=30.0, sync_every=8, num_fragments=2, overlap_steps=5)
    with pytest.raises(ValueError, match="round_window_s must be None"):
        DiLoCoConfig(round_window_s=float("inf"), sync_every=8, num_fragments=2)
    with pytest.raises(ValueError, match="tokens_per_step must be an int >= 1"):
        DiLoCoConfig(tokens_per_step=0)


def test_ranks_of_a_site_group_take_rank_0s_step_count() -> None:
    """Time-based rounds in a site group: rank 0 decides the phase's step count from its own
    step time and broadcasts it; rank j > 0 takes it whatever its own clock says, once a phase."""
    from dtrain.configs import DiLoCoConfig
    from dtrain.diloco import DiLoCo

    class Comm:  # rank 1 of 2: a broadcast answers rank 0's value
        def __init__(self, rank: int, rank0_value=None) -> None:
            self.rank, self.sent, self.rank0_value = rank, [], rank0_value

        def broadcast(self, obj, *, round: bool = False):
            self.sent.append(obj)
            self.groups = getattr(self, "groups", []) + ["round" if round else "main"]
            return obj if self.rank == 0 else self.rank0_value

    def rank(r: int, comm: Comm, **streaming) -> DiLoCo:
        d = DiLoCo.__new__(DiLoCo)  # only the phase decision's state: no model, no rendezvous
        d.config, d.rank, d.comm = DiLoCoConfig(sync_every=100, round_window_s=1.0, **streaming), r, comm
        d.step_s, d.phase_reason, d._phase_target = None, "", None
        return d

    r0 = rank(0, Comm(0))
    r0.step_s = 0.02  # measured in an earlier phase
    assert r0.phase_target(1, 0.02) == 50  # 1 s / 20 ms
    decided = r0.comm.sent[0]
    r1 = rank(1, Comm(1, rank0_value=decided))
    assert r1.phase_target(1, 0.5) == 50 and r1.comm.sent == [None]  # rank 1's own 0.5 s step is not used
    assert r1.phase_target(7, 9.0) == 50 and len(r1.comm.sent) == 1  # once per phase
    r0.note_phase(50, 2.0)  # the phase took 40 ms a step: the next phase plans with it
    r0._phase_target = None
    assert r0.phase_target(1, 0.02) == int(1.0 / (0.3 * 0.02 + 0.7 * 0.04))
    assert r0.comm.groups == ["round", "round"]  # blocking rounds: decided on the rounds' group
    # streaming (F = 4, τ = 3): a fragment period of W/F = 0.25 s, decided on the training loop's group
    # (a fragment round's thread uses the rounds' group meanwhile); τ clamped to the period, said so
    s0 = rank(0, Comm(0), num_fragments=4, overlap_steps=3)
    s0.step_s = 0.1
    assert s0.phase_target(1, 0.1) == 2 and s0.comm.groups == ["main"]
    assert "overlap_steps 3 clamped to 2" in s0.decided_phase[1]
    s1 = rank(1, Comm(1, rank0_value=s0.comm.sent[0]), num_fragments=4, overlap_steps=3)
    assert s1.phase_target(1, 0.01) == 2 and s1.comm.groups == ["main"]  # rank 0's count, not its own


def test_time_based_rounds_without_token_weights_warn_once_at_start(caplog) -> None:
    """Time-based rounds let a fast site train more steps per round; without token weights
    each contribution still counts equally: said once when the site starts, not refused."""
    import logging

    from dtrain.configs import AggregationConfig, DiLoCoConfig
    from dtrain.diloco import DiLoCo
    from dtrain.rounds import RoundConfig

    def start(**rounds) -> list[str]:
        caplog.clear()
        cfg = DiLoCoConfig(sync_every=100, round_window_s=1.0, rounds=RoundConfig(**rounds))
        with caplog.at_level(logging.WARNING, logger="dtrain.diloco"):
            d = DiLoCo(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1), config=cfg)
            d.engine.stop(0.1)
        return [r.getMessage() for r in caplog.records if "round_window_s" in r.getMessage()]

    said = start()
    assert len(said) == 1 and "--token-weighted" in said[0], said
    assert start(aggregation=AggregationConfig(token_weighted=True)) == []
