"""Rogue clients against a real site: a ``RoundEngine`` served by ``GrpcTransport``
(shared token) in this process, with a round open. Each bad request must be
refused with its status code, and nothing of it may reach the round's means.

The transport-level checks (contract suite, token, TLS, message limits) live in
tests/unit/test_transport_contract.py and tests/integration/test_grpc_transport.py;
these tests are about what the *site* accepts into a round.
"""

from __future__ import annotations

import struct
import time
import zlib

import numpy as np
import pytest
import torch
import zstandard

from dtrain.buckets import BucketConfig, BucketLayout, assign_owners
from dtrain.codecs import CodecConfig, get_codec
from dtrain.errors import RejectCode, Rejected, TransportError
from dtrain.metrics import chunk_senders, rejected_applied
from dtrain.protocol import Contribution, Member, RoundPlan
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.state import GlobalState
from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

TOKEN = "rogue-clients-test-token"
CODEC = "fp32+zstd"  # zstd on, so a decompression bomb reaches the decoder
NUMEL = 4096  # one fp32 tensor: 4 buckets of 1024 elements, 4 chunks of 256 each
LAYOUT_CFG = BucketConfig(bucket_bytes=4096, chunk_bytes=1024)
SERVER_MAX_MESSAGE_BYTES = 256 * 1024
_HEADER = struct.Struct("<4sBBBBIQQI")  # payload header, dtrain.codecs docstring


def _layout() -> BucketLayout:
    return BucketLayout([NUMEL], ["param"], LAYOUT_CFG)


def _theta0() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


def _site(site_id: str, **round_kw) -> RoundEngine:
    cfg = GrpcTransportConfig(token=TOKEN, max_message_bytes=SERVER_MAX_MESSAGE_BYTES, part_bytes=128 * 1024)
    # The rogue pushes chunk by chunk (one stream each): not a loss here (short_push_is_loss).
    rcfg = RoundConfig(
        codec=CodecConfig(name=CODEC), plan_wait_s=1.0, repair_timeout_s=0.5, short_push_is_loss=False, **round_kw
    )
    engine = RoundEngine(site_id, GlobalState(_layout(), [_theta0()]), GrpcTransport(cfg), rcfg)
    engine.start()
    return engine


def _client(token: str | None = TOKEN, **kw) -> GrpcTransport:
    """A client-only transport (it never serves)."""
    return GrpcTransport(GrpcTransportConfig(token=token, num_attempts=1, **kw))


def _stored_payload(stored: bytes, numel: int) -> bytes:
    """An fp32+zstd payload around an already zstd-compressed (or forged) body."""
    return _HEADER.pack(b"DTRC", 1, 1, 1, 1, 0, numel, len(stored), zlib.crc32(stored)) + stored


def _forged_values(values: np.ndarray) -> bytes:
    """A well-formed fp32+zstd payload of any float32 values (the encoder refuses NaN/Inf)."""
    body = zstandard.ZstdCompressor(write_content_size=True).compress(values.astype(np.float32).tobytes())
    return _stored_payload(body, values.size)


def _streaming_frame_payload(numel: int) -> bytes:
    """An fp32+zstd payload of zeros whose frame does not declare its content size (as
    ``ZstdCompressor().compressobj()`` writes it)."""
    obj = zstandard.ZstdCompressor().compressobj()
    frame = obj.compress(bytes(4 * numel)) + obj.flush()
    assert zstandard.frame_content_size(frame) == -1
    return _stored_payload(frame, numel)


def _zstd_bomb(numel: int) -> bytes:
    """A zstd frame whose header claims 10 GiB of content (one 16-byte raw block follows)."""
    frame = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (10 << 30).to_bytes(8, "little")
    frame += ((16 << 3) | 1).to_bytes(3, "little") + bytes(16)
    return _stored_payload(frame, numel)


class _RoguePeer:
    """The rogue member's own Peer service: it takes every push and serves nothing
    (a member that serves no means, but is reachable: a refused connection would make
    the honest sites hold it lost for the round and stop waiting for its chunks)."""

    def handle_contribution(self, c: Contribution) -> None:
        pass

    def handle_pull_mean(self, round: int, bucket: int, requester: str, timeout_s: float, *, have_checksum=""):
        raise Rejected(RejectCode.NOT_FOUND, "the rogue serves no means")

    def handle_pull_state(self, bucket: int, requester: str):
        raise Rejected(RejectCode.NOT_FOUND, "the rogue serves no state")


