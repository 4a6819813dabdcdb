"""The round engine's cheaper full-model passes give the values of the ones they replaced: the
pseudo-gradient (one subtraction per segment), the owner's mean (one cat), the checksums (BLAKE3,
hashed in place)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import threading
import time
from types import SimpleNamespace

import blake3
import numpy as np
import pytest
import torch

from dtrain.aggregation import BucketReduction, ChunkReduction
from dtrain.app.worker import outer_state_checksum
from dtrain.buckets import BucketConfig, BucketLayout, checksum, tensor_digest
from dtrain.codecs import CodecConfig, get_codec
from dtrain.codecs.base import CheckedRun
from dtrain.codecs.native import kernels
from dtrain.diloco import theta_checksum
from dtrain.rounds import error_feedback
from dtrain.rounds.means import encode_mean
from dtrain.state import GlobalState

pytestmark = pytest.mark.timeout(60)


def _dense(mean: torch.Tensor | CheckedRun) -> torch.Tensor:
    """A mean as a tensor (an undecoded CheckedRun decoded)."""
    return mean.tensor() if isinstance(mean, CheckedRun) else mean


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _reference_add(layout, theta, residuals, tensors, *, error_feedback_on: bool, decay: float = 1.0) -> bool:
    """add_pseudo_gradient as it was: gather, θ rounded to low dtypes, subtract, add, isfinite."""
    ok = True
    for b, bucket in enumerate(layout.buckets):
        local = layout.gather(b, tensors)
        ref = theta[b].detach().clone()
        for sg in bucket.segments:
            dt = tensors[sg.tensor_index].dtype
            if dt != torch.float32:
                sl = slice(sg.bucket_offset, sg.bucket_offset + sg.numel)
                ref[sl] = ref[sl].to(dt).float()
        delta = ref - local
        if residuals[b] is None or not error_feedback_on:
            residuals[b] = delta.clone()
        else:
            residuals[b].mul_(decay).add_(delta)
        ok = ok and bool(torch.isfinite(residuals[b]).all())
    if not ok:
        for b in range(len(layout)):
            residuals[b] = None
    return ok


def _model(dtypes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sizes = [1000, 37, 4096, 1, 777]
    return [(torch.randn(n, generator=g) * 0.1).to(dt) for n, dt in zip(sizes, dtypes)]


@pytest.mark.parametrize("error_feedback_on,decay", [(True, 1.0), (True, 0.95), (False, 1.0)])
@pytest.mark.parametrize(
    "dtypes",
    [[torch.float32] * 5, [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]],
    ids=["fp32", "mixed"],
)
def test_pseudo_gradient_equals_the_gather_then_subtract_reference(
    dtypes, error_feedback_on: bool, decay: float, kernel_path: str
) -> None:
    tensors = _model(dtypes)
    layout = BucketLayout(
        [t.numel() for t in tensors], ["param"] * 5, BucketConfig(bucket_bytes=4 * 1500, chunk_bytes=4 * 500)
    )
    assert any(len(b.segments) > 1 for b in layout.buckets)  # a tensor spans two buckets
    state = GlobalState(layout, tensors)
    with torch.no_grad():  # θ after an outer step: not representable in a bf16/fp16 model's dtype
        for th in state.theta:
            th.add_(torch.randn(th.shape, generator=torch.Generator().manual_seed(4)) * 1e-3)
    got: list = [None] * len(layout)
    want: list = [None] * len(layout)
    for step in range(3):  # the residual carries over between rounds
        for t in tensors:
            t.add_(torch.randn(t.shape).to(t.dtype) * 1e-3)
        assert error_feedback.add_pseudo_gradient(
            layout, state.theta, got, tensors, error_feedback=error_feedback_on, decay=decay
        ) == _reference_add(layout, state.theta, want, tensors, error_feedback_on=error_feedback_on, decay=decay)
        for g, w in zip(got, want):
            assert torch.equal(_bits(g), _bits(w)), step
    assert all(float(g.abs().max()) > 0 for g in got)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_pseudo_gradient_clears_every_residual(bad: float, kernel_path: str) -> None:
    tensors = _model([torch.float32] * 5)
    layout = BucketLayout(
        [t.numel() for t in tensors], ["param"] * 5, BucketConfig(bucket_bytes=4 * 1500, chunk_bytes=4 * 500)
    )
    state = GlobalState(layout, tensors)
    tensors[2][100] = bad
    residuals: list = [torch.zeros(b.numel) for b in layout.buckets]
    assert not error_feedback.add_pseudo_gradient(layout, state.theta, residuals, tensors, error_feedback=True)
    assert residuals == [None] * len(layout)


@pytest.mark.parametrize("with_residual", [False, True])
def test_encode_mean_of_every_chunk_in_order_equals_chunk_by_chunk(with_residual: bool) -> None:
    codec = get_codec("int8")
    tensors = [torch.zeros(6 * 1280 + 100)]
    layout = BucketLayout([tensors[0].numel()], ["param"], BucketConfig(chunk_bytes=4 * 1280))
    bucket = layout.buckets[0]
    g = torch.Generator().manual_seed(5)
    reds = [
        ChunkReduction(chunk=c, mean=torch.randn(n, generator=g), senders=("a",))
        for c, (_, n) in enumerate(bucket.chunks)
    ]
    res0 = torch.randn(bucket.numel, generator=g) * 1e-3 if with_residual else None
    res_a = None if res0 is None else res0.clone()
    res_b = None if res0 is None else res0.clone()
    chunks_a, full_a = encode_mean(codec, bucket, reds, residual=res_a, generator=torch.Generator())
    # the chunk-by-chunk path: the same reductions, out of order (as a caller may pass them)
    order = list(reversed(range(len(reds))))
    chunks_b, full_b = encode_mean(codec, bucket, [reds[i] for i in order], residual=res_b, generator=torch.Generator())
    assert [c.payload for c in chunks_a] == [chunks_b[order.index(i)].payload for i in range(len(reds))]
    # in order and without a residual, the mean is handed on undecoded (the owner's step decodes it)
    assert isinstance(full_a, CheckedRun) != with_residual and isinstance(full_b, torch.Tensor)
    assert torch.equal(_bits(_dense(full_a)), _bits(full_b))
    if with_residual:
        assert torch.equal(_bits(res_a), _bits(res_b)) and float(res_a.abs().max()) > 0


@pytest.mark.parametrize("with_residual", [False, True])
def test_encode_mean_of_a_bucket_reduction_encodes_its_tensor_in_place_with_the_same_bytes(
    with_residual: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's accumulator hands over one bucket-sized mean (a BucketReduction): encoded from
    that tensor without a copy (with a residual, one add), the same payloads, decoded mean and
    residual as from separate chunk tensors; the tensor itself is not written."""
    codec = get_codec("int8")
    layout = BucketLayout([6 * 1280 + 100], ["param"], BucketConfig(chunk_bytes=4 * 1280))
    bucket = layout.buckets[0]
    g = torch.Generator().manual_seed(9)
    base = torch.randn(bucket.numel + 7, generator=g)[7:]  # not at its storage's start
    numels = [n for _, n in bucket.chunks]
    senders = [("a", "b") if c % 2 else ("a",) for c in range(len(numels))]
    whole = BucketReduction(base, numels, senders)
    copies = [ChunkReduction(chunk=r.chunk, mean=r.mean.clone(), senders=r.senders) for r in whole]
    res0 = torch.randn(bucket.numel, generator=g) * 1e-3 if with_residual else None
    res_a, res_b = (None, None) if res0 is None else (res0.clone(), res0.clone())
    seen = []
    real = type(codec).encode_chunks
    monkeypatch.setattr(type(codec), "encode_chunks", lambda self, x, *a, **k: seen.append(x) or real(self, x, *a, **k))
    before = base.clone()
    ca, fa = encode_mean(codec, bucket, whole, residual=res_a, generator=torch.Generator())
    cb, fb = encode_mean(codec, bucket, copies, residual=res_b, generator=torch.Generator())
    assert (seen[0].data_ptr() == base.data_ptr()) != with_residual  # the mean itself, unless a residual is added
    assert [c.payload for c in ca] == [c.payload for c in cb] and torch.equal(_bits(_dense(fa)), _bits(_dense(fb)))
    assert [(c.chunk, c.senders) for c in ca] == [(c.chunk, c.senders) for c in cb] == list(enumerate(senders))
    assert torch.equal(_bits(base), _bits(before))  # not written
    if with_residual:
        assert torch.equal(_bits(res_a), _bits(res_b))


