"""``DiLoCoConfig.theta_device`` (issue 14): θ, the outer-optimizer state and the
residuals on the model's device. On a CPU model "model" must equal "cpu" bit for
bit; on a CUDA machine the state must sit on the GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from dtrain.codecs import CodecConfig
from dtrain.configs import DiLoCoConfig, RoundConfig
from dtrain.diloco import DiLoCo
from dtrain.state import theta_device_of

pytestmark = pytest.mark.timeout(60)


def _train(theta_device: str, device: str = "cpu", steps: int = 12) -> DiLoCo:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = DiLoCoConfig(
        sync_every=4, theta_device=theta_device, rounds=RoundConfig(codec=CodecConfig(name="int8", block_size=16))
    )
    d = DiLoCo(model, opt, config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g).to(device)
        torch.nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        opt.step()
        opt.zero_grad()
    return d


def test_theta_on_the_model_device_equals_theta_on_the_cpu_for_a_cpu_model():
    a, b = _train("cpu"), _train("model")
    try:
        assert a.round == b.round == 3
        for ta, tb in zip(a.state.theta, b.state.theta):
            assert torch.equal(ta, tb)
        assert a.state.checksums() == b.state.checksums()
        # int8 is lossy: the residuals carry what it lost, equal too
        assert any(r is not None and bool(r.abs().sum() > 0) for r in a.state.residuals)
        for ra, rb in zip(a.state.residuals, b.state.residuals):
            assert (ra is None and rb is None) or torch.equal(ra, rb)
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(pa, pb)
    finally:
        a.close(wait=False)
        b.close(wait=False)


def test_theta_device_is_validated():
    with pytest.raises(ValueError, match="theta_device must be one of"):
        DiLoCoConfig(theta_device="gpu")
    with pytest.raises(ValueError, match="theta_device must be 'cpu' or 'model'"):
        theta_device_of([torch.zeros(1)], "gpu")
    assert theta_device_of([torch.zeros(1)], "model") == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_theta_outer_state_and_residuals_sit_on_the_gpu():
    d = _train("model", device="cuda")
    try:
        assert d.round == 3
        assert all(t.is_cuda for t in d.state.theta)
        moments = [v for o in d.state.optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
        assert moments and all(v.is_cuda for v in moments)
        assert all(r.is_cuda for r in d.state.residuals if r is not None)
    finally:
        d.close(wait=False)
