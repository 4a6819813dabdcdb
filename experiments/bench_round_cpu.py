"""CPU seconds one site spends per round in the round engine's own arithmetic (prints a table).

The model is the datagram experiments' 9.8 M-parameter task (``datagram_vs_grpc.wide_task``), in
the layout a 4-site datagram run uses (chunks of one datagram each). One site's share of a round
is replayed in-process without a transport, with the library's own functions, in the engine's
order: ``pseudo_gradient`` (``RoundEngine.add_pseudo_gradient``: where the codec can, each
bucket also encoded and settled in that pass, ``Codec.accumulate_encode``), ``encode`` (the
payloads cut from that body by ``Codec.encode_chunks``; else the encode itself), ``accept`` (the owner taking the N contributions of its
buckets as ``PeerSide`` does: decoded, digested, checked and summed, then the means), ``mean_encode`` / ``mean_decode`` (the owner's means; a member checking the
others', ``means.checked_mean``, which the outer step decodes in its own pass where it can), ``outer_step`` (``GlobalState.apply_mean`` less its checksum), ``settle`` (error
feedback) and ``checksums`` (each bucket's θ checksum right after its step, as ``apply_mean``
takes it, and the metrics line's two after the round); ``gc`` is the collection after the
round (``dtrain.app.gc_control.RoundCollector``, as a site runs). The process keeps freed heap
memory as a site's does (``dtrain.transports.heap.keep_freed_memory``, which its
``GrpcTransport`` sets).

Figures are CPU seconds of this thread (``time.thread_time``, robust to other processes),
medians over ``--repeats`` rounds, one torch thread; ``--compare a.json b.json`` prints the
ratios of two ``--json`` files.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dtrain.aggregation import AggregationConfig, BucketAccumulator
from dtrain.app.gc_control import RoundCollector
from dtrain.buckets import BucketConfig, BucketLayout, assign_owners
from dtrain.codecs import get_codec
from dtrain.protocol import BucketMean, MeanChunk
from dtrain.rounds import error_feedback
from dtrain.rounds.means import checked_mean, encode_mean
from dtrain.state import GlobalState
from dtrain.tasks.spec import TaskSpec
from dtrain.transports.datagram import datagram_chunk_bytes
from dtrain.transports.grpc_config import GrpcTransportConfig
from dtrain.transports.heap import keep_freed_memory
from experiments import bench

STEPS = tuple("pseudo_gradient encode accept mean_encode mean_decode outer_step settle checksums gc".split())
GROUPS = {  # the brief's three figures
    "encode": ("pseudo_gradient", "encode", "mean_encode"),
    "decode": ("accept", "mean_decode", "settle"),
    "checksums": ("checksums",),
}


class _Site:
    """One site's state and the pieces of a round it replays."""

    def __init__(self, tensors: list[torch.Tensor], *, codec: str, num_sites: int, chunk_bytes: int | None) -> None:
        chunk_bytes = chunk_bytes or datagram_chunk_bytes(codec)
        self.layout = BucketLayout(
            [t.numel() for t in tensors], ["param"] * len(tensors), BucketConfig(chunk_bytes=chunk_bytes, num_sites=4)
        )
        self.state = GlobalState(self.layout, tensors)
        self.codec = get_codec(codec)
        self.tensors = [t.clone() for t in tensors]
        self.num_sites = num_sites
        self.gen = torch.Generator().manual_seed(0)
        owners = assign_owners(len(self.layout), [f"site-{i}" for i in range(num_sites)])
        self.mine = [b for b, o in enumerate(owners) if o == "site-0"]
        self.remote = [b for b, o in enumerate(owners) if o != "site-0"]

    def round(self) -> dict[str, float]:
        cpu = bench.Stopwatch(time.thread_time)
        st, layout, codec = self.state, self.layout, self.codec
        for t in self.tensors:  # an inner phase's worth of change to the local model
            t.add_(torch.randn(t.shape, generator=self.gen), alpha=1e-3)
        ahead: dict = {}  # as RoundEngine.add_pseudo_gradient: each bucket encoded in the accumulation's pass
        with cpu("pseudo_gradient"):
            ok = error_feedback.add_pseudo_gradient(
                layout, st.theta, st.residuals, self.tensors, error_feedback=True, codec=codec, encoded=ahead
            )
        assert ok
        with cpu("encode"):  # as RoundEngine._contributions: the payloads cut (else encoded, settled in place)
            settled = [
                b in ahead or codec.settles_in_place(r, bk.chunks)
                for b, (r, bk) in enumerate(zip(st.residuals, layout.buckets))
            ]
            sent = [
                codec.encode_chunks(r, bk.chunks, encoded=ahead[b])
                if b in ahead
                else codec.encode_chunks(r, bk.chunks, generator=self.gen, settle=s)
                for b, (r, bk, s) in enumerate(zip(st.residuals, layout.buckets, settled))
            ]
        means = {}
        senders = [f"site-{i}" for i in range(self.num_sites)]
        for b in self.mine:
            numels = [n for _, n in layout.buckets[b].chunks]
            # as PeerSide._accept_run takes each sender's run (checks, then decoded into the sums), in
            # sender order (the owner's best case: nothing held), then OpenRound.finalize
            with cpu("accept"):
                acc = BucketAccumulator(numels, AggregationConfig(), order=senders)
                for s in senders:  # the others' payloads: alike this site's here
                    vals = codec.checked_run(sent[b], numels) or codec.decode_chunks(sent[b], numels)  # as _decode_runs
                    acc.add_run(s, list(range(len(numels))), vals, sent[b])  # each payload its own key
                reds = acc.finalize()  # as OpenRound.finalize
            with cpu("mean_encode"):
                means[b] = encode_mean(codec, layout.buckets[b], reds, residual=None, generator=self.gen)
        for b in self.remote:  # stand-in means of the others' buckets: what this site sent
            chunks = tuple(
                MeanChunk(chunk=c, offset=o, numel=n, codec=codec.name, payload=p, senders=("site-0",))
                for c, ((o, n), p) in enumerate(zip(layout.buckets[b].chunks, sent[b]))
            )
            m = BucketMean(round=0, bucket=b, owner="x", chunks=chunks, checksum_before="", checksum_after="")
            with cpu("mean_decode"):
                means[b] = (chunks, checked_mean(codec, layout.buckets[b], m))  # as RoundEngine: decoded by the step
        for b in range(len(layout)):  # GlobalState.apply_mean: the step, then θ_b's checksum (timed apart)
            with cpu("outer_step"), st.lock(b):
                st._step(b, means[b][1])  # noqa: SLF001 - GlobalState.apply_mean less its checksum
            with cpu("checksums"):
                st.checksum(b)  # right after the step, as apply_mean; cached for the next round's pulls
        with cpu("settle"):
            for b, bk in enumerate(layout.buckets):
                error_feedback.settle_bucket(
                    st.residuals[b],
                    bk.chunks,
                    [True] * len(bk.chunks),
                    codec=codec,
                    sent=sent[b].__getitem__,
                    bcodec=codec,
                    mean_payloads=[ch.payload for ch in means[b][0]],
                    settled_in_place=settled[b],
                )
        from dtrain.app.worker import outer_state_checksum
        from dtrain.diloco import theta_checksum

        with cpu("checksums"):  # the metrics line's, after the round
            theta_checksum(st)
            outer_state_checksum(SimpleNamespace(state=st))
        return cpu.s