def test_a_bucket_reduction_is_the_sequence_of_its_chunk_reductions() -> None:
    """Item c of a BucketReduction equals chunk c's ChunkReduction (a view of the bucket's mean;
    None and no senders where nothing arrived); of_chunks holds per-chunk results as columns."""
    mean = torch.arange(7, dtype=torch.float32)
    red = BucketReduction(mean, [3, 2, 2], [("a",), (), ("a", "b")], {2: {"c": "norm too large"}})
    assert len(red) == 3 and not red.complete
    first = red[0]
    assert (first.chunk, first.senders, first.dropped) == (0, ("a",), {}) and first.mean.data_ptr() == mean.data_ptr()
    assert red[1] == ChunkReduction(chunk=1, mean=None, senders=())
    assert red[-1].mean.tolist() == [5.0, 6.0] and red[-1].dropped == {"c": "norm too large"}
    assert [r.chunk for r in red[1:]] == [1, 2]
    with pytest.raises(IndexError):
        red[3]
    with pytest.raises(ValueError, match="mean has 7 elements, the chunks 6"):
        BucketReduction(mean, [3, 3], [(), ()])
    items = [(torch.ones(3), ("a",), {}), (None, (), {"b": "NaN"}), (torch.full((2,), 2.0), ("a",), {})]
    cols = BucketReduction.of_chunks([3, 2, 2], items)
    assert cols.mean.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 2.0] and cols.senders == [("a",), (), ("a",)]
    assert cols.dropped == {1: {"b": "NaN"}} and not cols.complete
    assert BucketReduction.of_chunks([2], [(None, (), {})]).mean is None