def _rogue_server() -> GrpcTransport:
    t = GrpcTransport(GrpcTransportConfig(token=TOKEN))
    t.start(_RoguePeer())
    return t


class Rogue:
    """Sends hand-made contributions to one site's Peer service."""

    def __init__(self, address: str, layout: BucketLayout, transport: GrpcTransport | None = None) -> None:
        self.address = address
        self.layout = layout
        self.t = transport or _client()
        self.codec = get_codec(CODEC)

    def chunk(self, rnd: int, b: int, c: int, values: torch.Tensor | None = None, **override) -> Contribution:
        off, n = self.layout.buckets[b].chunks[c]
        payload = self.codec.encode(values if values is not None else torch.zeros(n))
        fields = dict(round=rnd, bucket=b, chunk=c, offset=off, numel=n, codec=CODEC, sender="rogue", payload=payload)
        fields.update(override)
        return Contribution(**fields)

    def push(self, c: Contribution, transport: GrpcTransport | None = None) -> int:
        return (transport or self.t).push(self.address, [c], timeout_s=5.0)

    def refused(self, c: Contribution, code: str, transport: GrpcTransport | None = None) -> str:
        with pytest.raises(TransportError) as ei:
            self.push(c, transport)
        assert ei.value.code == code, f"expected {code}, got {ei.value}"
        return ei.value.reason


def _plan(rnd: int, members: dict[str, str], reduce_s: float, broadcast_s: float) -> RoundPlan:
    return RoundPlan(
        round=rnd,
        members=tuple(Member(site_id=s, address=a) for s, a in sorted(members.items())),
        reduce_timeout_s=reduce_s,
        broadcast_timeout_s=broadcast_s,
    )


