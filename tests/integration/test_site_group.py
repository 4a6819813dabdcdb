"""A site as a torch.distributed group (issue 14): 2 sites x 2 ranks on gloo, gRPC
between the ranks of different sites, one gRPC rendezvous in the test process.

Each rank is a subprocess with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); see tests/integration/sitegroup_rank.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtrain.rendezvous import RendezvousCore
from dtrain.rendezvous.grpc import serve_rendezvous
from dtrain.sim import fast_rendezvous_config
from tests.integration import sitegroup_rank as task

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _site_procs(
    site_index: int, num_ranks: int, rdv: str, out: Path, extra: list[str], stores: list
) -> list[subprocess.Popen]:
    # The site's store is held here, as torchrun's agent holds it (TORCHELASTIC_USE_AGENT_STORE:
    # every rank connects as a client): its port is bound before any rank starts. A port picked
    # free and bound later by rank 0 was once taken in between (EADDRINUSE in a CI dry run).
    store = dist.TCPStore("127.0.0.1", 0, num_ranks, is_master=True, wait_for_workers=False)
    stores.append(store)
    procs = []
    for rank in range(num_ranks):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(num_ranks))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), OMP_NUM_THREADS="1")
        env.update(TORCHELASTIC_USE_AGENT_STORE="True")
        cmd = [sys.executable, "-m", "tests.integration.sitegroup_rank", "--site-index", str(site_index)]
        cmd += ["--rendezvous", rdv, "--out", str(out), *extra]
        log = open(out / f"site-{site_index}-rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    return procs


def run_sites(
    tmp: Path,
    *,
    num_sites: int,
    num_ranks: int,
    extra: list[str],
    site_extra: dict[int, list[str]] | None = None,
    timeout_s: float = 90.0,
    stopped: frozenset[int] = frozenset(),
    **timing: float,
) -> dict:
    """Run ``num_sites`` site groups of ``num_ranks`` ranks; returns {(site, rank): (summary, params)}.
    The sites in ``stopped`` stop themselves mid-run: they are killed once the others ended."""
    kw = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0, reduce_timeout_s=3.0, broadcast_timeout_s=6.0)
    core = RendezvousCore(fast_rendezvous_config(num_sites, **{**kw, **timing}))
    server = serve_rendezvous(core)
    procs, parked, stores = [], [], []
    try:
        for i in range(num_sites):
            site = _site_procs(i, num_ranks, server.address, tmp, extra + (site_extra or {}).get(i, []), stores)
            (parked if i in stopped else procs).extend(site)
        for p in procs:
            p.wait(timeout=timeout_s)
        for p in parked:
            p.kill()
            p.wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop(0)
    logs = {f.name: f.read_text()[-3000:] for f in tmp.glob("*.log")}
    assert all(p.returncode == 0 for p in procs), f"a rank failed: {[p.returncode for p in procs]}\n{logs}"
    out = {}
    for i in sorted(set(range(num_sites)) - stopped):
        for r in range(num_ranks):
            stem = tmp / f"site-{i}-rank{r}"
            out[i, r] = (json.loads(Path(f"{stem}.json").read_text()), torch.load(f"{stem}.pt"))
    return out


def reference_run(*, steps: int, sync_every: int, lr: float) -> list[torch.Tensor]:
    """The same training as 2 sites x 1 rank, in process (plain DiLoCo, inproc transport)."""
    from dtrain.sim import ClusterConfig, InprocCluster, fast_diloco_config

    cluster = InprocCluster(
        task.make_model,
        lambda m: torch.optim.SGD(m.parameters(), lr=lr),
        ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=sync_every)),
    )

    def step(site, k):
        x, y = task.batch(site.index, k)
        torch.nn.functional.mse_loss(site.model(x), y).backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    with cluster:
        cluster.run_steps(step, num_steps=steps, timeout_s=60)
        return [task.full_params(s.model) for s in cluster.sites]


@pytest.mark.timeout(150)
def test_ddp_two_sites_two_ranks_match_each_other_and_one_rank_sites_theta_cpu_or_model(tmp_path):
    steps, h, lr = 20, 5, 0.05
    # site-1 keeps θ on the model's device (the CPU here): it must not change a bit
    res = run_sites(
        tmp_path,
        num_sites=2,
        num_ranks=2,
        extra=["--parallel", "ddp", "--steps", str(steps)],
        site_extra={1: ["--theta-device", "model"]},
    )
    for r in (0, 1):
        a, b = res[0, r][0]["rounds"], res[1, r][0]["rounds"]
        assert [o["status"] for o in a] == ["applied"] * (steps // h)
        # rank r's θ slice equals rank r's slice at the other site after every round
        assert [o["slice_checksum"] for o in a] == [o["slice_checksum"] for o in b]
    assert res[0, 0][0]["rounds"][-1]["site_checksum"] == res[1, 1][0]["rounds"][-1]["site_checksum"]
    # the two slices differ (each rank synced a different part) and cover the model
    assert res[0, 0][0]["memory"]["theta"] + res[0, 1][0]["memory"]["theta"] == res[0, 0][0]["model_numel"]
    # every DDP replica of every site ends with the same parameters (θ after the last round)
    for key in res:
        assert torch.equal(res[key][1], res[0, 0][1]), key
    ref = reference_run(steps=steps, sync_every=h, lr=lr)
    assert torch.equal(ref[0], ref[1])
    # fp32 tolerance: DDP sums two 4-row gradient means and halves them, a 1-rank site
    # averages 8 rows at once: the two differ by float rounding (~1e-7 relative per
    # inner step), carried through 20 SGD steps and 4 outer Nesterov steps.
    torch.testing.assert_close(res[0, 0][1], ref[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(res[0, 0][1], task.full_params(task.make_model()))  # it trained


def one_rank_diloco_numel(*, steps: int, sync_every: int) -> int:
    """θ + outer state + residual elements of a plain 1-process DiLoCo site after its rounds."""
    from dtrain.diloco import DiLoCo, DiLoCoConfig, diloco_numel

    model = task.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with DiLoCo(model, opt, config=DiLoCoConfig(sync_every=sync_every)) as d:
        for k in range(steps):
            x, y = task.batch(0, k)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return diloco_numel(d.state)["total"]


@pytest.mark.timeout(150)
def test_fsdp2_sites_shard_the_outer_state_and_a_rank_that_missed_the_plan_skips_the_whole_round(tmp_path):
    steps, h, skipped = 25, 5, 2
    res = run_sites(
        tmp_path,
        num_sites=2,
        num_ranks=2,
        extra=["--parallel", "fsdp", "--steps", str(steps), "--lr", "0.1"],
        site_extra={1: ["--skip-view-round", str(skipped)]},
    )
    statuses = {key: [o["status"] for o in s["rounds"]] for key, (s, _) in res.items()}
    assert statuses[0, 0] == statuses[0, 1] == ["applied"] * (steps // h)
    # half-round rule: rank 1 of site-1 missed round 2's plan, so neither rank of site-1 ran it
    expect = ["applied"] * (steps // h)
    expect[skipped] = "skipped"
    assert statuses[1, 0] == statuses[1, 1] == expect, res[1, 0][0]["rounds"][skipped]["reason"]
    assert "rank 1 holds decision 'wait'" in res[1, 0][0]["rounds"][skipped]["reason"]
    for r in (0, 1):  # ... and resynchronised: every slice equals site-0's after every round
        assert [o["slice_checksum"] for o in res[0, r][0]["rounds"]] == [
            o["slice_checksum"] for o in res[1, r][0]["rounds"]
        ]
    assert len({s["rounds"][-1]["site_checksum"] for s, _ in res.values()}) == 1
    for key in res:
        assert torch.equal(res[key][1], res[0, 0][1]), key  # full parameters equal everywhere
    s00 = res[0, 0][0]
    assert s00["eval_after"] < 0.7 * s00["eval_before"], (s00["eval_before"], s00["eval_after"])  # held-out loss fell
    # memory: θ + outer momentum + residual elements per rank, against a 1-rank site
    one = one_rank_diloco_numel(steps=h, sync_every=h)
    per_rank = [res[0, r][0]["memory_after"]["total"] for r in (0, 1)]
    assert one == 3 * res[0, 0][0]["model_numel"]
    assert sum(per_rank) == one
    assert max(per_rank) <= 0.6 * one, (per_rank, one)  # uneven FSDP shards: 177 and 144 of 321 elements


@pytest.mark.timeout(240)
def test_a_dead_site_reaches_every_rank_through_the_site_store(tmp_path):
    """Site-1's ranks stop (SIGSTOP) before pushing round 1: only site-0's rank 0
    heartbeats, so without a notice its rank 1 would wait for site-1's contributions
    to its buckets until the reduce deadline. Rank 0's lost notice (the site's
    TCPStore) makes rank 1 stop waiting: its round lists site-1 as lost, and both ranks
    give up their pushes to and pulls from site-1 then, not at the deadlines."""
    steps, h, stop = 15, 5, 1
    res = run_sites(
        tmp_path,
        num_sites=2,
        num_ranks=2,
        extra=["--parallel", "ddp", "--steps", str(steps)],
        site_extra={1: ["--stop-at-round", str(stop)]},
        stopped=frozenset({1}),
        timeout_s=200.0,
        heartbeat_timeout_s=3.0,  # well above a loaded machine's heartbeat gaps, well below the reduce deadline
        reduce_timeout_s=10.0,
        broadcast_timeout_s=11.0,
    )
    r0, r1 = res[0, 0][0]["rounds"], res[0, 1][0]["rounds"]
    assert [o["status"] for o in r1] == ["applied"] * (steps // h)
    assert r1[stop]["lost_members"] == ["site-1"], r1[stop]
    assert r1[stop]["lost_notices_used"] >= 1  # the notice, not the deadline, ended the wait
    assert r1[0]["lost_notices_used"] == 0
    assert r0[stop]["lost_members"] == ["site-1"]  # rank 0 learnt it from its heartbeats
    assert r0[stop]["lost_notices_used"] == 0
    # the stopped site's kernel still accepts calls: each rank gave up its push to site-1 when it
    # learnt site-1 was lost, instead of waiting out the 10 s reduce deadline (and its pulls, had
    # they started, the 11 s broadcast one)
    for r in (r0, r1):
        assert r[stop]["calls_given_up"] >= 1 and r[stop]["means_s"] < 10.0, r[stop]
    assert r0[-1]["site_checksum"] == r1[-1]["site_checksum"]


@pytest.mark.timeout(480)
def test_site_groups_resume_from_dcp_checkpoints_exactly_where_they_left_off(tmp_path):
    """2 sites x 2 ranks (DDP) checkpoint after every round (DCP: each rank its slice of
    θ, outer state and residuals, and the model); both stop after round 0, resume with a
    fresh rendezvous and run rounds 1-2: every rank loads its own slice, the sites
    rejoin with equal checksums, and the end is bit-identical to an uninterrupted run."""
    h, first, total = 5, 5, 15
    base = ["--parallel", "ddp", "--lr", "0.1"]
    ckpt = {i: ["--ckpt-dir", str(tmp_path / "ckpt" / f"site-{i}")] for i in (0, 1)}
    runs = {}
    for name, steps, resume in (("a", first, []), ("b", total, ["--resume"]), ("whole", total, None)):
        (tmp_path / name).mkdir()
        extra = {i: ckpt[i] + resume for i in (0, 1)} if resume is not None else None
        runs[name] = run_sites(
            tmp_path / name,
            num_sites=2,
            num_ranks=2,
            extra=[*base, "--steps", str(steps)],
            site_extra=extra,
            timeout_s=150.0,
        )
    saved = sorted(p.name for p in (tmp_path / "ckpt" / "site-0").iterdir())
    assert saved == ["sg-000002", "sg-000003"], saved  # the newest two, none left half-written
    whole = {key: s["rounds"] for key, (s, _) in runs["whole"].items()}
    for key, (s, params) in runs["b"].items():
        assert s["resumed_from"] == first // h, key
        assert [o["round"] for o in s["rounds"]] == [2, 3] and {o["status"] for o in s["rounds"]} == {"applied"}
        # the rank's own slice after every resumed round equals the uninterrupted run's
        assert [o["slice_checksum"] for o in s["rounds"]] == [o["slice_checksum"] for o in whole[key][1:]], key
        assert torch.equal(params, runs["whole"][key][1]), key
    assert len({s["rounds"][0]["site_checksum"] for s, _ in runs["b"].values()}) == 1


@pytest.mark.timeout(150)
def test_fragment_rounds_sync_the_same_fragment_of_each_ranks_slice_at_every_site(tmp_path):
    steps, h, f = 12, 4, 2  # a fragment round every h/f = 2 steps: 6 rounds
    res = run_sites(
        tmp_path,
        num_sites=2,
        num_ranks=2,
        extra=["--parallel", "ddp", "--steps", str(steps), "--sync-every", str(h), "--num-fragments", str(f)],
    )
    for rank in range(2):
        a, b = res[0, rank][0]["rounds"], res[1, rank][0]["rounds"]
        assert len(a) == len(b) == steps * f // h
        for ra, rb in zip(a, b):
            assert ra["status"] == rb["status"] == "applied", (ra, rb)
            assert ra["num_buckets"] >= f
            # round r (recorded after it: "round" = r + 1) syncs fragment (r + 1) mod F, named in the outcome
            assert ra["fragment"] == rb["fragment"] == ra["result_fragment"] == ra["round"] % f
            assert ra["slice_checksum"] == rb["slice_checksum"]  # rank j's slice θ equals rank j's elsewhere
    assert {r["fragment"] for r in res[0, 0][0]["rounds"]} == {0, 1}
    # replicas inside a site agree; across sites the fragment not synced last keeps its local steps
    assert torch.equal(res[0, 0][1], res[0, 1][1]) and torch.equal(res[1, 0][1], res[1, 1][1])
    assert not torch.allclose(res[0, 0][1], res[1, 0][1])
    for site in range(2):
        s = res[site, 0][0]
        assert s["eval_after"] < s["eval_before"]