def test_checksum_is_blake3_of_the_raw_bytes_and_tells_apart_what_differs() -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    assert checksum(t) == blake3.blake3(t.numpy().tobytes()).hexdigest(length=16)
    assert len(checksum(t)) == 32 and checksum(t) != hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()
    assert checksum(t[::2]) == checksum(torch.tensor([1.0, 3.0]))  # a strided view hashes its values
    assert checksum(torch.tensor(2.5)) == checksum(torch.tensor([2.5]))  # a 0-dim tensor
    assert checksum(torch.empty(0)) == blake3.blake3(b"").hexdigest(length=16)
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))
    h = tensor_digest(torch.tensor([4.0]), tensor_digest(t))
    assert h.hexdigest() == blake3.blake3(t.numpy().tobytes() + torch.tensor([4.0]).numpy().tobytes()).hexdigest()


def _diloco(seed: int, momentum_steps: int) -> SimpleNamespace:
    tensors = [torch.randn(3000, generator=torch.Generator().manual_seed(seed))]
    layout = BucketLayout([3000], ["param"], BucketConfig(bucket_bytes=4 * 1024, chunk_bytes=4 * 1024))
    state = GlobalState(layout, tensors)
    for _ in range(momentum_steps):
        for b in range(len(layout)):
            state.apply_mean(b, torch.full((layout.buckets[b].numel,), 0.01))
    return SimpleNamespace(state=state)


def test_outer_state_checksum_agrees_on_equal_states_and_differs_otherwise() -> None:
    a, b = _diloco(0, 2), _diloco(0, 2)
    assert outer_state_checksum(a) == outer_state_checksum(b) and len(outer_state_checksum(a)) == 16
    assert theta_checksum(a.state) == theta_checksum(b.state)
    assert outer_state_checksum(_diloco(0, 3)) != outer_state_checksum(a)  # another momentum
    assert outer_state_checksum(_diloco(0, 0)) != outer_state_checksum(a)  # no momentum yet
    with torch.no_grad():
        b.state.optimizers[1].state[b.state.theta[1]]["momentum_buffer"][7] += 1e-6
    assert outer_state_checksum(b) != outer_state_checksum(a)


