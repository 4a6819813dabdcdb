"""The Transport contract (dtrain/transports/base.py), run against every transport.

Each test gets a ``Pair``: a client transport, a server transport serving a
``RecordingHandler``, the server's address, and an address nobody serves. The
gRPC pair uses real sockets on 127.0.0.1 (port 0); the in-process pair uses an
InprocNetwork. The datagram pair (UDP beside gRPC on 127.0.0.1) opens a round
plan first, which carries the round's key.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

from dtrain.errors import PeerTimeout, PeerUnavailable, RejectCode, Rejected
from dtrain.protocol import BucketMean, BucketState, Contribution, MeanChunk
from dtrain.transports.base import Transport
from dtrain.transports.inproc import InprocTransport

pytestmark = pytest.mark.timeout(30)

# --------------------------------------------------------------------------- fixtures


class RecordingHandler:
    """A PeerHandler that records what it accepted and can be told to refuse."""

    def __init__(self) -> None:
        self.accepted: list[Contribution] = []
        self.reject_chunk: dict[int, tuple[str, str]] = {}  # chunk index -> (code, reason)
        self.pull_reject: tuple[str, str] | None = None
        self.mean_ready = threading.Event()
        self.mean_ready.set()
        self.mean: BucketMean | None = None
        self.state: BucketState | None = None
        self.pull_calls: list[tuple] = []
        self.lock = threading.Lock()

    def handle_contribution(self, c: Contribution) -> None:
        if c.chunk in self.reject_chunk:
            raise Rejected(*self.reject_chunk[c.chunk])
        with self.lock:
            self.accepted.append(c)

    def handle_pull_mean(
        self, round: int, bucket: int, requester: str, timeout_s: float, *, have_checksum: str = ""
    ) -> BucketMean:
        self.pull_calls.append(("mean", round, bucket, requester))
        if self.pull_reject is not None:
            raise Rejected(*self.pull_reject)
        if not self.mean_ready.wait(timeout_s):
            raise PeerTimeout(f"mean of round {round} bucket {bucket} not final after {timeout_s:.2f} s")
        assert self.mean is not None
        return self.mean

    def handle_pull_state(self, bucket: int, requester: str) -> BucketState:
        self.pull_calls.append(("state", bucket, requester))
        if self.pull_reject is not None:
            raise Rejected(*self.pull_reject)
        assert self.state is not None
        return self.state


@dataclass
class Pair:
    client: Transport
    server: Transport
    handler: RecordingHandler
    address: str
    unreachable: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_inproc() -> tuple[Transport, Transport, str]:
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    net = InprocNetwork()
    return InprocTransport(net), InprocTransport(net), "inproc:999999"


def _make_grpc() -> tuple[Transport, Transport, str]:
    from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

    cfg = GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0)
    return GrpcTransport(cfg), GrpcTransport(cfg), f"127.0.0.1:{_free_port()}"


def _make_datagram() -> tuple[Transport, Transport, str]:
    from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
    from dtrain.transports.grpc import GrpcTransportConfig

    cfg = DatagramTransportConfig(grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0), report_wait_s=2.0)
    return DatagramTransport(cfg), DatagramTransport(cfg), f"127.0.0.1:{_free_port()}"


def _open_datagram_round(client: Transport, server: Transport, client_addr: str, server_addr: str, nobody: str) -> None:
    """The datagram path needs a round plan (its key, its members): round 2 of the
    tests, with site-a the client, site-b the server and site-z an address nobody
    serves; no bucket means are pushed (all pulls go over gRPC)."""
    from dtrain.protocol import Member, RoundPlan

    plan = RoundPlan(
        round=2,
        members=(
            Member(site_id="site-a", address=client_addr),
            Member(site_id="site-b", address=server_addr),
            Member(site_id="site-z", address=nobody),
        ),
        reduce_timeout_s=10,
        broadcast_timeout_s=10,
        datagram_key=bytes(range(32)),
    )
    client.begin_round(plan, [], "site-a")
    server.begin_round(plan, [], "site-b")


@pytest.fixture(params=["inproc", "grpc", "datagram"])
def pair(request):
    makers = {"inproc": _make_inproc, "grpc": _make_grpc, "datagram": _make_datagram}
    client, server, unreachable = makers[request.param]()
    handler = RecordingHandler()
    address = server.start(handler)
    client_address = client.start(RecordingHandler())
    if request.param == "datagram":
        _open_datagram_round(client, server, client_address, address, unreachable)
    yield Pair(client, server, handler, address, unreachable)
    client.stop(0)
    server.stop(0)


#: every contribution's token claim: each transport carries it (the datagram path in the sealed
#: body, as a u64: this one needs more than 32 bits)
CLAIM = 12_345_678_901


def _contributions(n: int, *, round: int = 2, bucket: int = 5, size: int = 1000) -> list[Contribution]:
    return [
        Contribution(
            round=round,
            bucket=bucket,
            chunk=i,
            offset=i * size // 4,
            numel=size // 4,
            codec="fp32",
            sender="site-a",
            payload=bytes((i + j) % 256 for j in range(size)),
            tokens=CLAIM,
        )
        for i in range(n)
    ]


def _mean(round: int = 2, bucket: int = 5) -> BucketMean:
    return BucketMean(
        round=round,
        bucket=bucket,
        owner="site-b",
        chunks=(
            MeanChunk(chunk=0, offset=0, numel=4, codec="fp32", payload=b"\x01" * 16, senders=("site-a", "site-b")),
            MeanChunk(chunk=1, offset=4, numel=2, codec="int8", payload=b"\x02\x03", senders=("site-b",)),
            MeanChunk(chunk=2, offset=6, numel=0, codec="fp32", payload=b"", senders=()),
        ),
        checksum_before="aa11",
        checksum_after="bb22",
    )


# --------------------------------------------------------------------------- push


def test_push_delivers_every_contribution_in_order(pair: Pair) -> None:
    cs = _contributions(20)
    before = pair.client.bytes_sent()
    assert pair.client.push(pair.address, cs, timeout_s=10) == 20
    assert pair.handler.accepted == cs  # same fields, same order, each once
    assert pair.client.bytes_sent() - before == sum(len(c.payload) for c in cs)


def test_push_delivers_contributions_larger_than_a_datagram(pair: Pair) -> None:
    # the datagram path sends each in fragments, the claim once, at the start of the whole
    cs = _contributions(3, size=4000)
    assert pair.client.push(pair.address, cs, timeout_s=10) == 3
    assert pair.handler.accepted == cs


def test_push_paces_each_contribution_before_it_is_sent(pair: Pair) -> None:
    """``pace`` (a paced fragment round's budget) is called once per contribution with its payload
    bytes, in order, and before that contribution reaches the peer (gRPC lists the chunks for its
    retries first: pacing the caller's iterator would pace nothing on the wire)."""
    cs = _contributions(12)
    calls: list[tuple[int, int]] = []  # (payload bytes, contributions the peer had when called)

    def pace(n: int) -> None:
        with pair.handler.lock:
            calls.append((n, len(pair.handler.accepted)))

    assert pair.client.push(pair.address, cs, timeout_s=10, pace=pace) == 12
    assert [n for n, _ in calls] == [len(c.payload) for c in cs]
    assert all(had <= k for k, (_, had) in enumerate(calls))
    assert pair.handler.accepted == cs


def test_push_of_nothing_returns_zero(pair: Pair) -> None:
    assert pair.client.push(pair.address, [], timeout_s=5) == 0
    assert pair.handler.accepted == []


@pytest.mark.parametrize(
    "code",
    [
        RejectCode.PERMISSION_DENIED,
        RejectCode.FAILED_PRECONDITION,
        RejectCode.INVALID_ARGUMENT,
        RejectCode.ALREADY_EXISTS,
        RejectCode.RESOURCE_EXHAUSTED,
    ],
)
def test_push_rejection_carries_code_and_reason_and_ends_the_call(pair: Pair, code: RejectCode) -> None:
    reason = f"chunk 3 refused: {code.value.lower()} (round 2 < 3)"
    pair.handler.reject_chunk[3] = (code, reason)
    cs = _contributions(6)
    with pytest.raises(Rejected) as info:
        pair.client.push(pair.address, cs, timeout_s=10)
    assert (info.value.code, info.value.reason) == (code, reason)
    if getattr(pair.client, "reports_rejections_in_order", True):
        assert pair.handler.accepted == cs[:3]  # earlier chunks stay accepted, later ones never handled
    else:  # datagrams: the refusal comes back in the owner's report, after the later chunks were handled
        assert pair.handler.accepted == cs[:3] + cs[4:]


# --------------------------------------------------------------------------- pulls


def test_pull_mean_returns_the_owners_mean(pair: Pair) -> None:
    pair.handler.mean = _mean()
    before = pair.client.bytes_received()
    got = pair.client.pull_mean(pair.address, 2, 5, requester="site-a", timeout_s=10)
    assert got == pair.handler.mean
    assert pair.handler.pull_calls == [("mean", 2, 5, "site-a")]
    assert pair.client.bytes_received() - before == 18


def test_pull_mean_waits_for_finalization(pair: Pair) -> None:
    pair.handler.mean = _mean()
    pair.handler.mean_ready.clear()
    timer = threading.Timer(0.4, pair.handler.mean_ready.set)
    t0 = time.monotonic()
    timer.start()
    try:
        got = pair.client.pull_mean(pair.address, 2, 5, requester="site-a", timeout_s=10)
    finally:
        timer.cancel()
    elapsed = time.monotonic() - t0
    assert got == pair.handler.mean
    assert 0.3 <= elapsed < 5.0


def test_pull_mean_not_final_in_time_raises_peer_timeout(pair: Pair) -> None:
    pair.handler.mean = _mean()
    pair.handler.mean_ready.clear()
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout):
        pair.client.pull_mean(pair.address, 2, 5, requester="site-a", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed <= 1.0 + 0.5  # waited for the handler, and never much past the deadline


@pytest.mark.parametrize("code", [RejectCode.NOT_FOUND, RejectCode.FAILED_PRECONDITION])
def test_pull_rejection_carries_code_and_reason(pair: Pair, code: RejectCode) -> None:
    pair.handler.pull_reject = (code, "no mean for round 7 bucket 5 here")
    with pytest.raises(Rejected) as info:
        pair.client.pull_mean(pair.address, 7, 5, requester="site-a", timeout_s=5)
    assert (info.value.code, info.value.reason) == (code, "no mean for round 7 bucket 5 here")
    with pytest.raises(Rejected) as info:
        pair.client.pull_state(pair.address, 5, requester="site-a", timeout_s=5)
    assert info.value.code == code


def test_pull_state_returns_the_bucket_state(pair: Pair) -> None:
    pair.handler.state = BucketState(
        bucket=5,
        rounds_applied=9,
        theta=bytes(range(256)) * 40,
        optimizer_state=b"\x00momentum" * 100,
        checksum="cafe",
        extra={"codec": "fp32", "numel": 2560},
    )
    before = pair.client.bytes_received()
    got = pair.client.pull_state(pair.address, 5, requester="site-c", timeout_s=10)
    assert got == pair.handler.state
    assert pair.handler.pull_calls == [("state", 5, "site-c")]
    assert pair.client.bytes_received() - before == 10240 + 900


# --------------------------------------------------------------------------- join probe


def test_probe_link_times_a_stream_of_filler_from_the_peer(pair: Pair) -> None:
    """gRPC and the datagram path (over its gRPC half) stream the bytes asked for, capped at
    4 MiB, and time them; the in-process transport cannot probe (None); the probe's bytes are
    not round payload."""
    before = pair.client.bytes_received()
    got = pair.client.probe_link(pair.address, max_bytes=256 << 10, timeout_s=10.0, requester="site-a")
    if isinstance(pair.client, InprocTransport):
        assert got is None
        return
    assert got is not None and got.address == pair.address
    assert got.complete and got.bytes == 256 << 10
    assert got.rate_bytes_per_s is not None and got.rate_bytes_per_s > 0
    assert 0 < got.rtt_s < 10.0 and 0 < got.seconds < 10.0
    capped = pair.client.probe_link(pair.address, max_bytes=64 << 20, timeout_s=10.0, requester="site-a")
    assert capped is not None and capped.bytes == 4 << 20 and capped.complete
    assert pair.client.bytes_received() == before
    with pytest.raises(PeerUnavailable):
        pair.client.probe_link(pair.unreachable, max_bytes=1024, timeout_s=3.0, requester="site-a")


# --------------------------------------------------------------------------- failures


def test_unreachable_address_raises_peer_unavailable_quickly(pair: Pair) -> None:
    for call in (
        lambda: pair.client.push(pair.unreachable, _contributions(2), timeout_s=10),
        lambda: pair.client.pull_mean(pair.unreachable, 2, 5, requester="site-a", timeout_s=10),
        lambda: pair.client.pull_state(pair.unreachable, 5, requester="site-a", timeout_s=10),
    ):
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable) as info:
            call()
        assert info.value.code == RejectCode.UNAVAILABLE
        assert time.monotonic() - t0 < 3.0  # bounded retries, far below the 10 s deadline


def test_stop_lets_in_flight_calls_finish_then_refuses(pair: Pair) -> None:
    pair.handler.mean = _mean()
    pair.handler.mean_ready.clear()
    result: dict[str, object] = {}

    def pull() -> None:
        try:
            result["mean"] = pair.client.pull_mean(pair.address, 2, 5, requester="site-a", timeout_s=10)
        except Exception as e:  # recorded and asserted below
            result["error"] = e

    t = threading.Thread(target=pull)
    t.start()
    deadline = time.monotonic() + 5
    while not pair.handler.pull_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.handler.pull_calls, "the pull never reached the handler"
    timer = threading.Timer(0.3, pair.handler.mean_ready.set)
    timer.start()
    pair.server.stop(grace_s=5)
    t.join(10)
    timer.cancel()
    assert result.get("mean") == pair.handler.mean, result.get("error")

    n_before = len(pair.handler.accepted)
    with pytest.raises(PeerUnavailable):
        pair.client.push(pair.address, _contributions(2), timeout_s=5)
    with pytest.raises(PeerUnavailable):
        pair.client.pull_state(pair.address, 5, requester="site-a", timeout_s=5)
    assert len(pair.handler.accepted) == n_before
    # the stopped transport's own client side refuses too
    with pytest.raises(PeerUnavailable):
        pair.server.push(pair.address, _contributions(1), timeout_s=5)
