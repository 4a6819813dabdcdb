"""Rounds between in-process sites (threads): equivalence with plain training,
a hand-computed Nesterov example, low-precision models, buffers, state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.codecs import CodecConfig
from dtrain.diloco import DiLoCo, DiLoCoConfig
from dtrain.rounds import RoundConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config

EPS32 = 2.0**-24  # unit roundoff of fp32 (half an ulp of 1.0)
# Small buckets and chunks so that every test exercises several owners and chunks.
SMALL = BucketConfig(bucket_bytes=256, chunk_bytes=64)


def sgd_outer_lr1(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Outer SGD lr=1, momentum 0: θ ← θ − mean(Δ) = the mean of the local models."""
    return torch.optim.SGD(params, lr=1.0, momentum=0.0)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def inner_sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


_G = torch.Generator().manual_seed(123)
X = torch.randn(256, 6, generator=_G)
Y = torch.sin(X @ torch.randn(6, 1, generator=_G))


def batch(k: int, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    i = ((k + shift) * 16) % 256
    return X[i : i + 16], Y[i : i + 16]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int, shift: int = 0) -> float:
    x, y = batch(k, shift)
    dtype = next(model.parameters()).dtype
    loss = ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def plain_training(num_steps: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    m = mlp()
    opt = inner_sgd(m)
    for k in range(num_steps):
        train_step(m, opt, k)
    return flat(m)


def rounding_tolerance(num_rounds: int, ref: torch.Tensor) -> float:
    """Tolerance for "equal to fp32 rounding".

    With outer SGD lr=1 and no momentum a round computes θ' = fl(θ − fl(θ − x))
    instead of x (x: the local parameters). fl(θ − x) = (θ − x)(1 + e1) and the
    outer step rounds once more, so |θ' − x| <= EPS32·(|θ − x| + |x|) + O(EPS32²)
    <= 3·EPS32·max(|θ|, |x|): about one ulp per element per round (Sterbenz: it is
    exact when θ and x are within a factor 2, which is why it is usually 0). The
    next inner steps start from θ' and may amplify that by a small factor in a
    short well-conditioned run; we allow 4x, accumulated over the rounds:
    4 · 3 · EPS32 · max|θ| per round.
    """
    return num_rounds * 4 * 3 * EPS32 * float(ref.abs().max())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_sites", [1, 3])
def test_fp32_lr1_sites_match_plain_training(num_sites: int) -> None:
    """1 site, and N sites with identical data and seeds, equal plain inner training."""
    H, R = 5, 6
    cfg = ClusterConfig(
        num_sites=num_sites,
        diloco=fast_diloco_config(sync_every=H, buckets=SMALL, rounds=RoundConfig(codec=CodecConfig(name="fp32"))),
    )
    ref = plain_training(H * R)
    tol = rounding_tolerance(R, ref)
    assert tol < 1e-5  # the tolerance is fp32 rounding, not a loose bound
    with InprocCluster(mlp, inner_sgd, cfg, outer_optimizer=sgd_outer_lr1) as c:
        c.run_steps(lambda s, k: train_step(s.model, s.optimizer, k), H * R, timeout_s=40)
        for s in c.sites:
            assert s.diloco.round == R
            assert [o.status for o in s.outcomes] == ["applied"] * R
            assert s.results[-1].members == tuple(x.site_id for x in c.sites)
            assert (flat(s.model) - ref).abs().max().item() <= tol
            assert (s.theta() - ref).abs().max().item() <= tol
            assert torch.equal(flat(s.model), s.theta())  # model was reset to θ
        assert len(set(c.checksums())) == 1  # every site has bit-identical θ
        if num_sites > 1:
            assert len(c.sites[0].state) > 1 and len(set(c.owners())) > 1  # several owners took part


@pytest.mark.timeout(30)
def test_two_sites_two_rounds_nesterov_by_hand() -> None:
    """θ after 2 rounds of outer SGD(lr 0.7, momentum 0.9, nesterov) computed by hand."""
    theta0 = [1.0, -2.0, 0.5]
    inner_lr, lr, mu = 0.1, 0.7, 0.9
    # grads[site][round] = the two inner gradients (H = 2) that site applies in that round
    grads = {
        0: [[[1.0, 0.0, 2.0], [0.5, 1.0, -1.0]], [[-1.0, 2.0, 0.0], [0.0, 0.0, 1.0]]],
        1: [[[3.0, -1.0, 0.0], [1.0, 1.0, 1.0]], [[2.0, 2.0, 2.0], [-0.5, 0.0, 0.0]]],
    }

    class Vec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(theta0))

    def step(site: Site, k: int) -> None:
        site.model.w.grad = torch.tensor(grads[site.index][k // 2][k % 2])
        site.optimizer.step()  # inner SGD: w ← w − 0.1 g; the hook runs a round every 2 steps

    nesterov = lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mu, nesterov=True)  # noqa: E731
    cfg = ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=2))
    with InprocCluster(Vec, lambda m: torch.optim.SGD(m.parameters(), lr=inner_lr), cfg, outer_optimizer=nesterov) as c:
        c.run_steps(step, 4, timeout_s=20)
        got = [s.theta().tolist() for s in c.sites]
        buf_got = c.sites[0].state.optimizers[0].state[c.sites[0].state.theta[0]]["momentum_buffer"].tolist()

    # By hand. Round r, site i: the local model is θ_r − inner_lr·(g1 + g2), so
    #   Δ_i = θ_r − local_i = inner_lr·(g1 + g2),   Δ_r = (Δ_0 + Δ_1) / 2.
    # torch.optim.SGD with momentum μ, dampening 0, nesterov=True, gradient Δ_r:
    #   first step: buf_1 = Δ_1;  later: buf_r = μ·buf_{r−1} + Δ_r
    #   update:     d_r = Δ_r + μ·buf_r;   θ_{r+1} = θ_r − lr·d_r
    theta = list(theta0)
    buf = None
    for r in range(2):
        delta = [sum(inner_lr * (grads[i][r][0][j] + grads[i][r][1][j]) for i in (0, 1)) / 2 for j in range(3)]
        buf = list(delta) if buf is None else [mu * buf[j] + delta[j] for j in range(3)]
        d = [delta[j] + mu * buf[j] for j in range(3)]
        theta = [theta[j] - lr * d[j] for j in range(3)]
    # Round 0: Δ = [0.275, 0.05, 0.1], θ1 = θ0 − 0.7·1.9·Δ = [0.634250, −2.066500, 0.367000]
    # Round 1: Δ = [0.025, 0.2, 0.15], buf = [0.2725, 0.245, 0.24], d = Δ + 0.9·buf = [0.27025, 0.4205, 0.366],
    #          θ2 = θ1 − 0.7·d = [0.445075, −2.360850, 0.110800]
    assert theta == pytest.approx([0.445075, -2.36085, 0.1108], abs=1e-12)
    for g in got:
        assert g == pytest.approx(theta, abs=1e-6)
    assert buf_got == pytest.approx(buf, abs=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models(dtype: torch.dtype) -> None:
    """bf16 and fp16 models: loss falls, θ stays fp32, the model keeps its dtype."""

    def model() -> torch.nn.Module:
        return torch.nn.Linear(6, 1).to(dtype)

    losses: dict[int, list[float]] = {0: [], 1: []}

    def step(site: Site, k: int) -> None:
        losses[site.index].append(train_step(site.model, site.optimizer, k, shift=site.index))

    cfg = ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=4, buckets=SMALL))
    lin = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    with InprocCluster(model, lin, cfg) as c:
        c.run_steps(step, 40, timeout_s=40)
        for s in c.sites:
            assert all(p.dtype == dtype for p in s.model.parameters())
            assert all(t.dtype == torch.float32 for t in s.state.theta)
            assert s.diloco.round == 10
            # the model is θ rounded to its dtype
            assert torch.equal(flat(s.model), s.theta().to(dtype).float())
        assert len(set(c.checksums())) == 1
    for i in (0, 1):
        first, last = sum(losses[i][:4]) / 4, sum(losses[i][-4:]) / 4
        assert last < 0.6 * first, (dtype, first, last)


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buffers", ["average", "local"])
def test_batchnorm_buffers_average_or_local(buffers: str) -> None:
    H = 3
    before_round: dict[int, dict[str, torch.Tensor]] = {}

    def step(site: Site, k: int) -> None:
        g = torch.Generator().manual_seed(100 * site.index + k)
        x = torch.randn(32, 4, generator=g) + (3.0 if site.index == 0 else -3.0)  # different statistics per site
        out = site.model(x)
        if k == H - 1:  # the forward of the last inner step updated the running stats; the round follows
            before_round[site.index] = {
                "mean": site.model.bn.running_mean.clone(),
                "var": site.model.bn.running_var.clone(),
            }
        out.pow(2).mean().backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    cfg = ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=H, buffers=buffers))
    with InprocCluster(BNNet, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), cfg) as c:
        c.run_steps(step, H, timeout_s=20)
        bn = [s.model.bn for s in c.sites]
        assert abs(float(before_round[0]["mean"].mean() - before_round[1]["mean"].mean())) > 0.1  # they did differ
        if buffers == "average":
            for key, attr in (("mean", "running_mean"), ("var", "running_var")):
                want = (before_round[0][key] + before_round[1][key]) / 2
                for m in bn:
                    assert torch.allclose(getattr(m, attr), want, atol=1e-6)
        else:
            for i, m in enumerate(bn):
                assert torch.equal(m.running_mean, before_round[i]["mean"])
                assert torch.equal(m.running_var, before_round[i]["var"])
            assert not torch.allclose(bn[0].running_mean, bn[1].running_mean)
        assert all(int(m.num_batches_tracked) == H for m in bn)  # integer buffers are never synchronised
        assert torch.equal(flat(c.sites[0].model), flat(c.sites[1].model))  # parameters averaged either way