def _wait_open(engine: RoundEngine, rnd: int) -> None:
    deadline = time.monotonic() + 5
    while rnd not in engine._open:  # the round thread has registered the plan
        assert time.monotonic() < deadline, f"round {rnd} did not open"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_each_rogue_request_is_refused_with_its_status_and_nothing_is_applied():
    victim = _site("victim")
    layout = victim.state.layout
    rogue = Rogue(victim.address, layout)
    rogue_server = _rogue_server()
    members = {"victim": victim.address, "rogue": rogue_server.address}
    owners = assign_owners(len(layout), list(members))
    b = owners.index("victim")  # a bucket the victim owns: the rogue's target
    other = owners.index("rogue")
    n = layout.buckets[b].chunks[0][1]
    theta_before = [t.detach().clone() for t in victim.state.theta]
    try:
        # The victim contributes Δ = 0, so every chunk's mean is (0 + rogue's accepted value) / 2.
        victim.add_pseudo_gradient([_theta0()])
        fut = victim.start_round(_plan(0, members, reduce_s=20.0, broadcast_s=25.0))
        _wait_open(victim, 0)

        # ---- authentication (refused before any payload is read)
        assert "dtrain-token" in rogue.refused(rogue.chunk(0, b, 0), RejectCode.UNAUTHENTICATED, _client(token=None))
        assert "wrong token" in rogue.refused(rogue.chunk(0, b, 0), RejectCode.UNAUTHENTICATED, _client(token="guess"))
        # ---- membership, round and ownership
        assert "not a member" in rogue.refused(rogue.chunk(0, b, 0, sender="mallory"), RejectCode.PERMISSION_DENIED)
        assert "not open here" in rogue.refused(rogue.chunk(7, b, 0), RejectCode.FAILED_PRECONDITION)
        assert "owned by rogue" in rogue.refused(rogue.chunk(0, other, 0), RejectCode.FAILED_PRECONDITION)
        # ---- shape: offsets outside the bucket, wrong element count, bad bucket / chunk index
        bucket_numel = layout.buckets[b].numel
        assert "covers offset" in rogue.refused(
            rogue.chunk(0, b, 0, offset=bucket_numel + 10), RejectCode.INVALID_ARGUMENT
        )
        assert "covers offset" in rogue.refused(rogue.chunk(0, b, 0, offset=2**63), RejectCode.INVALID_ARGUMENT)
        assert "out of range" in rogue.refused(rogue.chunk(0, b, 0, chunk=99), RejectCode.INVALID_ARGUMENT)
        assert "out of range" in rogue.refused(rogue.chunk(0, b, 0, bucket=99), RejectCode.INVALID_ARGUMENT)
        longer = rogue.chunk(0, b, 0, values=torch.zeros(n + 1), numel=n + 1)
        assert "numel" in rogue.refused(longer, RejectCode.INVALID_ARGUMENT)
        shorter = rogue.chunk(0, b, 0, values=torch.zeros(n - 1))  # header says n-1, the chunk n
        rogue.refused(shorter, RejectCode.INVALID_ARGUMENT)
        assert "codec" in rogue.refused(rogue.chunk(0, b, 0, codec="int8"), RejectCode.INVALID_ARGUMENT)
        # ---- values: NaN, Inf, a zstd frame claiming 10 GB, garbage
        for bad in (np.nan, np.inf, -np.inf):
            vals = np.zeros(n, np.float32)
            vals[3] = bad
            reason = rogue.refused(rogue.chunk(0, b, 0, payload=_forged_values(vals)), RejectCode.INVALID_ARGUMENT)
            assert "NaN or inf" in reason
        assert "claims 10737418240 bytes" in rogue.refused(
            rogue.chunk(0, b, 0, payload=_zstd_bomb(n)), RejectCode.RESOURCE_EXHAUSTED
        )
        assert "undecodable" in rogue.refused(rogue.chunk(0, b, 0, payload=b"\x00" * 64), RejectCode.INVALID_ARGUMENT)
        # ---- an oversized message (a client that does not limit itself)
        big = _client(max_message_bytes=4 << 20)
        huge = rogue.chunk(0, b, 0, payload=bytes(SERVER_MAX_MESSAGE_BYTES + 1024))
        rogue.refused(huge, RejectCode.RESOURCE_EXHAUSTED, big)

        # ---- duplicates: an identical retry is idempotent, a different payload is not
        x = torch.linspace(-1.0, 1.0, n)
        assert rogue.push(rogue.chunk(0, b, 0, values=x)) == 1
        assert rogue.push(rogue.chunk(0, b, 0, values=x)) == 1  # accepted, counted once
        assert "already accepted" in rogue.refused(rogue.chunk(0, b, 0, values=-x), RejectCode.ALREADY_EXISTS)
        # complete every bucket the victim owns (zeros), so the means are published now; as
        # another zstd implementation writes them (streaming frames without a content size),
        # which are valid and accepted, not refused as a decompression bomb
        for bb in (i for i, o in enumerate(owners) if o == "victim"):
            for c, (_, nc) in enumerate(layout.buckets[bb].chunks):
                if (bb, c) != (b, 0):
                    assert rogue.push(rogue.chunk(0, bb, c, payload=_streaming_frame_payload(nc))) == 1
        mean = rogue.t.pull_mean(victim.address, 0, b, requester="rogue", timeout_s=5.0)
        for bb in (i for i, o in enumerate(owners) if o == "victim" and i != b):  # a member takes every mean
            rogue.t.pull_mean(victim.address, 0, bb, requester="rogue", timeout_s=5.0)  # (else the owner withdraws it)
        res = fut.result(timeout=40)
        assert [ch.senders for ch in mean.chunks] == [("rogue", "victim")] * len(mean.chunks)
        dec = get_codec(CODEC)
        got = torch.cat([dec.decode(ch.payload, numel=ch.numel) for ch in mean.chunks])
        want = torch.zeros(bucket_numel)
        want[:n] = x / 2  # (victim's 0 + rogue's x, once) / 2 contributions
        assert torch.equal(got, want), "a refused or duplicated chunk reached the mean"
        # nothing else moved: buckets other than b kept θ (no mean: their owner
        # serves none; or a mean of zeros); in b only chunk 0 moved
        assert res.round == 0 and res.applied_buckets == owners.count("victim")
        for bb in range(len(layout)):
            if bb != b:
                assert torch.equal(victim.state.theta[bb].detach(), theta_before[bb]), f"bucket {bb} moved"
        moved = (victim.state.theta[b].detach() != theta_before[b]).nonzero().flatten()
        assert moved.numel() > 0 and int(moved.max()) < n
        # every refusal by the site is counted by its code, with at most 5 example reasons
        # per code; the token checks, the oversized message (gRPC) and the unopened round 7
        # never reach round 0's books
        assert res.rejected == {
            "ALREADY_EXISTS": 1,
            "FAILED_PRECONDITION": 1,
            "INVALID_ARGUMENT": 11,
            "PERMISSION_DENIED": 1,
            "RESOURCE_EXHAUSTED": 1,
        }, res.rejected
        examples = res.rejected_examples
        assert {k: len(v) for k, v in examples.items()} == {k: min(5, n) for k, n in res.rejected.items()}
        assert (
            "already accepted" in examples["ALREADY_EXISTS"][0] and "not a member" in examples["PERMISSION_DENIED"][0]
        )
        assert "claims 10737418240 bytes" in examples["RESOURCE_EXHAUSTED"][0]
        assert "covers offset" in examples["INVALID_ARGUMENT"][0]

        # ---- a replay of last round's chunk, while the next round is open
        victim.add_pseudo_gradient([_theta0()])
        fut = victim.start_round(_plan(1, members, reduce_s=1.0, broadcast_s=2.0))
        _wait_open(victim, 1)
        assert "round 0 is over here" in rogue.refused(rogue.chunk(0, b, 0, values=x), RejectCode.FAILED_PRECONDITION)
        # the rogue takes round 1's means as a member does, while the round runs (a mean no
        # member took by the broadcast deadline is withdrawn: the commit rule)
        mean1 = rogue.t.pull_mean(victim.address, 1, b, requester="rogue", timeout_s=5.0)
        for bb in (i for i, o in enumerate(owners) if o == "victim" and i != b):
            rogue.t.pull_mean(victim.address, 1, bb, requester="rogue", timeout_s=5.0)
        res1 = fut.result(timeout=20)
        assert res1.round == 1 and res1.applied_buckets == owners.count("victim")
        assert all(ch.senders == ("victim",) for ch in mean1.chunks), "the replayed chunk reached round 1's mean"
    finally:
        victim.stop(0.1)
        rogue_server.stop(0.1)


