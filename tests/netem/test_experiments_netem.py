"""The netem experiments in their smallest mode (``python -m experiments run NAME --mode smoke``),
so they do not rot.

``wan_sweep`` and ``netem_loss`` start real worker and rendezvous processes in
emulated sites. What is checked: one CSV row per setting and seed with the documented
columns and values that follow from the setting (bytes, the physical limit, a delay that
shows in the exchange time), the plot, and the RESULTS.md section with its command.
The measurements themselves are not tested here.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

from experiments import lab
from experiments.common import read_rows
from tests.integration.test_experiments_smoke import RUN_COLUMNS  # the one list of per-run CSV columns

pytestmark = pytest.mark.netem


def _spec(name: str, tmp_path: Path, sets: dict) -> str:
    """``python -m experiments run NAME --mode smoke --set PATH=VALUE ...`` into ``tmp_path``."""
    results = tmp_path / "RESULTS.md"
    lab.run(lab.load_spec(name), "smoke", out=tmp_path, results=str(results), overrides=sets, command=name)
    return results.read_text()


@pytest.mark.timeout(180)
def test_wan_sweep_smoke(tmp_path: Path) -> None:
    md = _spec("wan_sweep", tmp_path, {})
    rows = read_rows(tmp_path / "wan_sweep_smoke.csv")
    # smoke: 2 sites, 50 Mbit/s, one-way delay 0 and 25 ms, no loss; 1 warm-up + 1 measured round each
    assert [(r["rate_mbit"], r["delay_ms"], r["loss_pct"]) for r in rows] == [(50.0, 0.0, 0.0), (50.0, 25.0, 0.0)]
    for r in rows:
        assert RUN_COLUMNS <= set(r), RUN_COLUMNS - set(r)
        assert r["experiment"] == "wan_sweep" and r["rounds_measured"] == 1 and r["rounds_done"] == 4
        assert r["final_val_loss"] < r["first_val_loss"]
        # tiny GPT, int8: one byte per parameter (0.12 M) plus headers and scales
        assert 100_000 < r["encoded_bytes_per_site"] < 160_000
        expect = 2 * r["encoded_bytes_per_site"] * 8 / 50e6 + 4 * r["delay_ms"] / 1000
        assert r["limit_s"] == pytest.approx(expect, rel=1e-4)  # the CSV keeps 6 digits
        assert r["ratio"] == pytest.approx(r["engine_s"] / r["limit_s"], rel=1e-4)
        assert 0 < r["compute_util"] < 1 and r["stale_buckets"] == 0 and r["rejected"] == 0
    # 25 ms one way: a round's exchange needs at least one round trip (50 ms) between two sites
    assert rows[1]["engine_s"] >= 0.05
    rounds = read_rows(tmp_path / "wan_sweep_smoke_rounds.csv")
    assert len(rounds) == 8 and sum(1 for x in rounds if x["measured"] is True) == 4
    assert (tmp_path / "wan_sweep_smoke.png").stat().st_size > 5000
    assert "## WAN sweep through netem (smoke)" in md
    assert "Commit `" in md and "command `wan_sweep`" in md  # the stamp
    assert "| 50 | 25 | 0 | 1 |" in md


@pytest.mark.timeout(180)
def test_netem_loss_smoke(tmp_path: Path) -> None:
    md = _spec("netem_loss", tmp_path, {})
    rows = read_rows(tmp_path / "netem_loss_smoke.csv")
    assert [(r["config"], r["loss_pct"]) for r in rows] == [("loss 0%", 0.0), ("loss 10%", 10.0)]
    for r in rows:
        assert RUN_COLUMNS <= set(r), RUN_COLUMNS - set(r)
        assert r["rounds_done"] == 3 and r["consistent"] is True
        assert math.isfinite(r["final_val_loss"]) and r["final_val_loss"] < r["first_val_loss"]
        # fp32 over 2 sites: each site pushes about half of its 0.12 M x 4 bytes and serves the other half
        assert r["bytes_per_round_site"] > 200_000
    assert rows[0]["reduce_arrived"] == 1.0 and rows[0]["stale_buckets"] == 0
    assert (tmp_path / "netem_loss_smoke.png").stat().st_size > 5000
    assert "## Packet loss over gRPC through netem (smoke)" in md
    assert "Commit `" in md and "command `netem_loss`" in md  # the stamp


@pytest.mark.timeout(240)
def test_datagram_vs_grpc_smoke(tmp_path: Path) -> None:
    md = _spec("datagram_vs_grpc", tmp_path, {})
    rows = read_rows(tmp_path / "datagram_vs_grpc_smoke.csv")
    # smoke: 2 sites, 100 Mbit/s, 5 ms one way, loss 0 and 5 %; three data paths, one run each
    paths = [p[0] for p in importlib.import_module("experiments.datagram_vs_grpc").PATHS]
    assert len(paths) == 3 and "datagram" in paths
    for path in paths:
        assert sorted(r["loss_pct"] for r in rows if r["path"] == path) == [0.0, 5.0]
    for r in rows:
        assert RUN_COLUMNS <= set(r), RUN_COLUMNS - set(r)
        assert r["rounds_done"] == 4 and r["rounds_measured"] == 1
        assert r["drift_rounds"] == 0 and r["stale_buckets"] == 0  # replicas equal on every path
        assert r["warmup_drift_rounds"] == 0  # the warm-up round too
        assert 100_000 < r["encoded_bytes_per_site"] < 160_000  # tiny GPT, int8
        expect = 2 * r["encoded_bytes_per_site"] * 8 / 100e6 + 4 * 5.0 / 1000
        assert r["limit_s"] == pytest.approx(expect, rel=1e-4)
        if r["path"] == "datagram":  # headers, tags, control datagrams: more on the wire than the payload
            assert r["wire_bytes_per_round_site"] > 0
            assert r["delivered"] <= 1.0
        else:
            assert r["delivered"] == 1.0  # TCP retransmits: everything arrives
        # CPU: the sites' syncs cost some, their kernel part is a part, the machine was partly busy
        assert 0 < r["sites_sync_cpu_s"] <= r["sites_cycle_cpu_s"], r
        assert 0 <= r["sites_sync_system_cpu_s"] <= r["sites_sync_cpu_s"], r
        assert 0 < r["machine_busy_fraction"] <= 1 and r["machine_busy_s_per_round"] > 0, r
    assert (tmp_path / "datagram_vs_grpc_smoke.png").stat().st_size > 5000
    assert "CPU: the machine's" in md and "cannot take less than" in md
    assert "## Datagram path vs gRPC through netem (smoke)" in md
    assert "Commit `" in md and "command `datagram_vs_grpc`" in md  # the stamp


@pytest.mark.timeout(180)
def test_datagram_val_loss_netem_smoke(tmp_path: Path) -> None:
    sets = {"netem.enabled": True, "task_spec.num_sites": 2, "diloco.sync_every": 2}
    md = _spec("datagram_val_loss", tmp_path, sets)
    rows = read_rows(next(tmp_path.glob("datagram_val_loss_netem-enabled=True*_smoke.csv")))
    # smoke: 2 worker processes through netem, one seed at 0% and at 10% packet loss, 3 rounds
    assert [(r["seed"], r["loss"], r["loss_pct"]) for r in rows] == [(0, 0.0, 0.0), (0, 0.1, 10.0)]
    clean, lossy = rows
    # no emulated loss: all but what a loaded host's full socket buffer might drop; 10%: an owner's own half
    # arrives, the other site's loses 10% of its datagrams: 0.95-0.96 (netem dropped whole 40-datagram
    # UDP_SEGMENT writes until 843f2d8, and one CI run lost none: 1.000)
    assert clean["reduce_arrived"] >= 0.98 and 0.8 < lossy["reduce_arrived"] < 0.99
    for r in rows:
        assert r["data_path"] == "datagram" and r["codec"] == "int8"
        assert r["consistent"] is True and r["stale_buckets"] == 0 and r["rounds_done"] == 3
        assert r["final_val_loss"] < r["first_val_loss"] - 0.5  # both trained (tiny, 6 steps: 5.4 -> ~4.0)
    assert abs(lossy["final_val_loss"] / clean["final_val_loss"] - 1) < 0.03
    assert "## Datagram path: validation loss at 10% loss (smoke, netem.enabled True" in md
    assert "in netem namespaces" in md


@pytest.mark.timeout(180)
def test_streaming_smoke(tmp_path: Path) -> None:
    md = _spec("streaming", tmp_path, {})
    rows = read_rows(tmp_path / "streaming_smoke.csv")
    # smoke: 2 sites, tiny, H = 8, 2 x H inner steps: blocking, F = 1 τ = H, F = 4 τ = H/4 (paced)
    assert [(r["config"], r["num_fragments"], r["overlap_steps"], r["pace_fraction"]) for r in rows] == [
        ("blocking", 1, 0, 0.0),
        ("F=1 overlap", 1, 8, 0.8),
        ("F=4 overlap", 4, 2, 0.8),
    ]
    assert [r["rounds_done"] for r in rows] == [2, 2, 8]  # fragment rounds count as rounds
    for r in rows:
        assert 0 < r["compute_util"] <= 1 and math.isfinite(r["final_val_loss"]) and r["peak_Bps"] > 0
        assert r["inner_steps"] == 16  # every configuration ends at the same inner step
    # a fragment round sends about a quarter of a whole round's bytes
    assert rows[2]["bytes_per_round"] < 0.5 * rows[0]["bytes_per_round"]
    rounds = read_rows(tmp_path / "streaming_smoke_rounds.csv")
    assert {x["fragment"] for x in rounds if x["config"] == "F=4 overlap"} == {0, 1, 2, 3}
    assert (tmp_path / "streaming_smoke.png").stat().st_size > 5000
    assert "## Streaming rounds through netem (smoke)" in md
    assert "Commit `" in md and "command `streaming`" in md  # the stamp


@pytest.mark.timeout(180)
def test_netem_udp_ceiling_smoke(tmp_path: Path) -> None:
    md = _spec("netem_udp_ceiling", tmp_path, {})
    rows = read_rows(tmp_path / "netem_udp_ceiling_smoke.csv")
    # smoke: 2 sites, one flow, 2,000 and 8,000 datagrams/s offered, on each of the three links
    assert [(r["setting"], r["flows"], r["offered_dps"]) for r in rows] == [
        (s, 1, o) for s in ("no delay", "delay", "delay + cap") for o in (2000.0, 8000.0)
    ]
    for r in rows:
        assert 0.0 <= r["loss"] < 1.0 and r["delivered_dps"] > 0
        assert r["delivered_mbit"] == pytest.approx(r["delivered_dps"] * 1400 * 8 / 1e6, rel=1e-3)
        assert r["achieved_send_dps"] > 0.5 * r["offered_dps"]  # the sender kept roughly to its pace
    assert [r["delay_ms"] for r in rows] == [0.0, 0.0, 5.0, 5.0, 5.0, 5.0]
    assert "## netem's own UDP ceiling (smoke)" in md and "Ceilings (highest delivered" in md


@pytest.mark.timeout(240)  # 3 runs of 2 sites x 4 rounds: ~15-30 s each
def test_convergence_netem_pairs_smoke(tmp_path: Path) -> None:
    """``run convergence --set convergence.side=netem:0:1``: the fault table's setup over gRPC through
    netem at 0%, 10% and 0% again per seed; the table pairs by seed and the claim names the 0% repeat's floor."""
    from experiments import convergence as c
    from experiments import convergence_netem as cn
    from experiments.convergence_report import verdict

    lab.run(
        lab.load_spec("convergence"), "smoke", out=tmp_path, results="none", overrides={"convergence.side": "netem:0:1"}
    )
    csv = tmp_path / "convergence_convergence-side=netem-0-1_smoke.csv"
    rows = read_rows(csv)
    assert [(r["method"], r["loss_pct"], r["seed"]) for r in rows] == [
        (cn.BASE, 0.0, 0),
        (cn.LOSSY, 10.0, 0),
        (cn.REPEAT, 0.0, 0),
    ]
    for r in rows:
        assert r["section"] == cn.NETEM and r["config"] == f"{cn.NETEM} | iid | {r['method']}"
        assert r["rounds_done"] == 4 and r["consistent"] is True  # smoke: 8 steps at H = 2
        assert r["final_val_loss"] < r["first_val_loss"]
        assert r["rejected"] == 0  # 30 s deadlines: nothing is refused for lateness
    assert rows[0]["reduce_arrived"] == 1.0 and rows[2]["reduce_arrived"] == 1.0
    md, facts = cn.table(rows)
    assert f"| {cn.LOSSY} | 1 |" in md and f"| {cn.REPEAT} | 1 |" in md
    assert facts[cn.LOSSY][2] == 1 and facts[cn.REPEAT][2] == 1
    # owners sum in sender-id order: with every chunk in, a rerun ends with the very same θ
    assert rows[0]["checksum"] and rows[2]["checksum"] == rows[0]["checksum"]
    assert f"| {cn.REPEAT} | 1 |" in md and md.count("| 1 of 1 |") >= 1
    text = cn.claim(facts, verdict)
    assert "10% packet loss over gRPC through netem ≤ 0.5%" in text and "the 0% repeat" in text
    # a --replot of the smoke mode merges this CSV with the other side runs
    assert csv in c.side_files(tmp_path / "convergence_smoke")


