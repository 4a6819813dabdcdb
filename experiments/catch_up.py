"""Catch-up benchmark: how long a joiner takes to pull θ and the outer state, against the state
size, the link and the number of donors, next to the naive figure state bytes / link rate.

Each donor is a process holding the same θ and SGD-momentum outer state (one outer step taken,
so the momentum buffers are full size) behind its gRPC Peer service; the joiner is a process
running :class:`dtrain.rounds.catchup.CatchUp` against them (buckets spread over the donors,
``state_pull_streams`` transfers each). This measures the transfer, not the replay (a replayed
round costs one round of means). smoke: loopback, 2 MB of state; quick and full (root, netem):
every donor's link 100 Mbit/s, RTT 40 ms, the joiner's link 100 Mbit/s (it is the bottleneck) or
300 Mbit/s (the donors' uplinks are), one and three donors.

One row per run: seconds, and the naive seconds = state bytes / the narrower side's rate (the
joiner's link, or the donors' uplinks together). The target (issue 33): within 1.3x of the naive
figure with three donors. The donor and joiner processes are ``python -m experiments.catch_up
donor|joiner``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dtrain.app.procs import child_env
from experiments.common import RunResult, md_table
from experiments.lab import Point, Spec, files, met
from experiments.procs import netem_topology, wait_until

NETEM, RATE, RTT = "netem.enabled", "netem.rate_mbit", "netem.rtt_ms"
STATE_MB, DONORS, JOINER_X = "lab.state_mb", "lab.donors", "lab.joiner_x"
WAN = {NETEM: True, RATE: 100, RTT: 40}
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(fixed={NETEM: False, RATE: None, RTT: 0}, grid={JOINER_X: [1], STATE_MB: [2], DONORS: [1, 3]}),
    "quick": dict(fixed=WAN, grid={JOINER_X: [1, 3], STATE_MB: [16, 64], DONORS: [1, 3]}),
    "full": dict(fixed=WAN, grid={JOINER_X: [1, 3], STATE_MB: [64, 256], DONORS: [1, 3]}),
}
BUCKET_BYTES = 1 << 20  # 1 MiB buckets: a 16 MB state is 8 of them, enough to spread over 3 donors x 2 streams
TARGET_RATIO = 1.3


def _state(numel: int, *, theta: bool):
    """A one-tensor GlobalState of ``numel`` fp32 parameters; ``theta``: the donors' (seeded θ,
    one outer step taken, so every bucket has its momentum buffer), else zeros."""
    import torch

    from dtrain.buckets import BucketConfig, BucketLayout
    from dtrain.state import GlobalState

    layout = BucketLayout([numel], ["param"], BucketConfig(bucket_bytes=BUCKET_BYTES, chunk_bytes=BUCKET_BYTES))
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(numel, generator=gen) if theta else torch.zeros(numel)
    st = GlobalState(layout, [t])
    if theta:
        for b in range(len(st)):
            st.apply_mean(b, torch.randn(layout.buckets[b].numel, generator=gen))
            st.bucket_round[b] = 1
        st.rounds_applied = 1
    return st


def _engine(site_id: str, state, host: str):
    from dtrain.rounds import RoundEngine
    from dtrain.transports.grpc import GrpcTransport
    from dtrain.transports.grpc_config import GrpcTransportConfig

    eng = RoundEngine(site_id, state, GrpcTransport(GrpcTransportConfig(bind_host=host)))
    eng.start()
    return eng


def donor(args: argparse.Namespace) -> None:
    eng = _engine(args.site_id, _state(args.numel, theta=True), args.host)
    Path(args.out).write_text(eng.address or "")
    while True:
        time.sleep(3600)


def joiner(args: argparse.Namespace) -> None:
    from dtrain.protocol import Member
    from dtrain.rounds.catchup import CatchUp

    st = _state(args.numel, theta=False)
    eng = _engine("joiner", st, args.host)
    donors = [Member(site_id=f"donor-{i}", address=a) for i, a in enumerate(args.donors.split(","))]
    cu = CatchUp(st, eng.transport, eng.bcodec, requester="joiner", streams_per_donor=2, use_own=False)
    t0 = time.monotonic()
    rnd = cu.run(donors)
    out = {"seconds": time.monotonic() - t0, "round": rnd, "bytes": sum(cu.stats.bytes_from.values())}
    equal = st.checksums() == _state(args.numel, theta=True).checksums()
    print(json.dumps(out | {"buckets_from": cu.stats.buckets_from, "equal": equal}))
    eng.stop(0.1)


def _run_one(numel: int, num_donors: int, topo) -> dict:
    py = [sys.executable, "-m", "experiments.catch_up"]
    env = child_env()
    procs: list[subprocess.Popen] = []

    def start(site: int, argv: list[str], **kw: Any) -> subprocess.Popen:  # in site ``site``'s namespace under netem
        return topo.popen(site, argv, env=env, **kw) if topo else subprocess.Popen(argv, env=env, **kw)

    with tempfile.TemporaryDirectory() as d:
        try:
            addrs = [Path(d) / f"donor-{i}" for i in range(num_donors)]  # each donor writes its address there
            for i, out in enumerate(addrs):
                host = topo.address(i + 1) if topo else "127.0.0.1"
                argv = [*py, "donor", "--numel", str(numel), "--host", host, "--out", str(out), "--site-id", f"d{i}"]
                procs.append(start(i + 1, argv))
            if not wait_until(lambda: all(a.exists() and a.read_text() for a in addrs), 120, poll_s=0.1):
                raise RuntimeError("donors did not start")
            host = topo.address(0) if topo else "127.0.0.1"
            argv = [*py, "joiner", "--numel", str(numel), "--host", host]
            argv += ["--donors", ",".join(a.read_text() for a in addrs)]
            out, _ = start(0, argv, stdout=subprocess.PIPE).communicate(timeout=600)
            return json.loads(out.decode().strip().splitlines()[-1])
        finally:
            for p in procs:
                p.kill()
                p.wait()


def measure(point: Point) -> RunResult:
    """One pull of ``lab.state_mb`` MB from ``lab.donors`` donors; through netem (every link at
    ``netem.rate_mbit``, the joiner's ``lab.joiner_x`` times that) when ``netem.enabled``."""
    f = point.settings
    numel = (f[STATE_MB] << 20) // 8  # θ and one momentum buffer: 8 bytes per parameter
    with netem_topology(1 + f[DONORS], "cu", "catch_up") if f[NETEM] else contextlib.nullcontext() as topo:
        if topo is not None:
            topo.set_link(None, delay_ms=f[RTT] / 2, rate_mbit=f[RATE])
            topo.set_link(0, delay_ms=f[RTT] / 2, rate_mbit=f[RATE] * f[JOINER_X])
        r = _run_one(numel, f[DONORS], topo)
    rate = f[RATE] * min(f[JOINER_X], f[DONORS]) if f[RATE] else float("nan")  # the narrower side
    naive = r["bytes"] * 8 / (rate * 1e6)
    r["buckets_from"] = json.dumps(r["buckets_from"])
    row = point.row(joiner_mbit=(f[RATE] or 0) * f[JOINER_X], **r, naive_s=naive, ratio=r["seconds"] / naive)
    return RunResult(row=row)


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    link = f"netem, every link {f[RATE]} Mbit/s, RTT {f[RTT]} ms" if f[NETEM] else "loopback, no emulated link"
    timed = ("seconds", "naive_s", "ratio")
    table = [[r["joiner_mbit"], r[STATE_MB], r[DONORS], *(f"{r[k]:.2f}" for k in timed), r["equal"]] for r in rows]
    return f"""Setup: {link}; the joiner pulls θ and the outer momentum ({BUCKET_BYTES >> 20} MiB buckets, 2 streams a donor).
{files(prefix)}

{md_table(["joiner Mbit/s", "state MB", "donors", "seconds", "naive s", "ratio", "equal"], table)}"""


def verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """Issue 33's target: three donors within ``TARGET_RATIO`` of the naive figure."""
    three = [r["ratio"] for r in rows if r["lab.donors"] == 3 and math.isfinite(r["ratio"])]
    if not three:
        return ["- Three donors within 1.3x of the naive time: not judged (no link rate: loopback)."]
    worst = max(three)
    judged = met(worst <= TARGET_RATIO, "missed")
    return [f"- Three donors within {TARGET_RATIO}x of the naive time: worst {worst:.2f}x ({judged})."]


SPEC = Spec(
    name="catch_up",
    title="Catch-up: a joiner's state pull against the naive transfer time",
    modes={k: {"seeds": [0], **v} for k, v in MODES.items()},  # jobs 1 (the default): timings, one pull at a time
    label=lambda point: f"joiner x{point[JOINER_X]}, {point[STATE_MB]} MB, {point[DONORS]} donors",
    metrics=(("seconds", 0.0, 600.0), ("bytes", 1, 1e12)),
    report=report,
    verdict=verdict,
    execute=measure,
    paths=(NETEM, RATE, RTT, STATE_MB, DONORS, JOINER_X),
)


def main(argv: list[str] | None = None) -> None:
    """The donor and joiner processes of :func:`measure` (``python -m experiments.catch_up ROLE``)."""
    ap = argparse.ArgumentParser(prog="python -m experiments.catch_up", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role", required=True)
    for role in ("donor", "joiner"):
        p = sub.add_parser(role)
        p.add_argument("--numel", type=int, required=True)
        p.add_argument("--host", default="127.0.0.1")
        for flag in ("--out", "--site-id", "--donors"):  # the donor's file and name, the joiner's donors
            p.add_argument(flag, default="")
    args = ap.parse_args(argv)
    (donor if args.role == "donor" else joiner)(args)


if __name__ == "__main__":
    main()