def _assert_nothing_refused_applied(lines, rnd, bucket, rogue, *, members):
    """The metrics-line check (``rejected_applied``) passes on what the sites applied, names
    the rogue's refused chunk, and fails once a line claims its mean included the rogue."""
    victim = next(ln for ln in lines if ln["site"] == "victim")
    named = [e for e in victim["rejected_senders"] if e["sender"] == rogue]
    if rnd < 2:  # excluded after 2 rounds: later refusals are PERMISSION_DENIED, not owner-side chunk faults
        assert named and named[0]["bucket"] == bucket and named[0]["chunk"] == 0 and named[0]["counted"] is None
    assert all(chunk_senders(ln["mean_senders"][str(bucket)], 0) == list(members) for ln in lines), lines
    assert rejected_applied(lines) == []
    forged = [
        dict(ln, mean_senders={**ln["mean_senders"], str(bucket): {"senders": [*members, rogue], "absent": {}}})
        for ln in lines
    ]
    found = rejected_applied(forged)
    assert len(found) == 2 * len(named) and all(f"refused {rogue}'s b{bucket} c0" in f for f in found), found
    if named:
        counted = [
            dict(ln, rejected_senders=[{**e, "counted": e["digest"]} for e in ln["rejected_senders"]]) for ln in lines
        ]
        assert any("its mean counted that payload" in f for f in rejected_applied(counted))


def _nan_chunk_payload(layout, bucket: int) -> bytes:
    """A well-formed payload of chunk 0 of ``bucket`` whose first value is NaN."""
    nan = np.zeros(layout.buckets[bucket].chunks[0][1], np.float32)
    nan[0] = np.nan
    return _forged_values(nan)


def _start_honest_rounds(engines, rnd: int, members, gen, *, reduce_s: float, broadcast_s: float) -> dict:
    """Every engine adds a small pseudo-gradient and starts round ``rnd``; waits until the
    first (the victim) has it open. Returns site id -> the round's future."""
    futs = {}
    for eng in engines:
        local = torch.cat([t.detach() for t in eng.state.theta]) - 0.01 * torch.randn(NUMEL, generator=gen)
        assert eng.add_pseudo_gradient([local])
        futs[eng.site_id] = eng.start_round(_plan(rnd, members, reduce_s=reduce_s, broadcast_s=broadcast_s))
    _wait_open(engines[0], rnd)
    return futs