def test_the_built_in_outer_sgd_is_torchs_fused_kernel_with_the_per_op_paths_bits_but_a_tensors_tail() -> None:
    """torch's fused CPU SGD gives the per-op path's bits except in a tensor's last ``n % 32``
    elements, which it rounds once differently (an ulp): every site steps the same bucket shapes
    (the layout, and the same --ranks-per-site, are checked at join), so sites still agree; and
    the fused result does not depend on torch's thread count."""
    from dtrain.state import _buffer_outer_optimizer, default_outer_optimizer, delayed_outer_optimizer

    n = 100_003
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=g) for _ in range(5)]
    body = n - n % 32
    for make, kw in (
        (default_outer_optimizer, dict(lr=0.7, momentum=0.9, nesterov=True)),
        (delayed_outer_optimizer, dict(lr=0.7, momentum=0.7, nesterov=True)),
        (_buffer_outer_optimizer, dict(lr=1.0, momentum=0.0)),
    ):
        start = torch.randn(n, generator=g)
        runs = []
        for opt, threads in ((make, 1), (make, 2), (lambda ps: torch.optim.SGD(ps, **kw), 1)):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                t = start.clone()
                o = opt([t])
                for d in grads:
                    t.grad = d.clone()
                    o.step()
            finally:
                torch.set_num_threads(before)
            runs.append((o, t, o.state[t].get("momentum_buffer")))
        (fused, ours, buf), (_, ours2, buf2), (plain, ref, ref_buf) = runs
        assert fused.param_groups[0]["fused"] is True and plain.param_groups[0]["fused"] is None
        assert torch.equal(_bits(ours), _bits(ours2)), make.__name__  # 1 or 2 threads: the same bits
        assert torch.equal(_bits(ours[:body]), _bits(ref[:body])), make.__name__
        torch.testing.assert_close(ours[body:], ref[body:], rtol=1e-6, atol=1e-7)
        if kw["momentum"]:
            assert torch.equal(_bits(buf), _bits(buf2)), make.__name__
            assert torch.equal(_bits(buf[:body]), _bits(ref_buf[:body])), make.__name__


@pytest.mark.parametrize("fail", [False, True])
def test_a_round_that_raises_after_its_encode_leaves_the_residual_whole(fail: bool, kernel_path: str) -> None:
    """A one-site round with int8 (its encode settles the residual in place where the kernels
    run): applied, the residual is what the codec lost, bit for bit; a step that raises after
    the encode and before a mean arrived (here taking the means) still settles, and with no
    mean the residual is the pseudo-gradient as it was, bit for bit."""
    from dtrain.protocol import Member, RoundPlan
    from dtrain.rounds.engine import RoundEngine
    from dtrain.rounds.types import RoundConfig
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    n = 4 * 1024
    layout = BucketLayout([n], ["param"], BucketConfig(bucket_bytes=4 * n, chunk_bytes=4 * 1024))
    codec = get_codec("int8")
    chunks = layout.buckets[0].chunks
    state, transport = GlobalState(layout, [torch.zeros(n)]), InprocTransport(InprocNetwork())
    engine = RoundEngine(
        "a", state, transport, RoundConfig(codec=codec.config, broadcast_codec=get_codec("fp32").config)
    )
    engine.start()
    try:
        local = torch.randn(n, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, n)
        assert engine.add_pseudo_gradient([local])
        delta = engine.state.residuals[0].clone()
        assert codec.settles_in_place(delta, chunks) == (kernel_path == "compiled")
        member = Member(site_id="a", address=engine.address)
        plan = RoundPlan(round=0, members=(member,), reduce_timeout_s=1.5, broadcast_timeout_s=3.0)
        if fail:
            engine._broadcast = lambda run: (_ for _ in ()).throw(RuntimeError("broadcast failed"))
            with pytest.raises(RuntimeError, match="broadcast failed"):
                engine.run_round(plan)
            want = delta  # no mean: the contribution kept whole
        else:
            assert engine.run_round(plan).applied_buckets == 1
            want = delta - codec.decode_chunks(codec.encode_chunks(delta, chunks), [m for _, m in chunks])
        assert torch.equal(engine.state.residuals[0].view(torch.int32), want.view(torch.int32))
    finally:
        engine.stop(0.1)


def _fused_layout(tensors) -> BucketLayout:
    """Buckets of several tensors' segments (boundaries inside blocks), in chunks of whole blocks."""
    return BucketLayout(
        [t.numel() for t in tensors], ["param"] * len(tensors), BucketConfig(bucket_bytes=4 * 2560, chunk_bytes=4 * 512)
    )


