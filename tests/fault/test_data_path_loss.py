"""Failure detection from the data path (issue 13, item 5): a refused connection or a
push stream that breaks mid-stream marks the member lost for this round at once, at
the owner and at the member, without waiting for the rendezvous (none runs here).

Sites are ``RoundEngine``s served by ``GrpcTransport`` on 127.0.0.1 in this process;
the dead member is a port nobody serves, or a child process SIGKILLed mid-push.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout, assign_owners
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import Member, RoundPlan
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.rounds.types import BucketOutcome
from dtrain.state import GlobalState
from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

NUMEL = 4096
LAYOUT_CFG = BucketConfig(bucket_bytes=4096, chunk_bytes=1024)  # 4 buckets of 4 chunks
REDUCE_S, BROADCAST_S = 60.0, 90.0  # far beyond the test's timeout: only detection ends the round


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _site(site_id: str) -> RoundEngine:
    layout = BucketLayout([NUMEL], ["param"], LAYOUT_CFG)
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    rcfg = RoundConfig(plan_wait_s=2.0, repair_timeout_s=0.5)
    engine = RoundEngine(site_id, GlobalState(layout, [theta]), GrpcTransport(GrpcTransportConfig()), rcfg)
    engine.start()
    return engine


class _Stub:
    """site-2's Peer service while its training process is elsewhere: it takes
    pushes and serves nothing (so site-0's own pushes to it are not refused)."""

    def handle_contribution(self, c) -> None:
        pass

    def handle_pull_mean(self, round, bucket, requester, timeout_s, *, have_checksum=""):
        raise Rejected(RejectCode.NOT_FOUND, "no means here")

    def handle_pull_state(self, bucket, requester):
        raise Rejected(RejectCode.NOT_FOUND, "no state here")


def _plan(rnd: int, members: dict[str, str]) -> RoundPlan:
    return RoundPlan(
        round=rnd,
        members=tuple(Member(site_id=s, address=a) for s, a in sorted(members.items())),
        reduce_timeout_s=REDUCE_S,
        broadcast_timeout_s=BROADCAST_S,
    )


def _step(engine: RoundEngine, seed: int) -> None:
    local = torch.cat([t.detach() for t in engine.state.theta])
    local -= 0.01 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    assert engine.add_pseudo_gradient([local])


@pytest.mark.timeout(40)
def test_refused_connection_marks_the_member_lost_for_the_round_at_once():
    """site-2 is in the plan but nobody serves its address (it died before the round):
    the survivors' pushes to it are refused, so they stop waiting for its chunks (their
    buckets finalize with the two survivors' contributions) and for its buckets' means
    (OWNER_LOST, no pull), long before the 60 s reduce deadline; θ agrees."""
    engines = [_site("site-0"), _site("site-1")]
    reported: dict[str, list[str]] = {e.site_id: [] for e in engines}
    for e in engines:
        e.on_unreachable = reported[e.site_id].append
    members = {e.site_id: e.address for e in engines} | {"site-2": f"127.0.0.1:{_free_port()}"}
    owners = assign_owners(len(engines[0].state.layout), sorted(members))
    assert "site-2" in owners
    try:
        for i, e in enumerate(engines):
            _step(e, i)
        futs = [e.start_round(_plan(0, members)) for e in engines]
        results = [f.result(timeout=30) for f in futs]
        for e, res in zip(engines, results):
            assert res.lost_members == ["site-2"], (e.site_id, res.lost_members)
            for b, o in enumerate(owners):
                want = BucketOutcome.OWNER_LOST if o == "site-2" else BucketOutcome.APPLIED
                assert res.bucket_outcome[b] is want, (e.site_id, b, res.bucket_outcome)
            assert res.reduce_arrived_fraction == pytest.approx(2 / 3)
            assert reported[e.site_id] == ["site-2"]
        assert engines[0].state.checksums() == engines[1].state.checksums()
    finally:
        for e in engines:
            e.stop(0.1)


_CHILD = textwrap.dedent(
    """
    import sys, threading, grpc, torch
    from dtrain.codecs import get_codec
    from dtrain.protocol import Contribution
    from dtrain.transports.grpc import PEER_SERVICE, PUSH_PART_METADATA_KEY
    from dtrain.transports.grpc_wire import encode_contribution
    address, bucket = sys.argv[1], int(sys.argv[2])
    # chunk i at offsets[i]: one stream each, marked i/k when there are k > 1 (a push over k connections)
    offsets, numels = [int(x) for x in sys.argv[3].split(",")], [int(x) for x in sys.argv[4].split(",")]
    k, codec = len(offsets), get_codec(sys.argv[5])
    said = threading.Lock()
    def chunks(i):  # a raw stream (GrpcTransport.push encodes every chunk before it sends)
        yield encode_contribution(Contribution(round=0, bucket=bucket, chunk=i, offset=offsets[i], numel=numels[i],
                                               codec=codec.name, sender="site-2",
                                               payload=codec.encode(torch.zeros(numels[i]))))
        with said:  # one whole line per part: two parts' print()s once interleaved as "sentsent"
            sys.stdout.write("sent\\n")
            sys.stdout.flush()
        threading.Event().wait(120)  # the stream stays open until SIGKILL
    def stream(i):
        push = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]).stream_unary(
            f"/{PEER_SERVICE}/Push")
        meta = ((PUSH_PART_METADATA_KEY, f"{i}/{k}"),) if k > 1 else ()
        push(chunks(i), timeout=float(sys.argv[6]) if len(sys.argv) > 6 else 120, metadata=meta)
    for i in range(1, k):
        threading.Thread(target=stream, args=(i,), daemon=True).start()
    stream(0)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("parts", [1, 2])
def test_push_stream_broken_by_sigkill_marks_the_sender_lost_at_the_owner(parts):
    """site-2 (a child process) streams its first chunk to site-0 and is SIGKILLed with
    the stream open (site-2's Peer service stays up, so nothing else tells site-0): site-0 stops waiting for site-2's chunks at once, so its buckets
    finalize with what arrived (site-2's first chunk included) instead of at the 60 s
    reduce deadline. ``parts`` 2: the push goes as 2 streams (``num_channels_per_peer`` 2),
    chunk 0 in part 0/2 and chunk 1 in part 1/2; both break, and the same holds."""
    owner = _site("site-0")
    stub = GrpcTransport(GrpcTransportConfig())
    members = {"site-0": owner.address, "site-2": stub.start(_Stub())}
    owners = assign_owners(len(owner.state.layout), sorted(members))
    mine = [b for b, o in enumerate(owners) if o == "site-0"]
    b0 = mine[0]
    sent = owner.state.layout.buckets[b0].chunks[:parts]
    assert len(sent) == parts < len(owner.state.layout.buckets[b0].chunks)  # chunks stay owed
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = None
    try:
        _step(owner, 0)
        fut = owner.start_round(_plan(0, members))
        offs, ns = (",".join(str(x) for x in col) for col in zip(*sent))
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, owner.address, str(b0), offs, ns, owner.codec.name],
            stdout=subprocess.PIPE,
            env=env,
        )
        for _ in range(parts):
            assert child.stdout.readline().strip() == b"sent"
        deadline = time.monotonic() + 20
        while True:  # the chunks sent were counted
            with owner._open[0].cv:
                if all(owner._open[0].books.counted(b0, c, "site-2") is not None for c in range(parts)):
                    break
            assert time.monotonic() < deadline, "site-2's chunks never arrived"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        res = fut.result(timeout=30)
        assert res.lost_members == ["site-2"]
        for b in mine:
            assert res.bucket_outcome[b] is BucketOutcome.APPLIED, res.bucket_outcome
        mean = owner._means[(0, b0)]
        for ch in mean.chunks[:parts]:
            assert ch.senders == ("site-0", "site-2")  # what it sent before dying counts
        assert all(ch.senders == ("site-0",) for ch in mean.chunks[parts:])
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        owner.stop(0.1)
        stub.stop(0.1)


def test_push_ended_short_loses_the_sender_in_that_round_only():
    """``handle_push_ended`` loses a sender whose stream ended short in that round
    only (not in a later round already open here); a stream that ended after every
    owed chunk loses nobody."""
    e = _site("site-0")
    try:
        members = {"site-0": e.address, "site-1": f"127.0.0.1:{_free_port()}"}
        from dtrain.rounds.engine import _Owned
        from dtrain.rounds.owner import OpenRound

        def open_round(r: int, opened_at: float) -> OpenRound:
            return OpenRound(
                plan=_plan(r, members),
                owners=assign_owners(len(e.state.layout), sorted(members)),
                site_id="site-0",
                chunks=[b.chunks for b in e.state.layout.buckets],
                aggregation=e.config.aggregation,
                opened_at=opened_at,
            )

        books = {r: open_round(r, time.monotonic()) for r in (0, 1)}
        with e._cv:
            e._open.update({r: _Owned(bk) for r, bk in books.items()})
        e.handle_push_ended("site-1", 0, 1)
        assert books[0].lost == {"site-1"} and books[1].lost == set()
        with e._cv:
            del e._open[0]
        bk = books[1]
        for b in bk.mine:
            for c, (_, n) in enumerate(bk.chunks[b]):
                assert bk.accept("site-1", b, c, torch.zeros(n), bytes([b, c]), now=time.monotonic())
        e.handle_push_ended("site-1", 1, sum(len(bk.chunks[b]) for b in bk.mine))
        assert bk.lost == set()
        # a stream that ends short at the reduce deadline ran out of its sender's time: no loss
        late = open_round(2, time.monotonic() - _plan(2, members).reduce_timeout_s + 0.2)  # 0.2 s before its deadline
        with e._cv:
            e._open[2] = _Owned(late)
        e.handle_push_ended("site-1", 2, 1)
        assert late.lost == set() and late.owed("site-1")
        # a stream the transport saw end at its call's own deadline (the sender reckoned its
        # reduce deadline earlier than this owner: a plan read late) is no loss either, however
        # far this owner's own deadline still is
        early = open_round(3, time.monotonic())
        with e._cv:
            e._open[3] = _Owned(early)
        e.handle_push_ended("site-1", 3, 1, at_deadline=True)
        assert early.lost == set() and early.owed("site-1")
        e.handle_push_ended("site-1", 3, 1)  # the same end without that evidence: a broken stream
        assert early.lost == {"site-1"}
        # a push sent as 2 streams (num_channels_per_peer 2): one part that ended, even twice (a
        # retried stream), while the other still sends is no loss; the push ended short once both did
        split = open_round(4, time.monotonic())
        with e._cv:
            e._open[4] = _Owned(split)
        e.handle_push_ended("site-1", 4, 1, part=(0, 2))
        e.handle_push_ended("site-1", 4, 1, part=(0, 2))
        assert split.lost == set() and split.owed("site-1")
        e.handle_push_ended("site-1", 4, 0, part=(1, 2))
        assert split.lost == {"site-1"}
    finally:
        e.stop(0.1)


class _SlowOwner:
    """An owner whose chunk handling takes a while, so the sender dies mid-handling."""

    def __init__(self) -> None:
        import threading

        self.handling = threading.Event()
        self.ended: list[tuple[str, int, int]] = []
        self.at_deadline: list[bool] = []

    def handle_contribution(self, c) -> None:
        self.handling.set()
        time.sleep(1.0)

    def handle_push_ended(
        self, sender: str, round: int, num_accepted: int, *, at_deadline: bool = False, part: tuple[int, int] = (0, 1)
    ) -> None:
        self.ended.append((sender, round, num_accepted))
        self.at_deadline.append(at_deadline)

    def handle_pull_mean(self, round, bucket, requester, timeout_s, *, have_checksum=""):
        raise Rejected(RejectCode.NOT_FOUND, "no means here")

    def handle_pull_state(self, bucket, requester):
        raise Rejected(RejectCode.NOT_FOUND, "no state here")


@contextlib.contextmanager
def _sender_to_a_slow_owner(*args: str):
    """A :class:`_SlowOwner` behind a gRPC transport, and a child process (``_CHILD``, extra
    ``args``) pushing chunk 0 of bucket 0 to it; yields ``(handler, child)`` once the owner
    is handling that chunk. The child is killed and the transport stopped on the way out."""
    handler = _SlowOwner()
    t = GrpcTransport(GrpcTransportConfig())
    address = t.start(handler)
    off, n = BucketLayout([NUMEL], ["param"], LAYOUT_CFG).buckets[0].chunks[0]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = subprocess.Popen([sys.executable, "-c", _CHILD, address, "0", str(off), str(n), "fp32", *args], env=env)
    try:
        assert handler.handling.wait(20), "the chunk never reached the handler"
        yield handler, child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        t.stop(0.1)


def _wait_ended(handler: _SlowOwner, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not handler.ended and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_sender_killed_while_its_chunk_is_handled_is_reported_ended():
    """The sender dies while the owner still handles its chunk (the RPC is cancelled under
    the awaiting coroutine rather than its stream ending): the owner's handler still hears
    that the stream ended, so the engine stops waiting for that sender's chunks (a CI run
    at load once waited out the 60 s reduce deadline in the SIGKILL test above)."""
    with _sender_to_a_slow_owner() as (handler, child):
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        _wait_ended(handler, 15)
        assert [(s, r) for s, r, _ in handler.ended] == [("site-2", 0)]
        assert handler.at_deadline == [False]  # its call had ~2 minutes left: a broken stream


@pytest.mark.timeout(60)
def test_a_push_stream_cut_by_its_own_call_deadline_is_reported_at_the_deadline():
    """The sender's push call runs out of its own deadline (grpc-timeout) with chunks still
    owed: the owner's handler hears that the stream ended at that deadline, which it does not
    take for a death (a sender that reckoned its reduce deadline a second before the owner's
    was declared dead at 30% loss, and the members held its buckets owner-lost)."""
    with _sender_to_a_slow_owner("3") as (handler, _):
        _wait_ended(handler, 20)
        assert [(s, r) for s, r, _ in handler.ended] == [("site-2", 0)]
        assert handler.at_deadline == [True]