@pytest.mark.timeout(60)
def test_site_sending_corrupt_payloads_every_round_is_excluded_and_the_run_goes_on():
    """A member whose contribution is refused (NaN) in max_consecutive_rejections
    rounds in a row is excluded (PERMISSION_DENIED) by the owner; the two honest
    sites keep running rounds and agree on θ."""
    max_rej = 2
    victim = _site("victim", max_consecutive_rejections=max_rej)
    honest = _site("honest", max_consecutive_rejections=max_rej)
    layout = victim.state.layout
    rogue = Rogue(victim.address, layout)
    rogue_server = _rogue_server()
    members = {"victim": victim.address, "honest": honest.address, "rogue": rogue_server.address}
    owners = assign_owners(len(layout), list(members))
    target = owners.index("victim")
    gen = torch.Generator().manual_seed(1)
    codes = []
    try:
        for rnd in range(max_rej + 2):
            # The owners wait out the reduce deadline (the rogue's other chunks never come);
            # 2 s leaves the honest pushes room on a loaded 2-core machine, where 0.6 s
            # was missed (round 0 ended with no mean applied at all).
            futs = _start_honest_rounds((victim, honest), rnd, members, gen, reduce_s=2.0, broadcast_s=4.0)
            with pytest.raises(Rejected) as ei:
                rogue.push(rogue.chunk(rnd, target, 0, payload=_nan_chunk_payload(layout, target)))
            codes.append(ei.value.code)
            results = {s: f.result(timeout=20) for s, f in futs.items()}
            lines = [{"site": s, "round": rnd, "status": "applied", **r.metrics()} for s, r in results.items()]
            _assert_nothing_refused_applied(lines, rnd, target, "rogue", members=("honest", "victim"))
            sums = {eng.site_id: eng.state.checksums() for eng in (victim, honest)}
            assert sums["victim"] == sums["honest"], f"round {rnd}: honest sites disagree"
            for s, res in results.items():
                # the buckets whose owner is honest got a mean; the rogue's got none
                assert res.applied_buckets == sum(1 for o in owners if o != "rogue"), (s, res)
        assert codes == [RejectCode.INVALID_ARGUMENT] * max_rej + [RejectCode.PERMISSION_DENIED] * 2, codes
        assert victim.banned == frozenset({"rogue"})
        assert honest.banned == frozenset()  # it never got anything from the rogue
        assert victim.state.rounds_applied == honest.state.rounds_applied == max_rej + 2
    finally:
        victim.stop(0.1)
        rogue_server.stop(0.1)
        honest.stop(0.1)


def test_rogue_helpers_build_the_payloads_they_claim():
    """The forged payloads are well-formed apart from what each test means to break."""
    codec = get_codec(CODEC)
    vals = np.arange(8, dtype=np.float32)
    assert torch.equal(codec.decode(_forged_values(vals), numel=8), torch.from_numpy(vals))
    assert zstandard.frame_content_size(_zstd_bomb(8)[_HEADER.size :]) == 10 << 30


@pytest.mark.timeout(60)
def test_a_spoofer_claiming_a_members_name_cannot_get_it_excluded():
    """A token holder pushes NaN chunks claiming to be the honest member, every round for
    max_consecutive_rejections + 1 rounds (the chaos soak's corrupt action got site-0
    excluded this way). Each spoofed chunk is refused and named with its digest; the
    member's own chunks are counted, so it is never excluded, and no refused payload
    reaches a mean (rejected_applied)."""
    max_rej = 2
    victim = _site("victim", max_consecutive_rejections=max_rej)
    honest = _site("honest", max_consecutive_rejections=max_rej)
    layout = victim.state.layout
    rogue = Rogue(victim.address, layout)
    members = {"victim": victim.address, "honest": honest.address}
    owners = assign_owners(len(layout), list(members))
    target = owners.index("victim")
    gen = torch.Generator().manual_seed(3)
    try:
        for rnd in range(max_rej + 1):
            futs = _start_honest_rounds((victim, honest), rnd, members, gen, reduce_s=3.0, broadcast_s=5.0)
            spoof = rogue.chunk(rnd, target, 0, payload=_nan_chunk_payload(layout, target), sender="honest")
            with pytest.raises(Rejected) as ei:
                rogue.push(spoof)
            assert ei.value.code in (RejectCode.INVALID_ARGUMENT, RejectCode.ALREADY_EXISTS), ei.value
            results = {s: f.result(timeout=20) for s, f in futs.items()}
            assert victim.state.checksums() == honest.state.checksums(), f"round {rnd}: sites disagree"
            lines = [{"site": s, "round": rnd, "status": "applied", **r.metrics()} for s, r in results.items()]
            named = [e for e in results["victim"].rejected_senders if e["sender"] == "honest"]
            assert len(named) == 1 and named[0]["counted"] not in (None, named[0]["digest"]), named
            assert all(chunk_senders(ln["mean_senders"][str(target)], 0) == ["honest", "victim"] for ln in lines), lines
            assert rejected_applied(lines) == []
        assert victim.banned == frozenset(), "a spoofer got an honest member excluded"
    finally:
        victim.stop(0.1)
        honest.stop(0.1)
