"""The README's library example, run as written (apart from the model and the data) by
two sites over gRPC on 127.0.0.1, ends with the same θ at both (issue 19; issue 13
item 2: ``close()`` right after the loop must not cut a slower peer off the last means).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.grpc import serve_rendezvous

README = Path(__file__).resolve().parents[2] / "README.md"
NUM_SITES = 2
ROUNDS = 2  # the example's sync_every=500: 1000 batches per site make two rounds

pytestmark = pytest.mark.timeout(120)


def readme_example() -> str:
    """The python block of README's "The library in ten lines"."""
    section = README.read_text().split("## The library in ten lines", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "README's library section must hold one python block"
    code = blocks[0]
    for needed in ('GrpcRendezvousClient("rdv.example:29400")', 'site_id="dc-east"', "diloco.close()"):
        assert needed in code, f"the README example changed: {needed!r} not found; update this test"
    return code


class MyModel(torch.nn.Module):
    """The example's model: a small classifier, initialised alike at every site."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        # 71k parameters (285 KB): four 71 KB buckets, so that both sites own some
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 256),
            torch.nn.Tanh(),
            torch.nn.Linear(256, 256),
            torch.nn.Tanh(),
            torch.nn.Linear(256, 4),
        )
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def site_batches(site: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The example's data: a linearly separable 4-class problem, another sample per site."""
    g = torch.Generator().manual_seed(100 + site)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(num_batches):
        x = torch.randn(8, 16, generator=g)
        out.append((x, (x @ w).argmax(dim=1)))
    return out


def run_sites(code: str, rendezvous_address: str) -> list[dict]:
    """Run ``code`` once per site in its own thread; returns each site's namespace."""
    code = code.replace("rdv.example:29400", rendezvous_address)
    spaces = [
        {"MyModel": MyModel, "batches": site_batches(i, 500 * ROUNDS), "__name__": f"site{i}"} for i in range(NUM_SITES)
    ]
    errors: list[BaseException] = []

    def site(i: int) -> None:
        try:
            exec(
                compile(code.replace('site_id="dc-east"', f'site_id="dc-{i}"'), f"README[site {i}]", "exec"), spaces[i]
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=site, args=(i,), name=f"readme-site-{i}") for i in range(NUM_SITES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads), "a site did not finish the README example in 100 s"
    assert not errors, errors
    return spaces


def test_readme_example_two_sites_over_grpc_end_with_the_same_theta() -> None:
    torch.set_num_threads(1)
    code = readme_example()
    server = serve_rendezvous(RendezvousCore(RendezvousConfig(min_sites=NUM_SITES, initial_sites=NUM_SITES)))
    try:
        spaces = run_sites(code, server.address)
    finally:
        server.stop(0)
    dl = [ns["diloco"] for ns in spaces]
    for d in dl:
        assert d.round == ROUNDS and d.inner_steps == 500 * ROUNDS
        assert d.last_outcome is not None and d.last_outcome.status == "applied"
        res = d.last_outcome.result
        assert res is not None and res.members == ("dc-0", "dc-1")
        assert res.owned_buckets >= 1  # both sites own part of θ (balanced ownership)
    sums = [d.state.checksums() for d in dl]
    assert sums[0] == sums[1], f"θ differs between the sites after close(): {sums}"
    # the models were reset to that θ, and training did something
    p0, p1 = (torch.cat([p.detach().reshape(-1) for p in ns["model"].parameters()]) for ns in spaces)
    assert torch.equal(p0, p1)
    assert not torch.equal(p0, torch.cat([p.detach().reshape(-1) for p in MyModel().parameters()]))