@pytest.mark.parametrize("codec_name", ["int8", "int4"])
@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_accumulate_encode_is_the_accumulation_then_the_settling_encode_bit_for_bit(
    codec_name: str, decay: float, kernel_path: str
) -> None:
    """add_pseudo_gradient with a codec encodes each bucket in the same pass (compiled path):
    the residuals left settled and the payloads cut from its body are, bit for bit, what the
    accumulation and then ``encode_chunks(settle=True)`` give, round after round."""
    codec = get_codec(codec_name)
    tensors = _model([torch.float32] * 5)
    layout = _fused_layout(tensors)
    assert any(len(b.segments) > 1 for b in layout.buckets)
    state = GlobalState(layout, tensors)
    fused: list = [torch.zeros(b.numel) for b in layout.buckets]
    apart: list = [torch.zeros(b.numel) for b in layout.buckets]
    for step in range(3):
        for t in tensors:
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(step)) * 1e-2)
        encoded: dict = {}
        assert error_feedback.add_pseudo_gradient(
            layout, state.theta, fused, tensors, error_feedback=True, decay=decay, codec=codec, encoded=encoded
        )
        assert error_feedback.add_pseudo_gradient(layout, state.theta, apart, tensors, error_feedback=True, decay=decay)
        assert sorted(encoded) == (list(range(len(layout))) if kernel_path == "compiled" else [])
        for b, bk in enumerate(layout.buckets):
            assert codec.settles_in_place(apart[b], bk.chunks) == (kernel_path == "compiled")
            if b not in encoded:
                continue
            want = codec.encode_chunks(apart[b], bk.chunks, settle=True)
            assert codec.encode_chunks(fused[b], bk.chunks, encoded=encoded[b]) == want, (step, b)
            assert torch.equal(_bits(fused[b]), _bits(apart[b])), (step, b)
    assert all(float(r.abs().max()) > 0 for r in fused)


def test_accumulate_encode_refuses_a_non_finite_residual_and_what_it_cannot_encode(kernel_path: str) -> None:
    codec = get_codec("int8")
    tensors = _model([torch.float32] * 5)
    layout = _fused_layout(tensors)
    state = GlobalState(layout, tensors)
    residuals: list = [torch.zeros(b.numel) for b in layout.buckets]
    tensors[4][5] = float("nan")  # in the last bucket: the earlier ones were encoded already
    encoded: dict = {}
    assert not error_feedback.add_pseudo_gradient(
        layout, state.theta, residuals, tensors, error_feedback=True, codec=codec, encoded=encoded
    )
    assert residuals == [None] * len(layout) and encoded == {}
    r, th = torch.zeros(layout.buckets[0].numel), state.theta[0].detach()
    pieces = [torch.zeros(r.numel())]
    sr = CodecConfig(name="int8", stochastic_rounding=True)
    for other in (sr, "int8+zstd", "fp16", "topk"):  # no settle in place here, or sparse: not encoded ahead
        assert get_codec(other).accumulate_encode(r, th, pieces, layout.buckets[0].chunks, decay=1.0) is None
    strided = torch.zeros(2 * r.numel())[::2]
    assert codec.accumulate_encode(r, th, [strided], layout.buckets[0].chunks, decay=1.0) is None
    why = "accumulate_encode's body" if kernel_path == "compiled" else "does not settle in place"
    with pytest.raises(ValueError, match=why):
        codec.encode_chunks(r, layout.buckets[0].chunks, encoded=np.zeros(3, dtype=np.uint8))


