"""One site of the datagram reordering test (tests/netem/test_datagram_reorder_netem.py), run
inside its netem namespace: a RoundEngine on the datagram data path with a fixed plan (no
rendezvous), ``--rounds`` rounds of seeded pseudo-gradients per phase (one engine each, started
together; a phase begins when the test writes "go" on stdin, after it set the links), then one
JSON line per phase on stdout: θ's checksum per bucket after each round, each round's included
fraction and refusals, and the transport's counters.

Site 0 also sends, after a phase's last round, junk to site 1 inside that round: a copy of one sealed
datagram three times (the copies are replays) and a forged one (a body byte changed).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dtrain.buckets import BucketConfig, BucketLayout  # noqa: E402
from dtrain.codecs import CodecConfig  # noqa: E402
from dtrain.protocol import Member, RoundPlan  # noqa: E402
from dtrain.rounds import RoundConfig, RoundEngine  # noqa: E402
from dtrain.state import GlobalState  # noqa: E402
from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig, datagram_chunk_bytes  # noqa: E402
from dtrain.transports.datagram_wire import Kind  # noqa: E402
from dtrain.transports.grpc import GrpcTransportConfig  # noqa: E402

NUMEL = 60_000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--hosts", required=True, help="every site's address, comma-separated")
    ap.add_argument("--port", type=int, required=True, help="phase k's sites listen on port + k")
    ap.add_argument("--key", required=True, help="32-byte datagram key, hex (every round)")
    ap.add_argument("--phases", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hosts = args.hosts.split(",")
    # one engine per phase, each from θ = 0 with the same pseudo-gradients: the phases' means compare
    engines = [_engine(args.index, hosts[args.index], args.port + k) for k in range(args.phases)]
    print("ready", flush=True)
    for k, eng in enumerate(engines):
        assert sys.stdin.readline().strip() == "go"  # the test set the links and every site is up
        members = tuple(Member(site_id=f"site-{i}", address=f"{h}:{args.port + k}") for i, h in enumerate(hosts))
        out: dict = {"checksums": [], "included": [], "rejected": []}
        gen = torch.Generator().manual_seed(args.index)
        for r in range(args.rounds):
            theta = torch.zeros(NUMEL)
            eng.state.copy_to([theta])
            assert eng.add_pseudo_gradient([theta - (1.0 + torch.randn(NUMEL, generator=gen))])  # local = θ − Δ
            plan = RoundPlan(
                round=r,
                members=members,
                reduce_timeout_s=5.0,
                broadcast_timeout_s=8.0,
                datagram_key=bytes.fromhex(args.key),
            )
            res = eng.start_round(plan).result(timeout=30)
            out["checksums"].append([eng.state.checksum(b) for b in range(len(eng.state.layout))])
            out["included"].append(res.included_fraction)
            out["rejected"].append(dict(res.rejected))
        if args.index == 0:
            _junk(eng.transport, args.rounds - 1, members[1].address)
        time.sleep(0.5)  # junk and the last means' acknowledgements arrive
        out["counters"] = eng.transport.counters()
        print(json.dumps(out), flush=True)
    for eng in engines:
        eng.stop(0)
    return 0


def _engine(index: int, host: str, port: int) -> RoundEngine:
    layout = BucketLayout(
        [NUMEL], ["param"], BucketConfig(bucket_bytes=4 * 15_000, chunk_bytes=datagram_chunk_bytes("fp32"))
    )
    cfg = DatagramTransportConfig(
        grpc=GrpcTransportConfig(bind_host=host, bind_port=port), max_rate_mbit=100.0, rtt_s=0.02
    )
    eng = RoundEngine(
        f"site-{index}",
        GlobalState(layout, [torch.zeros(NUMEL)], outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0)),
        DatagramTransport(cfg),
        RoundConfig(codec=CodecConfig(name="fp32"), plan_wait_s=5.0),
    )
    eng.start()
    return eng


def _junk(transport: DatagramTransport, round: int, address: str) -> None:
    rs = transport._round(round)
    host, port = address.rsplit(":", 1)
    data = rs.sealer.seal(Kind.MEAN_ACK, b"\x00" * 20, bucket=0)
    forged = data[:-1] + bytes([data[-1] ^ 1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in (data, data, data, forged):
            s.sendto(d, (host, int(port)))


if __name__ == "__main__":
    raise SystemExit(main())
