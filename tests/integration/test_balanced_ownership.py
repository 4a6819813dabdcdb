"""Balanced ownership on the default model (issue 19): at 3 sites every site owns buckets
and sends and receives about the same bytes (before: one 4 MiB bucket, site-0 owned
everything and moved twice the bytes of the others)."""

from __future__ import annotations

import pytest
import torch

from dtrain.app.config import WorkerConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config
from dtrain.tasks import load_task
from dtrain.tasks.builtin import lm_loss
from dtrain.tasks.spec import TaskSpec

pytestmark = pytest.mark.timeout(120)

NUM_SITES = 3
ROUNDS = 2


def default_model() -> torch.nn.Module:
    """The built-in task's model at the default size (``TaskSpec().size``: small, 0.44 M parameters)."""
    cfg = _worker()
    return load_task(cfg.task)(cfg.task_spec).model


def _worker() -> WorkerConfig:
    return WorkerConfig(task_spec=TaskSpec(num_sites=NUM_SITES))


def test_three_sites_on_the_default_model_own_buckets_alike_and_move_bytes_alike() -> None:
    torch.set_num_threads(1)
    # The bucket and codec settings a default `dtrain launch --sites 3` gives each worker.
    dcfg = _worker().diloco_config()
    cfg = ClusterConfig(
        num_sites=NUM_SITES, diloco=fast_diloco_config(sync_every=1, buckets=dcfg.buckets, rounds=dcfg.rounds)
    )

    def step(site: Site, k: int) -> None:
        g = torch.Generator().manual_seed(1000 * site.index + k)
        x = torch.randint(0, 256, (2, 16), generator=g)
        lm_loss(site.model, (x[:, :-1], x[:, 1:])).backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    with InprocCluster(default_model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), cfg) as c:
        layout = c.sites[0].diloco.layout
        assert layout.total_numel == 437_760 and len(layout) == 12  # 1.75 MB: 12 buckets of 146 KB
        c.run_steps(step, ROUNDS, timeout_s=90)
        results = {s.site_id: [o.result for o in s.outcomes] for s in c.sites}
        checksums = {s.site_id: s.diloco.state.checksums() for s in c.sites}
    assert all(len(rs) == ROUNDS and all(r is not None for r in rs) for rs in results.values()), results
    owned = {s: [r.owned_buckets for r in rs] for s, rs in results.items()}
    assert owned == {s: [4] * ROUNDS for s in results}, owned  # every site owns a third of θ
    sent = {s: sum(r.bytes_sent for r in rs) for s, rs in results.items()}
    received = {s: sum(r.bytes_received for r in rs) for s, rs in results.items()}
    for name, b in (("sent", sent), ("received", received)):
        assert min(b.values()) > 0 and max(b.values()) <= 1.5 * min(b.values()), f"bytes {name} per site: {b}"
    assert len({tuple(v) for v in checksums.values()}) == 1  # and θ agrees
    for rs in results.values():
        assert all(r.applied_buckets == 12 and r.stale_buckets == 0 for r in rs)
