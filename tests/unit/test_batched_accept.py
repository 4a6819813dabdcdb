"""The batched accept (a sender's run of neighbouring chunks checked and counted in one
pass: ``BucketAccumulator.add_run``, ``OpenRound.accept_run``, ``PeerSide.handle_contributions``)
gives what one contribution at a time gave: bit for bit the same means (sums in sender-id
order), the same answers per chunk (counted, identical retry, refusal code and reason) and
the same books, on random runs with NaN chunks, retries, conflicting payloads, senders out
of order, partial runs and the robust options. The reference is ``ChunkAccumulator`` per
chunk (the owner's accumulator before) and ``handle_contribution`` per chunk."""

from __future__ import annotations

import random
import re
import time
from dataclasses import replace

import pytest
import torch

from dtrain.aggregation import AggregationConfig, BucketAccumulator, ChunkAccumulator, ChunkReduction
from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.codecs import get_codec
from dtrain.configs import CodecConfig
from dtrain.errors import Rejected
from dtrain.protocol import Contribution, ContributionRun, Member, RoundPlan
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.rounds.owner import OpenRound
from dtrain.rounds.serving import _Owned
from dtrain.state import GlobalState
from dtrain.transports.inproc import InprocNetwork, InprocTransport

pytestmark = pytest.mark.timeout(60)

MEMBERS = ("s0", "s1", "s2", "s3")
CONFIGS = {
    "plain": AggregationConfig(),
    "max_norm": AggregationConfig(max_norm=11.0),  # near the chunks' norms (~ sqrt(n) = 11.3): both sides
    "trim": AggregationConfig(trim_fraction=0.25),
    "norm_ratio": AggregationConfig(norm_bound_ratio=1.5),
}


def _bits(t: torch.Tensor | None):
    return None if t is None else t.contiguous().view(torch.int32).tolist()  # -0.0 differs from 0.0


def _answer(r) -> tuple:
    return (r.code, r.reason) if isinstance(r, Rejected) else ("ok", r)


def _values(rng: random.Random, n: int, g: torch.Generator) -> torch.Tensor:
    kind = rng.random()
    if kind < 0.05:
        return torch.full((n,), -0.0)  # copy, not 0 + v, keeps the sign of a zero
    v = torch.randn(n, generator=g) * rng.choice([1.0, 1.0, 0.1, 3.0])
    if kind < 0.12:
        v[rng.randrange(n)] = rng.choice([float("nan"), float("inf"), -float("inf")])
    return v


def _arrivals(rng: random.Random, numels: list[int], senders, g: torch.Generator) -> list[tuple]:
    """Runs ``(sender, chunks, values, digests)``: each sender's chunks in random runs of
    ascending chunks with gaps (lost), some runs lost whole, some sent again (identical
    retries, or a different payload)."""
    runs = []
    for s in senders:
        c = 0
        while c < len(numels):
            span = range(c, min(len(numels), c + rng.randint(1, 12)))
            chunks = [x for x in span if rng.random() > 0.2] or [span[0]]
            k = len(chunks)
            vals = torch.cat([_values(rng, numels[x], g) for x in chunks])
            digests = [bytes([rng.randrange(256) for _ in range(8)]) for _ in range(k)]
            if rng.random() < 0.15:
                digests[rng.randrange(k)] = None  # refused before (check): skipped
            if rng.random() > 0.1:  # else the whole run is lost
                runs.append((s, chunks, vals, digests))
            if rng.random() < 0.15:  # a retry of it: identical, or one chunk's payload differs
                d2 = list(digests)
                if rng.random() < 0.5:
                    j = rng.randrange(k)
                    d2[j] = b"other" if d2[j] is not None else None
                runs.append((s, chunks, vals.clone(), d2))
            c = span[-1] + 1
    # and always: chunk 0 again with another payload, chunk 1 with a NaN (refused either way)
    vals = torch.cat([_values(rng, numels[0], g), torch.full((numels[1],), float("nan"))])
    runs.append((senders[0], [0, 1], vals, [b"again0", b"again1"]))
    rng.shuffle(runs)  # senders out of order, runs interleaved
    return runs