@pytest.mark.timeout(180)
def test_reliability_smoke(tmp_path: Path) -> None:
    """One 3-site launch through the lossy profile with no time setting: the row has its
    figures, the run ended with one θ, and the section names the targets."""
    text = _spec("reliability", tmp_path, {})
    rows = read_rows(tmp_path / "reliability_smoke.csv")
    assert [r["profile"] for r in rows] == ["lossy"]
    r = rows[0]
    assert r["sites_seen"] == 3 and r["exit_code"] == 0 and str(r["equal_at_end"]) == "True", r
    assert r["unequal_rounds"] == 0 and r["declared_dead"] == 0, r
    assert "| lossy | 1 | 1 | 0 | 0 |" in text and "no user-set timeout" in text


@pytest.mark.timeout(120)
def test_datagram_tcp_share_smoke(tmp_path: Path) -> None:
    """One TCP flow (bbr) beside a 95 Mbit/s datagram flow on 100 Mbit/s links: a row with goodputs
    a 100 Mbit/s link can carry, and the section's table."""
    text = _spec("datagram_tcp_share", tmp_path, {})
    rows = read_rows(tmp_path / "datagram_tcp_share_smoke.csv")
    assert [(r["cc"], r["udp_mbit"]) for r in rows] == [("bbr", 95.0)]
    r = rows[0]
    assert 0 < r["tcp_before"] <= 110 and 0 <= r["tcp_during"] <= 110 and 0 < r["udp_delivered_mbit"] <= 110, r
    assert "| TCP cc | datagrams Mbit/s |" in text and "| bbr | 95 |" in text