@pytest.mark.parametrize(
    "scenario",
    ["pushed", "never_pushed", "pseudo_gradient_twice", "not_a_member", "pacer_raises", "residuals_replaced"],
)
def test_a_site_that_encodes_ahead_ends_each_round_as_one_that_encodes_at_the_push(scenario: str) -> None:
    """RoundEngine.add_pseudo_gradient encodes (and settles) each bucket in the accumulation's
    pass; the pushes only cut the payloads. Against a site that accumulates, then encodes at
    the push (the same engine, its codec's one-pass encode off), θ and the residuals agree bit
    for bit after every round: pushed; never pushed (the settle undone from the payloads cut
    at the close); the pseudo-gradient added twice before a round (the first encode undone);
    a round that does not open (undone at once); a round that raises before its pushes (a
    bad pacing window: restored by its settle); residuals replaced between two
    pseudo-gradients (as a state load does: the old body neither undone onto nor sent for
    the new residual)."""
    from dtrain.protocol import Member, RoundPlan
    from dtrain.rounds.engine import RoundEngine
    from dtrain.rounds.types import RoundConfig
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    tensors = _model([torch.float32] * 5)
    layout = _fused_layout(tensors)
    cfg = RoundConfig(codec=get_codec("int8").config, broadcast_codec=get_codec("fp32").config)
    engines = [RoundEngine("a", GlobalState(layout, tensors), InprocTransport(InprocNetwork()), cfg) for _ in "ab"]
    engines[0].codec, engines[1].codec = copy.copy(engines[0].codec), copy.copy(engines[1].codec)
    engines[1].codec.accumulate_encode = lambda *a, **k: None  # encodes at the push, as before
    ahead: list = []  # what engines[0]'s one-pass encodes returned
    one_pass = engines[0].codec.accumulate_encode

    def counted(*a, **k):
        ahead.append(one_pass(*a, **k))
        return ahead[-1]

    engines[0].codec.accumulate_encode = counted
    for e in engines:
        e.start()
    try:
        for r in range(4):
            g = torch.Generator().manual_seed(r)
            local = [t + torch.randn(t.shape, generator=g) * 1e-2 for t in tensors]
            for e in engines:
                plan = RoundPlan(
                    round=r,
                    members=(Member(site_id="a", address=e.address),),
                    reduce_timeout_s=0.5,
                    broadcast_timeout_s=1.0,
                )
                assert e.add_pseudo_gradient(local)
                if r == 2 and scenario == "pseudo_gradient_twice":
                    assert e.add_pseudo_gradient(local)
                if r == 2 and scenario == "residuals_replaced":
                    e.state.residuals[:] = [torch.full_like(v, 1e-3) for v in e.state.residuals]
                    assert e.add_pseudo_gradient(local)
                if r == 2 and scenario == "pacer_raises":
                    with pytest.raises(ValueError, match="window"):
                        e.run_round(plan, pace_window_s=0.0)
                    continue
                if r == 2 and scenario == "not_a_member":
                    with pytest.raises(ValueError, match="not a member"):
                        e.run_round(dataclasses.replace(plan, members=(Member(site_id="z", address="x"),)))
                    assert e._encoded == {}  # noqa: SLF001 - undone
                    continue
                if r == 2 and scenario == "never_pushed":
                    e._reduce = lambda run: None  # noqa: SLF001 - no contribution leaves: nothing applied
                res = e.run_round(plan)
                e.__dict__.pop("_reduce", None)
                assert res.applied_buckets == (0 if r == 2 and scenario == "never_pushed" else len(layout))
            if r >= 1:  # round 0 has no residual yet: Δ is computed into a new one
                assert engines[0]._encoded == {}  # noqa: SLF001 - every body taken by its round or undone
            for b in range(len(layout)):
                a, o = engines[0].state, engines[1].state
                assert torch.equal(_bits(a.theta[b].detach()), _bits(o.theta[b].detach())), (r, b)
                assert torch.equal(_bits(a.residuals[b]), _bits(o.residuals[b])), (r, b)
        if kernels() is not None:  # rounds 1-3 (and a second time in round 2) encoded every bucket ahead
            twice = scenario in ("pseudo_gradient_twice", "residuals_replaced")
            assert sum(x is not None for x in ahead) == len(layout) * (4 if twice else 3)
    finally:
        for e in engines:
            e.stop(0.1)