def run(codec: str, repeats: int, num_sites: int, chunk_bytes: int | None = None) -> dict:
    from experiments.datagram_vs_grpc import wide_task

    torch.set_num_threads(1)
    keep_freed_memory(GrpcTransportConfig().heap_keep_bytes)  # as every site's process (its GrpcTransport) does
    tensors = [p.detach() for p in wide_task(TaskSpec(num_sites=num_sites)).model.parameters()]
    site = _Site(tensors, codec=codec, num_sites=num_sites, chunk_bytes=chunk_bytes)
    numel = site.layout.total_numel
    print(
        f"# {numel:,} parameters in {len(site.layout)} buckets of {site.layout.bucket_bytes / 2**20:.2f} MiB, "
        f"{sum(len(b.chunks) for b in site.layout.buckets):,} chunks of {site.layout.chunk_bytes} B; codec "
        f"{codec}; {num_sites} sites (this one owns {len(site.mine)} buckets); torch {torch.__version__}; "
        f"one thread; medians of {repeats} rounds (after one warm-up)",
        flush=True,
    )
    site.round()  # warm-up: the outer optimizer's momentum buffers, allocator
    # as a site runs (dtrain.app.gc_control): no automatic collection inside a round, one after it
    collector = RoundCollector(1, site="bench")
    collector.start()
    try:
        rounds = []
        for i in range(repeats):
            rounds.append(site.round())
            t = time.thread_time()
            collector.after_round(i + 1)
            rounds[-1]["gc"] = time.thread_time() - t
    finally:
        collector.close()
    med = {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in STEPS}
    grp = {g: statistics.median(sum(r.get(k, 0.0) for k in ks) for r in rounds) for g, ks in GROUPS.items()}
    grp["total"] = statistics.median(sum(r.values()) for r in rounds)
    grp["engine"] = statistics.median(sum(r.get(k, 0.0) for ks in GROUPS.values() for k in ks) for r in rounds)
    # sha256 rather than dtrain.buckets.checksum, which another checkout may compute otherwise
    digest = hashlib.sha256(torch.cat([t.detach() for t in site.state.theta]).numpy().tobytes()).hexdigest()[:32]
    return {"codec": codec, "numel": numel, "repeats": repeats, "steps": med, "groups": grp, "theta": digest}