def _reference(numels, config, order, runs):
    accs = [ChunkAccumulator(n, config, order=order) for n in numels]
    answers = []
    for s, chunks, vals, digests in runs:
        start = 0
        for c, d in zip(chunks, digests):
            v, start = vals[start : start + numels[c]], start + numels[c]
            if d is None:
                answers.append(("ok", None))
                continue
            try:
                answers.append(("ok", accs[c].add(s, v, d)))
            except Rejected as e:
                answers.append((e.code, e.reason))
    return answers, [acc.finalize() for acc in accs]


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(6))
def test_add_run_matches_chunk_accumulator_per_chunk(config_name: str, seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    config = CONFIGS[config_name]
    numels = [128] * rng.randint(5, 30) + [rng.randint(1, 127)]  # a short last chunk
    order = None if seed == 5 else MEMBERS  # None: nothing folds before finalize
    runs = _arrivals(rng, numels, MEMBERS[: rng.randint(2, 4)], g)
    want_answers, want = _reference(numels, config, order, runs)
    acc = BucketAccumulator(numels, config, order=order)
    got_answers = []
    for s, chunks, vals, digests in runs:
        got_answers += [_answer(r) for r in acc.add_run(s, chunks, vals, digests)]
    assert got_answers == want_answers
    assert {a[0] for a in got_answers} - {"ok"}, "the runs exercise no refusal"
    got = acc.finalize()
    assert acc.num_held == 0 or config.robust
    for c, (red, (m2, s2, r2)) in enumerate(zip(got, want)):
        assert (red.chunk, red.senders, red.dropped) == (c, s2, r2), f"chunk {c}"
        assert _bits(red.mean) == _bits(m2), f"chunk {c}: the mean differs"


@pytest.mark.parametrize("config_name", ["plain", "max_norm", "sparse_mean", "weighted"])
@pytest.mark.parametrize("seed", range(4))
def test_whole_runs_in_turn_fold_without_per_chunk_python_and_give_the_same_means(
    config_name: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual arrival (each sender's run of consecutive chunks, in sender order, one or
    two runs a sender) takes add_run's in-turn path: no per-chunk fold, the same answers and
    the same means bit for bit as ChunkAccumulator; one sender out of turn, a NaN chunk or a
    retry in a run sends it down the general path, with the same answers too."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(100 + seed)
    config = {"sparse_mean": AggregationConfig(sparse_mean=True), "weighted": AggregationConfig()}.get(
        config_name, CONFIGS.get(config_name)
    )
    weights = {"s0": 1.5, "s1": 0.5, "s2": 1.0, "s3": 2.0} if config_name == "weighted" else None
    numels = [128] * rng.randint(6, 20) + [rng.randint(1, 127)]
    cut = rng.randint(2, len(numels) - 2)
    runs = []
    for s in MEMBERS:
        for a, b in ((0, cut), (cut, len(numels))):
            vals = torch.cat([torch.randn(numels[c], generator=g) * 0.5 for c in range(a, b)])  # within max_norm
            runs.append((s, list(range(a, b)), vals, [f"{s}{c}".encode() for c in range(a, b)]))
    if seed % 2:  # the last sender's first run arrives first: held, then folded by the general path
        runs.insert(0, runs.pop(6))
    if seed == 3:  # and a retry of a run, identical
        runs.append(runs[2])
    ref = BucketAccumulator(numels, config, order=MEMBERS, weights=weights)  # the general path only
    ref._add_in_turn = lambda *a: None  # noqa: SLF001
    folds = []
    real = BucketAccumulator._fold_in_turn
    monkeypatch.setattr(BucketAccumulator, "_fold_in_turn", lambda self, cs: folds.append(self) or real(self, cs))
    acc = BucketAccumulator(numels, config, order=MEMBERS, weights=weights)
    for s, chunks, vals, digests in runs:
        assert [_answer(r) for r in acc.add_run(s, chunks, vals, digests)] == [
            _answer(r) for r in ref.add_run(s, chunks, vals, digests)
        ]
    if seed % 2 == 0:
        assert acc not in folds, "runs in turn went through the per-chunk fold"
    got, want = acc.finalize(), ref.finalize()
    if weights is None:  # and as ChunkAccumulator, chunk by chunk
        _, per_chunk = _reference(numels, config, MEMBERS, runs)
        assert [(m is None, s) for m, s, _ in per_chunk] == [(r.mean is None, r.senders) for r in want]
        assert [_bits(m) for m, _, _ in per_chunk] == [_bits(r.mean) for r in want]
    for c, (r1, r2) in enumerate(zip(got, want)):
        assert (r1.senders, r1.dropped) == (r2.senders, r2.dropped) and _bits(r1.mean) == _bits(r2.mean), f"chunk {c}"


@pytest.mark.parametrize("config_name", ["plain", "max_norm", "sparse_mean", "weighted"])
@pytest.mark.parametrize("in_turn", [True, False])
def test_a_checked_run_is_decoded_into_the_sums_with_the_bits_of_its_decoded_tensor(
    config_name: str, in_turn: bool, kernel_path: str
) -> None:
    """Runs handed over as ``CheckedRun`` (int8, checked, not decoded) give the answers and the
    means bit for bit of the same runs decoded first: folded straight into the sums in their
    turn, decoded first when held, weighted or checked against ``max_norm``."""
    codec = get_codec("int8")
    config = {"sparse_mean": AggregationConfig(sparse_mean=True), "weighted": AggregationConfig()}.get(
        config_name, CONFIGS.get(config_name)
    )
    weights = {"s0": 1.5, "s1": 0.5, "s2": 1.0, "s3": 2.0} if config_name == "weighted" else None
    numels = [1280] * 9 + [640]
    g = torch.Generator().manual_seed(4)
    runs = []
    for s in MEMBERS:
        payloads = [codec.encode(torch.randn(n, generator=g) * 0.2) for n in numels]
        runs.append((s, payloads))
    if not in_turn:
        runs.reverse()  # every run but the last held until s0's arrives
    got_acc = BucketAccumulator(numels, config, order=MEMBERS, weights=weights)
    want_acc = BucketAccumulator(numels, config, order=MEMBERS, weights=weights)
    for s, payloads in runs:
        checked = codec.checked_run(payloads, numels)
        assert (checked is not None) == (kernel_path == "compiled")
        got = got_acc.add_run(s, list(range(len(numels))), checked or codec.decode_chunks(payloads, numels), payloads)
        want = want_acc.add_run(s, list(range(len(numels))), codec.decode_chunks(payloads, numels), payloads)
        assert [_answer(r) for r in got] == [_answer(r) for r in want]
    for r1, r2 in zip(got_acc.finalize(), want_acc.finalize()):
        assert r1.senders == r2.senders and _bits(r1.mean) == _bits(r2.mean)


def test_add_run_refuses_a_nan_chunk_alone_with_the_per_chunk_reason() -> None:
    acc = BucketAccumulator([4, 4, 4], AggregationConfig(), order=["a", "b"])
    vals = torch.arange(12, dtype=torch.float32)
    vals[5] = float("nan")
    res = acc.add_run("a", [0, 1, 2], vals, [b"0", b"1", b"2"])
    assert res[0] is True and res[2] is True
    assert isinstance(res[1], Rejected) and res[1].reason == "contribution contains NaN or Inf values"
    assert acc.digests(1) == {} and acc.digests(2) == {"a": b"2"}
    assert acc.add_run("a", [0, 1, 2], vals, [b"0", None, b"2"]) == [False, None, False]  # identical retries
    with pytest.raises(ValueError, match="needs 12 float32 values"):
        acc.add_run("a", [0, 1, 2], vals[:8], [b"0", b"1", b"2"])
    with pytest.raises(ValueError, match="not ascending"):
        acc.add_run("a", [0, 0], vals[:8], [b"0", b"0"])
    means = acc.finalize()
    assert torch.equal(means[0].mean, vals[:4]) and means[0].senders == ("a",)
    assert means[1] == ChunkReduction(chunk=1, mean=None, senders=(), dropped={})


def test_add_run_folds_in_sender_order_whatever_the_arrival_order() -> None:
    """b's run arrives first and is held; a's run then folds a's and b's sums per stretch;
    c's chunk 1 never comes: the mean of chunk 1 divides by 2, of chunk 0 by 3."""
    acc = BucketAccumulator([2, 2], AggregationConfig(), order=["a", "b", "c"])
    assert acc.add_run("b", [0, 1], torch.tensor([1e8, 1.0, 3.0, 3.0]), [b"b0", b"b1"]) == [True, True]
    assert acc.num_held == 2
    assert acc.add_run("a", [0, 1], torch.tensor([-1e8, 1.0, 1.0, 1.0]), [b"a0", b"a1"]) == [True, True]
    assert acc.num_held == 0  # both folded at once
    assert acc.add("c", 0, torch.tensor([1.0, 1.0]), b"c0") is True
    (m0, s0), (m1, s1) = ((r.mean, r.senders) for r in acc.finalize())
    assert s0 == ("a", "b", "c") and s1 == ("a", "b")
    assert torch.equal(m0, torch.tensor([1.0 / 3, 1.0]))  # ((-1e8 + 1e8) + 1) / 3, not (-1e8 + (1e8 + 1)) / 3 = 0
    assert m1.tolist() == [2.0, 2.0]


# ---------------------------------------------------------------------- the owner, end to end
NUMEL, CHUNK = 37 * 64 + 20, 64
ROUND = 0


def _engine(codec: str, aggregation: AggregationConfig, *, reduce_s: float = 3600.0) -> RoundEngine:
    layout = BucketLayout([NUMEL], ["param"], BucketConfig(bucket_bytes=4 * NUMEL, chunk_bytes=4 * CHUNK))
    eng = RoundEngine(
        "s0",
        GlobalState(layout, [torch.zeros(NUMEL)]),
        InprocTransport(InprocNetwork()),
        RoundConfig(codec=CodecConfig(name=codec), aggregation=aggregation, plan_wait_s=0.1),
    )
    plan = RoundPlan(
        round=ROUND,
        members=tuple(Member(site_id=s, address=s) for s in MEMBERS),
        reduce_timeout_s=reduce_s,
        broadcast_timeout_s=reduce_s + 1,
    )
    books = OpenRound(
        plan=plan,
        owners=["s0"],
        site_id="s0",
        chunks=[layout.buckets[0].chunks],
        aggregation=aggregation,
        opened_at=time.monotonic(),
    )
    eng._open[ROUND] = _Owned(books)
    return eng


def _contribution(chunk: int, offset: int, numel: int, codec: str, sender: str, payload: bytes) -> Contribution:
    return Contribution(
        round=ROUND, bucket=0, chunk=chunk, offset=offset, numel=numel, codec=codec, sender=sender, payload=payload
    )


def _contributions(codec_name: str, rng: random.Random, g: torch.Generator) -> list[list[Contribution]]:
    """Batches as the datagram dispatch thread hands them over: one sender's arrivals each,
    runs with gaps (lost datagrams), NaN chunks, identical and conflicting retries, and
    the odd chunk that fails the owner's checks (wrong offset, a codec not the round's,
    a sender not a member)."""
    codec = get_codec(codec_name)
    chunks = [(o, min(CHUNK, NUMEL - o)) for o in range(0, NUMEL, CHUNK)]
    sent = {}
    for s in MEMBERS[1:] + ("intruder",):
        v = torch.randn(NUMEL, generator=g)
        payloads = codec.encode_chunks(v, chunks, generator=g)
        for c, (o, n) in enumerate(chunks):
            if codec_name == "fp32" and rng.random() < 0.06:  # a NaN chunk (refused by decode: its run falls back)
                x = v[o : o + n].clone()
                x[rng.randrange(n)] = float("nan")
                body = x.numpy().tobytes()
                payloads[c] = codec._header(n, body) + body
        sent[s] = [_contribution(c, o, n, codec.name, s, payloads[c]) for c, (o, n) in enumerate(chunks)]
    batches = []
    for s, cs in sent.items():
        cs = [c for c in cs if rng.random() > 0.1 or s == "intruder"]  # lost on the way
        if s == "intruder":
            cs = cs[:5]
        i = 0
        while i < len(cs):
            k = rng.randint(1, 12)
            batch = list(cs[i : i + k])
            if batch and rng.random() < 0.2:
                j = rng.randrange(len(batch))
                x = batch[j]
                batch[j] = rng.choice([replace(x, offset=x.offset + 1), replace(x, codec="bf16")])
            batches.append(batch)
            if rng.random() < 0.15:  # the batch again: identical retries ...
                batches.append(list(batch))
            if rng.random() < 0.1:  # ... within one batch (two runs of ascending chunks)
                batches.append(batch + batch)
            if rng.random() < 0.3:  # ... or another payload for counted chunks
                other = codec.encode_chunks(torch.randn(NUMEL, generator=g), chunks, generator=g)
                batches.append([replace(x, payload=other[x.chunk]) for x in batch])
            i += k
    rng.shuffle(batches)  # senders interleaved and out of order
    return batches


def _books_view(eng: RoundEngine) -> dict:
    books = eng._open[ROUND].books
    books.close([0])
    reds = books.finalize(0)
    return {
        "means": [(r.chunk, r.senders, r.dropped, _bits(r.mean)) for r in reds],
        "arrived": books.arrived,
        "counts": dict(books.rejections.counts),
        "examples": {k: list(v) for k, v in books.rejections.examples.items()},
        "faulty": set(books.faulty_senders),
        "refusals": list(books.refusals),
    }


def _one_at_a_time(eng: RoundEngine, cs: list[Contribution]) -> list[tuple | None]:
    """``handle_contribution`` of each: None (counted or an identical retry) or (code, reason)."""
    out = []
    for c in cs:
        try:
            eng.handle_contribution(c)
            out.append(None)
        except Rejected as e:
            out.append((e.code, e.reason))
    return out


def _answers(results: list[Rejected | None]) -> list[tuple | None]:
    return [None if r is None else (r.code, r.reason) for r in results]


def _no_elapsed(answers: list[tuple | None]) -> list[tuple | None]:
    """``answers`` with the seconds in "deadline passed X s ago" replaced by ``X``."""
    return [None if a is None else (a[0], re.sub(r"passed [0-9.]+ s ago", "passed X s ago", a[1])) for a in answers]


@pytest.mark.parametrize(
    ("codec", "config_name", "seed"),
    [("fp32", "plain", 0), ("fp32", "plain", 1), ("int8", "plain", 2), ("fp32", "max_norm", 3), ("int8", "trim", 4)],
)
def test_handle_contributions_matches_handle_contribution_per_chunk(codec: str, config_name: str, seed: int) -> None:
    rng = random.Random(seed)
    batches = _contributions(codec, rng, torch.Generator().manual_seed(seed))
    config = CONFIGS[config_name]
    one, many, cols = _engine(codec, config), _engine(codec, config), _engine(codec, config)
    want, got, got_cols, runs = [], [], [], 0
    for cs in batches:
        want += _one_at_a_time(one, cs)
        got += _answers(many.handle_contributions(cs))
        run = ContributionRun.concat(cs)  # the batch as the datagram receive thread hands it on
        runs += run is not None
        got_cols += _answers(cols.handle_contributions(run if run is not None else cs))
    assert got == want and got_cols == want
    assert runs > len(batches) // 2
    codes = {w[0] for w in want if w is not None}
    assert len(codes) >= 3, f"the batches exercise too few refusals: {codes}"
    view_one, view_many = _books_view(one), _books_view(many)
    assert view_many == view_one and _books_view(cols) == view_one
    assert sum(1 for m in view_one["means"] if m[3] is not None) > 10


def test_handle_contributions_after_close_and_past_the_deadline_answer_as_per_chunk() -> None:
    codec = get_codec("int8")
    g = torch.Generator().manual_seed(7)
    chunks = [(o, min(CHUNK, NUMEL - o)) for o in range(0, NUMEL, CHUNK)]
    payloads = codec.encode_chunks(torch.randn(NUMEL, generator=g), chunks, generator=g)
    cs = [_contribution(c, o, n, "int8", "s1", payloads[c]) for c, (o, n) in enumerate(chunks[:6])]
    for late in (False, True):
        one, many = (_engine("int8", AggregationConfig(), reduce_s=0.0 if late else 3600.0) for _ in range(2))
        for eng in (one, many):
            assert eng.handle_contributions(cs[:3]) == [None] * 3 or late
            if not late:
                with eng._open[ROUND].cv:
                    eng._open[ROUND].books.close([0])
        retry = cs[1:5]  # counted ones again (identical retries) and new ones
        want = _one_at_a_time(one, retry)
        # the late reason says how long ago the deadline passed: the two engines' clocks differ by
        # the milliseconds between their calls (CI: 0.002 vs 0.004 s), so that figure is left out
        assert _no_elapsed(_answers(many.handle_contributions(retry))) == _no_elapsed(want)
        assert any(w is not None and "late" in w[1] for w in want) or not late
        assert want[0] is None or late  # an identical retry is never refused while open or after close


def test_accept_own_matches_accept_per_chunk() -> None:
    codec = get_codec("int8")
    g = torch.Generator().manual_seed(9)
    chunks = [(o, min(CHUNK, NUMEL - o)) for o in range(0, NUMEL, CHUNK)]
    payloads = codec.encode_chunks(torch.randn(NUMEL, generator=g), chunks, generator=g)
    cs = [_contribution(c, o, n, "int8", "s0", payloads[c]) for c, (o, n) in enumerate(chunks)]
    one, many = _engine("int8", AggregationConfig()), _engine("int8", AggregationConfig())
    for c in cs:
        one._accept(one._open[ROUND], c)
    assert many.accept_own(many._open[ROUND], cs) == [None] * len(cs)
    assert _books_view(many) == _books_view(one)


def test_bench_owner_measures_identical_means_on_a_small_bucket() -> None:
    """experiments/bench_owner.py's measurement runs (its figures are printed, never asserted)."""
    from experiments.bench_owner import _measure

    r = _measure(20_000, 16, 0.1, repeats=1)
    assert r["identical"] is True
    assert r["num"] > 0.8 * 3 * (20_000 // 1280)  # 3 senders' chunks, ~10% lost


@pytest.mark.parametrize("weights", [None, {"s0": 1.5, "s1": 0.5, "s2": 1.0, "s3": 2.0}])
@pytest.mark.parametrize("last_sender_misses", [0, 1, 3])
def test_finalize_divides_the_sums_once_in_place_with_the_bits_of_a_per_chunk_count_division(
    weights, last_sender_misses: int
) -> None:
    """``finalize`` divides the running sums in place (one division by the common count when
    every chunk has it, else one per chunk row) and keeps its result: called again it returns
    the same means, not divided twice. The bits are those of dividing each chunk's fp32 sum,
    in sender order, by its float32 count × f̄ (``mean_factor``)."""
    from dtrain.aggregation import mean_factor

    g = torch.Generator().manual_seed(7)
    numels = [64] * 9 + [17]
    vals = {s: torch.randn(sum(numels), generator=g) for s in MEMBERS}
    acc = BucketAccumulator(numels, AggregationConfig(), order=MEMBERS, weights=weights)
    pos = [sum(numels[:c]) for c in range(len(numels) + 1)]
    reach = {s: list(range(len(numels))) for s in MEMBERS}
    reach["s3"] = reach["s3"][last_sender_misses:]  # s3's first chunks lost: those chunks count 3
    for s in MEMBERS:
        cs = reach[s]
        acc.add_run(s, cs, torch.cat([vals[s][pos[c] : pos[c + 1]] for c in cs]), [f"{s}{c}".encode() for c in cs])
    got = acc.finalize()
    fbar = mean_factor(weights)
    for c, (mean, senders) in enumerate((r.mean, r.senders) for r in got):
        want_senders = tuple(s for s in MEMBERS if c in reach[s])
        total = None  # folded as the accumulator folds: copy / add_, or mul / add_ with alpha
        for s in want_senders:
            v, w = vals[s][pos[c] : pos[c + 1]], 1.0 if weights is None else weights[s]
            if total is None:
                total = v.clone() if w == 1.0 else torch.mul(v, w)
            else:
                total.add_(v) if w == 1.0 else total.add_(v, alpha=w)
        want = total / torch.tensor([len(want_senders) * fbar], dtype=torch.float32)
        assert senders == want_senders and _bits(mean) == _bits(want), f"chunk {c}"
    again = acc.finalize()
    assert again is got and all(_bits(a.mean) == _bits(b.mean) for a, b in zip(again, got))