def test_a_push_given_up_while_it_cuts_its_body_leaves_the_residual_restored_at_the_close() -> None:
    """A push thread given up in flight (Fanout) may still be cutting a body encoded ahead when
    its round closes: the cut and its registration are one step under the run's lock, so the
    close waits for it and the settle restores the residual (nothing was applied) instead of
    missing its payloads (a KeyError that left the round's other residuals settled)."""
    from dtrain.protocol import Member, RoundPlan
    from dtrain.rounds.engine import RoundEngine
    from dtrain.rounds.types import RoundConfig
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    if kernels() is None:
        pytest.skip("no body is encoded ahead without the compiled kernels")
    tensors = _model([torch.float32] * 5)
    layout = _fused_layout(tensors)
    cfg = RoundConfig(codec=get_codec("int8").config, broadcast_codec=get_codec("fp32").config)
    e = RoundEngine("a", GlobalState(layout, tensors), InprocTransport(InprocNetwork()), cfg)
    e.codec = copy.copy(e.codec)
    cut = e.codec.encode_chunks
    late = threading.Event()

    def slow_cut(*a, **k):
        if k.get("encoded") is not None and threading.current_thread().name == "late-push":
            late.set()
            time.sleep(0.5)  # still cutting when the round closes
        return cut(*a, **k)

    e.codec.encode_chunks = slow_cut

    def given_up_push(run) -> None:  # the push of bucket 0 left running, as a given-up Fanout thread
        t = threading.Thread(target=lambda: list(e._contributions(run, [0], remote=True)), name="late-push")
        t.start()
        assert late.wait(5.0)

    e.start()
    try:
        members = (Member(site_id="a", address=e.address),)
        assert e.add_pseudo_gradient([t + 1e-2 for t in tensors])
        assert e.run_round(
            RoundPlan(round=0, members=members, reduce_timeout_s=0.3, broadcast_timeout_s=0.6)
        ).applied_buckets == len(layout)
        local = [t - 1e-2 for t in tensors]
        want = [r.clone() for r in e.state.residuals]  # the residuals with round 1's Δ added, not encoded
        assert error_feedback.add_pseudo_gradient(layout, e.state.theta, want, local, error_feedback=True)
        assert e.add_pseudo_gradient(local)  # added, encoded and settled ahead
        assert not torch.equal(_bits(e.state.residuals[0]), _bits(want[0]))
        e._reduce = given_up_push  # noqa: SLF001
        res = e.run_round(RoundPlan(round=1, members=members, reduce_timeout_s=0.3, broadcast_timeout_s=0.6))
        assert res.applied_buckets == 0  # bucket 0's push never reached its owner, the others never left
        for b in range(len(layout)):  # not included, no mean: each residual whole again, bit for bit
            assert torch.equal(_bits(e.state.residuals[b]), _bits(want[b])), b
    finally:
        e.stop(0.1)


@pytest.mark.skipif(kernels() is None, reason="needs the compiled codec kernels")
@pytest.mark.parametrize("codec_name", ["int8", "int4"])
@pytest.mark.parametrize("hyper", [(0.7, 0.9, True, 0.0, 0.0), (0.3, 0.5, False, 0.01, 0.1)])
@pytest.mark.parametrize("last", [1283, 1293])  # 7,683 % 16 = 3; 7,693 % 16 = 13: torch's tail in two parts
def test_the_outer_step_decoding_in_its_own_pass_gives_torchs_bits(codec_name: str, hyper: tuple, last: int) -> None:
    """GlobalState.apply_mean of a mean's checked payloads (a CheckedRun: decoded by the fused
    step's own pass where sgd_width found torch's kernel) and of the decoded tensor (torch's
    step): the same θ, momentum and checksum, bit for bit, at the first step (new momentum) and
    later ones, on a bucket whose last chunk is short and whose size leaves a tail."""
    lr, momentum, nesterov, wd, damp = hyper
    codec = get_codec(codec_name)
    numel = 5 * 1280 + last  # chunks of 1,280 and a last, shorter one: two runs
    layout = BucketLayout([numel], ["param"], BucketConfig(chunk_bytes=4 * 1280))
    bucket = layout.buckets[0]

    def make() -> GlobalState:
        return GlobalState(
            layout,
            [torch.randn(numel, generator=torch.Generator().manual_seed(3))],
            outer_optimizer=lambda ps: torch.optim.SGD(
                ps, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd, dampening=damp, fused=True
            ),
        )

    fused, plain = make(), make()
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        payloads = codec.encode_chunks(torch.randn(numel, generator=g) * 1e-2, list(bucket.chunks))
        run = codec.checked_run(payloads, [n for _, n in bucket.chunks])
        assert run is not None
        after = fused.apply_mean(0, run)
        assert run._tensor is None  # never decoded into a tensor: the step decoded it  # noqa: SLF001
        assert after == plain.apply_mean(0, codec.decode_chunks(payloads, [n for _, n in bucket.chunks]))
        assert torch.equal(_bits(fused.theta[0].detach()), _bits(plain.theta[0].detach()))
        bufs = [s.optimizers[0].state[s.theta[0]]["momentum_buffer"] for s in (fused, plain)]
        assert torch.equal(_bits(bufs[0]), _bits(bufs[1]))