def _snapshot(d: DiLoCo) -> dict:
    st = d.state
    return copy.deepcopy(
        {
            "theta": [t.detach() for t in st.theta],
            "momentum": [o.state_dict()["state"].get(0, {}).get("momentum_buffer") for o in st.optimizers],
            "residuals": list(st.residuals),
            "round": st.rounds_applied,
        }
    )


def _assert_state_equals(d: DiLoCo, snap: dict) -> None:
    now = _snapshot(d)
    assert now["round"] == snap["round"]
    for a, b in zip(now["theta"], snap["theta"]):
        assert torch.equal(a, b)
    for a, b in zip(now["momentum"], snap["momentum"]):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(now["residuals"], snap["residuals"]):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.timeout(60)
def test_state_dict_round_trip() -> None:
    """θ, outer momentum, residuals (int8 leaves quantisation error in them) and the round."""
    H = 3
    cfg = ClusterConfig(
        num_sites=2,
        diloco=fast_diloco_config(
            sync_every=H, buckets=SMALL, rounds=RoundConfig(codec=CodecConfig(name="int8", block_size=8))
        ),
    )
    with InprocCluster(mlp, inner_sgd, cfg) as c:
        c.run_steps(lambda s, k: train_step(s.model, s.optimizer, k, shift=s.index), 3 * H, timeout_s=30)
        d = c.sites[0].diloco
        sd = d.state_dict()
        snap = _snapshot(d)
        assert snap["round"] == 3
        # the top level says what it holds (README: θ, outer state, residuals, round)
        assert set(sd) == {
            "theta",
            "outer_optimizer",
            "residuals",
            "round",
            "bucket_round",
            "fingerprint",
            "inner_steps",
            "sync_every",
            "outer_schedulers",
        }
        assert sd["outer_schedulers"] == []  # no outer LR scheduler here
        assert sd["round"] == 3 and sd["inner_steps"] == 3 * H and sd["sync_every"] == H
        assert len(sd["theta"]) == len(sd["outer_optimizer"]) == len(sd["residuals"]) == len(d.layout)
        assert torch.equal(torch.cat(sd["theta"]), torch.cat(snap["theta"]))
        assert any(m is not None and m.abs().sum() > 0 for m in snap["momentum"])
        assert any(r is not None and r.abs().sum() > 0 for r in snap["residuals"])
        c.run_steps(lambda s, k: train_step(s.model, s.optimizer, k + 50, shift=s.index), 2 * H, timeout_s=30)
        assert d.round == 5
        assert not torch.equal(_snapshot(d)["theta"][0], snap["theta"][0])
        d.load_state_dict(sd)
        _assert_state_equals(d, snap)  # the saved dict was not changed by the two later rounds
        assert d.inner_steps == 3 * H

        # into a fresh single-site wrapper around the same architecture
        torch.manual_seed(99)
        m2 = mlp()
        d2 = DiLoCo(
            m2,
            inner_sgd(m2),
            config=DiLoCoConfig(site_id="fresh", sync_every=H, buckets=SMALL, rounds=cfg.diloco.rounds),
        )
        try:
            d2.load_state_dict(torch.load(_to_bytes(sd), weights_only=True))  # survives a save/load
            _assert_state_equals(d2, snap)
        finally:
            d2.close()

        # into a different model
        other = torch.nn.Linear(6, 2)
        d3 = DiLoCo(
            other,
            torch.optim.SGD(other.parameters(), lr=0.1),
            config=DiLoCoConfig(site_id="other", sync_every=H, buckets=SMALL),
        )
        try:
            with pytest.raises(ValueError, match="does not match this model"):
                d3.load_state_dict(sd)
            with pytest.raises(ValueError, match="not a DiLoCo state_dict .missing 'outer_optimizer', 'residuals'"):
                d3.load_state_dict({"theta": []})
            with pytest.raises(ValueError, match="not a DiLoCo state_dict"):
                d3.load_state_dict([sd])  # type: ignore[arg-type]
        finally:
            d3.close()


