"""How the datagram path recovers lost mean datagrams, measured on 127.0.0.1 (prints a table).

Three round engines over :class:`~dtrain.transports.datagram.DatagramTransport` on loopback,
int8, one chunk per datagram; every received data datagram is dropped with probability p
(``test_drop``). Per loss rate, one round per seed: the chosen rule (bounded NACK re-requests of
the missing mean chunks, then a gRPC pull): NACK rounds and re-sent chunks per site, buckets
that needed the gRPC pull, exchange time (max ``total_s`` over sites), wire over payload bytes,
and whether every replica ended with the same θ. Computed for comparison from the same p: XOR
parity over groups of k datagrams (``fec k=8``: 1/k more bytes; a chunk stays lost when two of
its group's k+1 datagrams are) and keep-the-previous-value (a fraction p of each mean's elements
not applied until a repair moves θ_b whole).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import torch

from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.codecs import CodecConfig
from dtrain.protocol import Member, RoundPlan
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.state import GlobalState
from dtrain.transports.datagram import datagram_chunk_bytes
from experiments.common import RunResult, md_rows, summarize
from experiments.lab import Point, Spec, files
from experiments.runspec import RunSpec

LOSS, NUMEL = "lab.loss", "lab.numel"
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(seeds=[0], fixed={NUMEL: 40_000}, grid={LOSS: [0.0, 0.3]}),
    "quick": dict(seeds=[0], grid={LOSS: [0.0, 0.1, 0.3]}),
    "full": dict(seeds=[0, 1, 2], grid={LOSS: [0.0, 0.01, 0.05, 0.1, 0.2, 0.3]}),
}


def one_round(loss: float, seed: int, numel: int) -> dict:
    torch.manual_seed(seed)
    chunk = datagram_chunk_bytes("int8")
    layout = BucketLayout([numel], ["param"], BucketConfig(bucket_bytes=4 * (numel // 4), chunk_bytes=chunk))
    # the plan's 10 s broadcast deadline: the transport's 1 s fallback reserve
    net = RunSpec(experiment="", config="", seed=seed, datagram_drop=loss, broadcast_timeout_s=10.0)
    config = RoundConfig(codec=CodecConfig(name="int8"))
    engines = [
        RoundEngine(f"site-{i}", GlobalState(layout, [torch.zeros(numel)]), net.datagram_transport(i), config)
        for i in range(3)
    ]
    members = tuple(Member(site_id=e.site_id, address=e.start()) for e in engines)
    plan = RoundPlan(
        round=0, members=members, reduce_timeout_s=5.0, broadcast_timeout_s=10.0, datagram_key=os.urandom(32)
    )
    try:
        for e in engines:
            e.add_pseudo_gradient([torch.randn(numel)])
        futs = [e.start_round(plan) for e in engines]
        res = [f.result(timeout=60) for f in futs]
        counters = [e.transport.counters() for e in engines]
        same = len({tuple(e.state.checksum(b) for b in range(len(layout))) for e in engines}) == 1
    finally:
        for e in engines:
            e.stop(0)
    payload = sum(c["sent"] for c in counters)
    return {
        "time_s": max(r.total_s for r in res),
        "nacks": statistics.fmean(c["nacks_sent"] for c in counters),
        "resent": sum(c["resent"] for c in counters),
        "fallbacks": sum(c["fallback_pulls"] for c in counters),
        "wire_over_payload": sum(c["wire_sent"] for c in counters) / payload if payload else float("nan"),
        "equal": same,
        "chunks": sum(len(b.chunks) for b in layout.buckets),
        "buckets": len(layout),
    }


def fec_lost(p: float, k: int) -> float:
    """Fraction of chunks still lost with one XOR parity per k datagrams (two losses in a group of k + 1)."""
    # a data chunk is unrecoverable when it is lost and at least one of the k other datagrams is lost too
    return p * (1 - (1 - p) ** k)


def measure(point: Point) -> RunResult:
    """One round at the point's loss rate (4 buckets of ``lab.numel`` int8 parameters)."""
    torch.set_num_threads(1)
    return RunResult(row=point.row(**one_round(point.settings[LOSS], point.seed, point.settings[NUMEL])))


def _cells(rs: list[dict[str, Any]]) -> dict[str, str]:
    """One loss rate over its seeds, by column; the FEC and keep-previous columns computed from p."""
    p = rs[0][LOSS]
    return {
        "loss": f"{p:.0%}",
        "time s": f"{statistics.fmean(r['time_s'] for r in rs):.2f}",
        "NACK rounds/site": f"{statistics.fmean(r['nacks'] for r in rs):.1f}",
        "re-sent chunks": f"{statistics.fmean(r['resent'] for r in rs):.0f} of {rs[0]['chunks'] * 2}",
        "gRPC pulls": f"{sum(r['fallbacks'] for r in rs)} of {rs[0]['buckets'] * 2 * len(rs)}",
        "wire/payload": f"{statistics.fmean(r['wire_over_payload'] for r in rs):.3f}",
        "replicas equal": str(all(r["equal"] for r in rs)),
        "fec k=8: chunks lost": f"{fec_lost(p, 8):.2%}",
        "fec k=8: extra bytes": "12.5%",
        "keep-previous: elements not applied": f"{p:.0%}",
    }


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    table = md_rows([_cells(g) for g in summarize(rows).values()])
    return f"""Setup: 3 sites on 127.0.0.1, {m["fixed"][NUMEL]} int8 params, 4 buckets, one round per seed {m["seeds"]}.
{files(prefix)}

{table}"""


def verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """Per loss rate: whether every run ended with equal replicas, and what recovering the means cost."""
    lines = []
    for rs in summarize(rows).values():
        if rs[0][LOSS] == 0:
            continue
        equal = all(r["equal"] in (True, "True") for r in rs)
        c = _cells(rs)
        lines.append(
            f"- {c['loss']} of mean datagrams lost: replicas equal after every run: **{'yes' if equal else 'NO'}**; "
            f"{c['NACK rounds/site']} NACK rounds per site, {c['re-sent chunks']} chunks re-sent, "
            f"{sum(r['fallbacks'] for r in rs)} gRPC pulls, {c['time s']} s."
        )
    return lines


SPEC = Spec(
    name="datagram_mean_loss",
    title="Datagram path: recovering lost mean datagrams",
    modes=MODES,
    fixed={NUMEL: 400_000},  # parameters (int8: about one byte each)
    label=lambda point: f"loss {point[LOSS]:g}",
    metrics=(("time_s", 0.0, 600.0), ("wire_over_payload", 0.0, 10.0)),
    report=report,
    verdict=verdict,
    execute=measure,
    paths=(LOSS, NUMEL),
)