@pytest.mark.skipif(kernels() is None, reason="needs the compiled codec kernels")
def test_without_a_width_that_gives_torchs_bits_the_outer_step_decodes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """sgd_width tries its candidates against torch's kernel: where none matches (here: only a
    wrong one offered) the fused pass is not used and a CheckedRun is decoded, then stepped by
    torch; an outer optimizer other than fused SGD always is."""
    from dtrain.codecs import native

    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # torch 2.13's AVX-512 kernel, this machine's
        assert native.sgd_width() == 8
    native.sgd_width.cache_clear()
    monkeypatch.setattr(native, "_SGD_WIDTHS", (4,))
    try:
        assert native.sgd_width() is None
    finally:
        native.sgd_width.cache_clear()
    codec = get_codec("int8")
    layout = BucketLayout([2 * 1280 + 5], ["param"], BucketConfig(chunk_bytes=4 * 1280))
    chunks = list(layout.buckets[0].chunks)
    payloads = codec.encode_chunks(torch.randn(layout.total_numel) * 1e-2, chunks)
    for factory in (None, lambda ps: torch.optim.Adam(ps, lr=1e-3)):
        kw = {} if factory is None else {"outer_optimizer": factory}
        a = GlobalState(layout, [torch.ones(layout.total_numel)], **kw)
        b = GlobalState(layout, [torch.ones(layout.total_numel)], **kw)
        run = codec.checked_run(payloads, [n for _, n in chunks])
        assert a.apply_mean(0, run) == b.apply_mean(0, codec.decode_chunks(payloads, [n for _, n in chunks]))
        assert run._tensor is not None  # decoded first  # noqa: SLF001
    native.sgd_width.cache_clear()


@pytest.mark.skipif(kernels() is None, reason="needs the compiled codec kernels")
def test_the_one_pass_step_leaves_hooked_optimizers_to_torch_and_keeps_lr_schedulers_informed() -> None:
    """A step hook may read the gradient, which the one-pass step never makes: an optimizer
    with one is stepped by torch (the mean decoded first). An LR scheduler only records that
    the step ran: the one-pass step records it too (no "lr_scheduler.step() before
    optimizer.step()" warning), its lr is the scheduled one, and θ's version moves."""
    import warnings

    codec = get_codec("int8")
    layout = BucketLayout([2 * 1280 + 21], ["param"], BucketConfig(chunk_bytes=4 * 1280))
    chunks = list(layout.buckets[0].chunks)
    numels = [n for _, n in chunks]
    payloads = codec.encode_chunks(torch.randn(layout.total_numel) * 1e-2, chunks)
    hooked = GlobalState(layout, [torch.ones(layout.total_numel)])
    seen = []
    hooked.optimizers[0].register_step_pre_hook(lambda opt, *a: seen.append(opt.param_groups[0]["params"][0].grad))
    run = codec.checked_run(payloads, numels)
    hooked.apply_mean(0, run)
    assert run._tensor is not None and seen[0] is not None  # noqa: SLF001 - torch stepped it, gradient set
    states = [GlobalState(layout, [torch.ones(layout.total_numel)]) for _ in range(2)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(s.optimizers[0], lambda r: 0.5**r) for s in states]
    version = states[0].theta[0]._version
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler's order warning would raise here
        for _ in range(3):
            run = codec.checked_run(payloads, numels)
            a = states[0].apply_mean(0, run)
            assert run._tensor is None  # noqa: SLF001 - the one-pass step ran
            assert a == states[1].apply_mean(0, codec.decode_chunks(payloads, numels))
            for sch in scheds:
                sch.step()
    assert states[0].theta[0]._version > version
    assert states[0].optimizers[0].param_groups[0]["lr"] == states[1].optimizers[0].param_groups[0]["lr"] == 0.7 / 8