def _print(res: dict) -> None:
    n = res["numel"]
    print("\n| step | CPU s / round | ns / parameter |\n|:---|---:|---:|")
    rows = list(res["steps"].items()) + [(f"**{k}**", v) for k, v in res["groups"].items()]
    for k, v in rows:
        print(f"| {k} | {v:.4f} | {v / n * 1e9:.2f} |")
    print(f"\nθ after {res['repeats'] + 1} rounds: {res['theta']}")


def _compare(before: dict, after: dict) -> None:
    print("\n| step | before s | after s | after / before |\n|:---|---:|---:|---:|")
    nan = float("nan")  # a step one of the files does not have (an older bench)
    rows = [(k, before["steps"].get(k, nan), after["steps"].get(k, nan)) for k in STEPS]
    rows += [(f"**{k}**", before["groups"][k], after["groups"][k]) for k in before["groups"]]
    for k, a, b in rows:
        print(f"| {k} | {a:.4f} | {b:.4f} | {b / a if a else nan:.2f} |")
    same = before.get("theta") == after.get("theta")
    print(f"\nθ digests after the same rounds: {'equal' if same else 'DIFFER'}")


def main(argv: list[str] | None = None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--codec", default="int8", help="int8 (default) or int4 (fixed-size codecs of the datagram path)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-sites", type=int, default=4)
    ap.add_argument("--chunk-bytes", type=int, help="fp32 bytes per chunk (default: one datagram's, as a datagram run)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="print ratios of two --json")
    args = ap.parse_args(argv)
    if args.compare:
        docs = [json.loads(p.read_text()) for p in args.compare]
        _compare(*(d.get("figures", d) for d in docs))  # files of before the stamped form: the figures themselves
        return 0
    res = run(args.codec, args.repeats, args.num_sites, args.chunk_bytes)
    _print(res)
    bench.write(args, "bench_round_cpu", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