def _to_bytes(sd: dict):
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return buf


@pytest.mark.timeout(120)
def test_sites_step_int8_means_in_one_pass_and_end_on_the_theta_torch_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sites with int8 means and DiLoCo's outer SGD: each site's outer step decodes every
    bucket's mean in its own pass, a member's pulled means and an owner's own (Kernels.decode_sgd
    runs once per bucket, site and round), and the sites end on the same θ, bit for bit, as the
    same run with that pass off (the means decoded first, torch stepping)."""
    from dtrain import state
    from dtrain.codecs.native import Kernels, kernels

    if kernels() is None or state.sgd_width() is None:
        pytest.skip("no compiled kernels, or none giving torch's fused SGD bits here")
    calls = []
    real = Kernels.decode_sgd
    monkeypatch.setattr(Kernels, "decode_sgd", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    int8 = RoundConfig(codec=CodecConfig(name="int8"))
    cfg = ClusterConfig(
        num_sites=3, diloco=fast_diloco_config(buckets=BucketConfig(bucket_bytes=4096, chunk_bytes=512), rounds=int8)
    )

    num_buckets = []

    def run() -> tuple[str, ...]:
        with InprocCluster(mlp, inner_sgd, cfg) as c:
            c.run_steps(lambda s, k: train_step(s.model, s.optimizer, k, shift=s.index), 4 * 4, timeout_s=60)
            assert all(s.diloco.round == 4 for s in c.sites)
            sums = c.checksums()
            num_buckets.append(len(c.sites[0].diloco.layout))
        assert len(set(sums)) == 1
        return sums[0]

    fused = run()
    # every site, the bucket's owner too, steps every bucket in one pass each round
    assert len(calls) == 3 * 4 * num_buckets[0], (len(calls), num_buckets)
    monkeypatch.setattr(state, "sgd_width", lambda: None)  # the pass off: decoded first, torch steps
    calls.clear()
    assert run() == fused and not calls
