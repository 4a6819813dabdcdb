"""A rendezvous under the load of many sites: quorum-decision and heartbeat latency.

The rendezvous (``serve_rendezvous`` over a ``RendezvousCore``) runs in its own process. This
process simulates ``--sites`` sites with one ``grpc.aio`` client over ``--channels`` loopback
channels: every site joins, heartbeats every ``--heartbeat-interval-s`` (phases spread), and in
each of ``--rounds`` rounds sends its Ready at a random moment within ``--spread-s`` and
long-polls for the plan (``min_sites = initial_sites = --sites``). Figures, on this process's
clock (its own queueing included):

* plan latency: per site and round, from the round's *last* Ready sent to this site's plan; the
  first answer per round is the decision (``decision``), median and p99 over all what a site
  sees (``plan``);
* heartbeat latency (round trip) during the rounds;
* sites declared dead (must be 0) and the rendezvous's CPU seconds per round.

Issue 13's target: quorum decisions in under 100 ms with 1,000 sites.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import grpc
import numpy as np

from dtrain._proto.dtrain.v1 import rendezvous_pb2 as pb
from dtrain._proto.dtrain.v1 import rendezvous_pb2_grpc as pb_grpc
from experiments import bench


def _serve(conn, num_sites: int, heartbeat_interval_s: float, heartbeat_timeout_s: float) -> None:
    """The rendezvous process (a :class:`bench.Server`): serve, answer CPU / dead-site queries on ``conn``."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from dtrain.rendezvous import RendezvousConfig, RendezvousCore
    from dtrain.rendezvous.grpc import serve_rendezvous
    from dtrain.transports.grpc_common import GrpcTransportConfig

    rcfg = RendezvousConfig(
        min_sites=num_sites,
        initial_sites=num_sites,
        quorum_timeout_s=60.0,
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    core = RendezvousCore(rcfg)
    # max_ping_strikes=0: see _Load; the load's few connections each carry ~125 sites.
    strikes = (("grpc.http2.max_ping_strikes", 0),)
    server = serve_rendezvous(
        core, GrpcTransportConfig(max_concurrent_rpcs=max(4096, 4 * num_sites), extra_options=strikes)
    )
    conn.send(server.address)

    def dead() -> list[str]:
        sites = core.snapshot(time.monotonic())["sites"]
        return sorted(s for s, v in sites.items() if v["needs_resync"] or not v["alive"])

    bench.answer(conn, dead=dead)
    server.stop(0)


class _Load:
    """``num_sites`` simulated sites on one event loop."""

    def __init__(self, address: str, args: argparse.Namespace) -> None:
        self.args = args
        # One TCP connection per channel, no BDP probe, and no ping strikes on the server:
        # with ~125 sites' calls on one connection, its pings during the plan fan-out (30 MB
        # in a burst) now and then ended a batch of calls CANCELLED at once (a GOAWAY, it
        # seems). A real site has a connection of its own and gets one plan per round.
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
        self.channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(args.channels)]
        self.stubs = [pb_grpc.RendezvousStub(ch) for ch in self.channels]
        self.site_ids = [f"site-{i:04d}" for i in range(args.sites)]
        self.hb_latency_s: list[float] = []
        self.hb_resync = 0
        self.hb_errors: dict[str, int] = {}  # status code -> count
        self.num_cancelled = 0
        self.missed: list[str] = []
        self.stop = asyncio.Event()
        self.rng = random.Random(args.seed)

    def stub(self, i: int) -> pb_grpc.RendezvousStub:
        return self.stubs[i % len(self.stubs)]

    async def heartbeats(self, i: int, phase_s: float) -> None:
        interval = self.args.heartbeat_interval_s
        req = pb.HeartbeatRequest(site_id=self.site_ids[i])
        await asyncio.sleep(phase_s)
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                reply = await self.stub(i).Heartbeat(req, timeout=10)
            except grpc.aio.AioRpcError as e:
                self.hb_errors[e.code().name] = self.hb_errors.get(e.code().name, 0) + 1
            else:
                self.hb_latency_s.append(time.perf_counter() - t)
                self.hb_resync += int(reply.resync_required or not reply.known)
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t)))

    async def ready(self, i: int, rnd: int, delay_s: float, sent: list[float], got: list[float]) -> int:
        await asyncio.sleep(delay_s)
        sent[i] = time.perf_counter()
        req = pb.ReadyRequest(site_id=self.site_ids[i], round=rnd, wait_ms=10_000)
        while True:
            try:
                reply = await self.stub(i).Ready(req, timeout=30)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    raise
                self.num_cancelled += 1  # seen now and then under this load; a site asks again
                continue
            if reply.status == "plan":
                got[i] = time.perf_counter()
                return len(reply.plan.members)
            if reply.status == "missed":  # declared dead (counted in the output); it takes no part
                self.missed.append(f"{self.site_ids[i]} r{rnd}: {reply.reason}")
                got[i] = float("nan")
                return 0

    async def one_round(self, rnd: int) -> dict:
        n = len(self.site_ids)
        sent, got = [0.0] * n, [0.0] * n
        delays = [self.rng.uniform(0, self.args.spread_s) for _ in range(n)]
        sizes = await asyncio.gather(*(self.ready(i, rnd, delays[i], sent, got) for i in range(n)))
        lat_ms = (np.array(got) - max(sent)) * 1e3  # from the round's last Ready
        lat_ms = lat_ms[~np.isnan(lat_ms)]
        return {
            "round": rnd,
            "min_plan_members": min((x for x in sizes if x), default=0),
            "num_missed": sum(1 for x in sizes if not x),
            "decision_ms": float(lat_ms.min()),
            "plan_median_ms": float(np.median(lat_ms)),
            "plan_p99_ms": float(np.percentile(lat_ms, 99)),
            "plan_max_ms": float(lat_ms.max()),
            "plan_latencies_ms": lat_ms.tolist(),
        }


async def _run_load(address: str, args: argparse.Namespace, server_cpu) -> dict:
    load = _Load(address, args)
    t0 = time.perf_counter()
    joins = [pb.JoinRequest(site_id=s, address=f"127.0.0.1:{20000 + i}") for i, s in enumerate(load.site_ids)]
    await asyncio.gather(*(load.stub(i).Join(req, timeout=60) for i, req in enumerate(joins)))
    join_s = time.perf_counter() - t0
    interval = args.heartbeat_interval_s
    hb = [asyncio.create_task(load.heartbeats(i, load.rng.uniform(0, interval))) for i in range(len(load.site_ids))]
    await asyncio.sleep(interval)  # every site heartbeats once before the rounds
    load.hb_latency_s.clear()
    rounds = []
    cpu0, load0 = server_cpu(), bench.cpu_s()
    for rnd in range(args.rounds):
        rounds.append(await load.one_round(rnd))
        await asyncio.sleep(args.pause_s)
    cpu_per_round = (server_cpu() - cpu0) / max(1, args.rounds)
    load_cpu = bench.cpu_s() - load0
    load.stop.set()
    await asyncio.gather(*hb)
    for ch in load.channels:
        await ch.close()
    all_ms = np.concatenate([r.pop("plan_latencies_ms") for r in rounds])
    hb_ms = np.array(load.hb_latency_s) * 1e3
    return {
        "sites": args.sites,
        "rounds": rounds,
        "join_all_s": join_s,
        "decision_median_ms": float(np.median([r["decision_ms"] for r in rounds])),
        "decision_max_ms": float(max(r["decision_ms"] for r in rounds)),
        "plan_median_ms": float(np.median(all_ms)),
        "plan_p99_ms": float(np.percentile(all_ms, 99)),
        "heartbeats": int(hb_ms.size),
        "heartbeat_median_ms": float(np.median(hb_ms)) if hb_ms.size else float("nan"),
        "heartbeat_p99_ms": float(np.percentile(hb_ms, 99)) if hb_ms.size else float("nan"),
        "heartbeat_max_ms": float(hb_ms.max()) if hb_ms.size else float("nan"),
        "heartbeat_errors": load.hb_errors,
        "heartbeat_resync_answers": load.hb_resync,
        "ready_cancelled": load.num_cancelled,
        "missed": load.missed,
        "load_cpu_s_per_round": load_cpu / max(1, args.rounds),
        "server_cpu_s_per_round": cpu_per_round,
    }


def _print(out: dict) -> None:
    print(
        f"rendezvous with {out['sites']} simulated sites, {len(out['rounds'])} rounds (join all: {out['join_all_s']:.2f} s)\n"
    )
    bench.table(
        "| round | members | missed | decision ms | plan median ms | plan p99 ms | plan max ms |",
        "| {round} | {min_plan_members} | {num_missed} | {decision_ms:.1f} | {plan_median_ms:.1f} | {plan_p99_ms:.1f} "
        "| {plan_max_ms:.1f} |",
        out["rounds"],
    )
    print(
        f"last ready -> plan: decision median {out['decision_median_ms']:.1f} ms (max {out['decision_max_ms']:.1f}); "
        f"every site's plan median {out['plan_median_ms']:.1f} ms, p99 {out['plan_p99_ms']:.1f} ms"
    )
    print(
        f"heartbeats: {out['heartbeats']} during the rounds, median {out['heartbeat_median_ms']:.2f} ms, "
        f"p99 {out['heartbeat_p99_ms']:.2f} ms, max {out['heartbeat_max_ms']:.2f} ms, "
        f"errors {out['heartbeat_errors'] or 0}, resync answers {out['heartbeat_resync_answers']}; "
        f"Ready calls ended CANCELLED (asked again): {out['ready_cancelled']}"
    )
    print(
        f"sites declared dead: {len(out['declared_dead'])} at the end, {len(out['missed'])} site-rounds missed; "
        f"CPU per round: rendezvous {out['server_cpu_s_per_round']:.2f} s, load process {out['load_cpu_s_per_round']:.2f} s"
    )
    for m in out["missed"][:5]:
        print(f"  missed: {m}")


def main(argv: list[str] | None = None) -> int:
    p = bench.parser(__doc__, smoke="50 sites, 2 rounds (CI)")
    p.add_argument("--sites", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--channels", type=int, default=8, help="loopback channels of the load process")
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    p.add_argument("--spread-s", type=float, default=1.0, help="Readies of a round arrive within this window")
    p.add_argument("--pause-s", type=float, default=0.5, help="pause between rounds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.sites, args.rounds, args.spread_s, args.pause_s = 50, 2, 0.2, 0.1
    if args.sites < 1 or args.rounds < 1 or args.channels < 1:
        p.error("--sites, --rounds and --channels must be >= 1")
    server = bench.Server(_serve, args.sites, args.heartbeat_interval_s, args.heartbeat_timeout_s, timeout_s=60)
    try:  # the rendezvous in its own process, the load in this one
        out = asyncio.run(_run_load(server.address, args, server.ask))
        out["declared_dead"] = server.ask("dead")
    finally:
        server.stop()
    _print(out)
    bench.write(args, "bench_rendezvous", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
