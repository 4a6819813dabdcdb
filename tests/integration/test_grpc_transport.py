"""The gRPC transport and rendezvous service on 127.0.0.1: sizes, limits,
authentication, TLS, keepalive, retries, channels, and the rendezvous long poll.

Everything listens on 127.0.0.1 with port 0 (or a port reserved by the test).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from dtrain._proto.dtrain.v1 import peer_pb2 as pb
from dtrain._proto.dtrain.v1 import peer_pb2_grpc as pb_grpc
from dtrain.errors import PeerTimeout, PeerUnavailable, RejectCode, Rejected, RendezvousError
from dtrain.protocol import BucketMean, BucketState, Contribution, MeanChunk
from dtrain.rendezvous.grpc import GrpcRendezvousClient, serve_rendezvous
from dtrain.transports.grpc import (
    PUSH_PART_METADATA_KEY,
    GrpcTransport,
    GrpcTransportConfig,
    TlsConfig,
    push_parts,
)

MiB = 1 << 20
TOKEN = "s3cret-token"


class Handler:
    """Records every call; hashes pushed payloads instead of keeping them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple] = []
        self.digest = hashlib.sha256()
        self.num_chunks = 0
        self.num_payload_bytes = 0
        self.reject: tuple[str, str] | None = None
        self.mean: BucketMean | None = None
        self.state: BucketState | None = None
        self.block_s = 0.0  # pull_mean sleeps this long, ignoring its timeout

    def handle_contribution(self, c: Contribution) -> None:
        with self.lock:
            self.calls.append(("push", c.chunk))
            if self.reject is not None:
                raise Rejected(*self.reject)
            self.digest.update(c.payload)
            self.num_chunks += 1
            self.num_payload_bytes += len(c.payload)

    def handle_pull_mean(
        self, round: int, bucket: int, requester: str, timeout_s: float, *, have_checksum: str = ""
    ) -> BucketMean:
        with self.lock:
            self.calls.append(("mean", round, bucket))
        if self.block_s:
            time.sleep(self.block_s)
        if self.reject is not None:
            raise Rejected(*self.reject)
        if self.mean is None:
            raise PeerTimeout("no mean yet")
        return self.mean

    def handle_pull_state(self, bucket: int, requester: str) -> BucketState:
        with self.lock:
            self.calls.append(("state", bucket))
        return self.state


@pytest.fixture
def transports():
    """Factory of started transports, all stopped at teardown."""
    made: list[GrpcTransport] = []

    def make(cfg: GrpcTransportConfig | None = None, handler: Handler | None = None):
        t = GrpcTransport(cfg or GrpcTransportConfig())
        made.append(t)
        if handler is not None:
            return t, t.start(handler)
        return t

    yield make
    for t in made:
        t.stop(0)


def _chunks(data: bytes, chunk_bytes: int, *, round: int = 1, bucket: int = 0) -> list[Contribution]:
    view = memoryview(data)
    return [
        Contribution(
            round=round,
            bucket=bucket,
            chunk=i,
            offset=off // 4,
            numel=min(chunk_bytes, len(data) - off) // 4,
            codec="fp32",
            sender="site-a",
            payload=bytes(view[off : off + chunk_bytes]),
        )
        for i, off in enumerate(range(0, len(data), chunk_bytes))
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- sizes


@pytest.mark.timeout(60)
def test_120_mb_pseudo_gradient_pushes_through_as_1_mib_chunks(transports) -> None:
    handler = Handler()
    _, address = transports(handler=handler)
    client = transports()
    data = os.urandom(120 * MiB)
    cs = _chunks(data, MiB)
    assert len(cs) == 120
    assert client.push(address, cs, timeout_s=50) == 120
    assert handler.num_chunks == 120 and handler.num_payload_bytes == 120 * MiB
    assert handler.digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert client.bytes_sent() == 120 * MiB


@pytest.mark.timeout(30)
def test_state_and_mean_larger_than_the_message_cap_arrive_in_parts(transports) -> None:
    # A reduced cap stands in for protobuf's 2 GiB limit: 128 KiB messages, 32 KiB parts.
    cfg = GrpcTransportConfig(max_message_bytes=128 * 1024, part_bytes=32 * 1024)
    handler = Handler()
    server, address = transports(cfg, handler)
    client = transports(cfg)
    theta = os.urandom(1 * MiB + 3)
    handler.state = BucketState(
        bucket=4,
        rounds_applied=12,
        theta=theta,
        optimizer_state=os.urandom(300_000),
        checksum="c0ffee",
        extra={"a": [1, 2]},
    )
    handler.mean = BucketMean(
        round=12,
        bucket=4,
        owner="site-b",
        chunks=(
            MeanChunk(
                chunk=0, offset=0, numel=131072, codec="fp32", payload=os.urandom(512 * 1024), senders=("a", "b")
            ),
            MeanChunk(chunk=1, offset=131072, numel=5, codec="fp32", payload=os.urandom(20), senders=("b",)),
        ),
        checksum_before="x",
        checksum_after="y",
    )
    assert len(theta) > 8 * cfg.max_message_bytes  # one message could never carry it
    assert client.pull_state(address, 4, requester="site-a", timeout_s=20) == handler.state
    assert client.pull_mean(address, 12, 4, requester="site-a", timeout_s=20) == handler.mean
    expected = len(theta) + 300_000 + 512 * 1024 + 20
    assert client.bytes_received() == expected and server.bytes_sent() == expected


@pytest.mark.timeout(30)
def test_oversized_message_is_refused_with_resource_exhausted(transports) -> None:
    cfg = GrpcTransportConfig(max_message_bytes=128 * 1024, part_bytes=32 * 1024, token=TOKEN)
    handler = Handler()
    _, address = transports(cfg, handler)
    big = Contribution(
        round=1, bucket=0, chunk=0, offset=0, numel=50_000, codec="fp32", sender="a", payload=b"\0" * 200_000
    )

    # Through the transport: refused before sending.
    with pytest.raises(Rejected) as info:
        transports(cfg).push(address, [big], timeout_s=5)
    assert info.value.code == RejectCode.RESOURCE_EXHAUSTED

    # A rogue client whose own send limit is larger: the server refuses it.
    opts = [("grpc.max_send_message_length", 8 * MiB), ("grpc.max_receive_message_length", 8 * MiB)]
    with grpc.insecure_channel(address, options=opts) as channel:
        stub = pb_grpc.PeerStub(channel)
        msg = pb.ContributionChunk(
            round=1, bucket=0, chunk=0, numel=50_000, codec="fp32", sender="a", payload=big.payload
        )
        with pytest.raises(grpc.RpcError) as rpc:
            stub.Push(iter([msg]), timeout=5, metadata=(("dtrain-token", TOKEN),))
    assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert handler.calls == []


# --------------------------------------------------------------------------- authentication


@pytest.mark.timeout(30)
def test_missing_or_wrong_token_is_unauthenticated_and_never_reaches_the_handler(transports) -> None:
    handler = Handler()
    handler.mean = BucketMean(round=1, bucket=0, owner="b", chunks=(), checksum_before="", checksum_after="")
    _, address = transports(GrpcTransportConfig(token=TOKEN), handler)
    cs = _chunks(b"\1" * 4096, 1024)
    for client in (transports(GrpcTransportConfig()), transports(GrpcTransportConfig(token="wrong-token"))):
        for call in (
            lambda: client.push(address, cs, timeout_s=5),
            lambda: client.pull_mean(address, 1, 0, requester="a", timeout_s=5),
            lambda: client.pull_state(address, 0, requester="a", timeout_s=5),
        ):
            with pytest.raises(Rejected) as info:
                call()
            assert info.value.code == RejectCode.UNAUTHENTICATED
            assert info.value.reason in ("missing dtrain-token metadata", "wrong token")
    assert handler.calls == []
    good = transports(GrpcTransportConfig(token=TOKEN))
    assert good.push(address, cs, timeout_s=5) == 4
    assert good.pull_mean(address, 1, 0, requester="a", timeout_s=5) == handler.mean


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA, a site certificate signed by it (localhost / 127.0.0.1, server and
    client use), and a second CA's site certificate (untrusted)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates (the cryptography package is not installed)")
    d = tmp_path_factory.mktemp("pki")
    (d / "ext.cnf").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for name in ("ca", "rogue-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
                 "-subj", f"/CN=dtrain-test-{name}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    for name, ca in (("site", "ca"), ("rogue", "rogue-ca")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=localhost", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    return {n: str(d / n) for n in ("ca.pem", "site.pem", "site.key", "rogue.pem", "rogue.key")}


@pytest.mark.timeout(30)
def test_tls_serves_and_plaintext_clients_fail(transports, pki) -> None:
    tls = TlsConfig(cert_path=pki["site.pem"], key_path=pki["site.key"], ca_path=pki["ca.pem"])
    handler = Handler()
    _, address = transports(GrpcTransportConfig(tls=tls, num_attempts=1), handler)
    cs = _chunks(b"\2" * 8192, 4096)
    client = transports(GrpcTransportConfig(tls=TlsConfig(ca_path=pki["ca.pem"])))
    assert client.push(address, cs, timeout_s=5) == 2
    with pytest.raises(PeerUnavailable):
        transports(GrpcTransportConfig(num_attempts=1)).push(address, cs, timeout_s=5)
    assert handler.num_chunks == 2


@pytest.mark.timeout(30)
def test_mutual_tls_needs_a_client_certificate_from_the_ca(transports, pki) -> None:
    site = dict(cert_path=pki["site.pem"], key_path=pki["site.key"], ca_path=pki["ca.pem"], mutual=True)
    handler = Handler()
    _, address = transports(GrpcTransportConfig(tls=TlsConfig(**site), token=TOKEN), handler)
    cs = _chunks(b"\3" * 8192, 4096)
    assert transports(GrpcTransportConfig(tls=TlsConfig(**site), token=TOKEN)).push(address, cs, timeout_s=5) == 2
    no_cert = GrpcTransportConfig(tls=TlsConfig(ca_path=pki["ca.pem"]), token=TOKEN, num_attempts=1)
    rogue = GrpcTransportConfig(
        tls=TlsConfig(cert_path=pki["rogue.pem"], key_path=pki["rogue.key"], ca_path=pki["ca.pem"], mutual=True),
        token=TOKEN,
        num_attempts=1,
    )
    for cfg in (no_cert, rogue):
        with pytest.raises(PeerUnavailable):  # the handshake fails: the server is unreachable to it
            transports(cfg).push(address, cs, timeout_s=5)
    assert handler.num_chunks == 2
    # The rendezvous shares the helpers: the same mTLS config serves it.
    from dtrain.rendezvous import RendezvousConfig, RendezvousCore

    with serve_rendezvous(
        RendezvousCore(RendezvousConfig()), GrpcTransportConfig(tls=TlsConfig(**site), token=TOKEN)
    ) as rdv:
        with GrpcRendezvousClient(rdv.address, tls=TlsConfig(**site), token=TOKEN) as rc:
            assert rc.join("site-a", address).next_round == 0
        with GrpcRendezvousClient(rdv.address, config=no_cert) as rc, pytest.raises(RendezvousError):
            rc.join("site-x", "127.0.0.1:1")


# --------------------------------------------------------------------------- keepalive


class _StateLog:
    def __init__(self, channel: grpc.Channel) -> None:
        self.states: list[grpc.ChannelConnectivity] = []
        self._channel = channel
        channel.subscribe(self.states.append, try_to_connect=False)

    def close(self) -> None:
        self._channel.unsubscribe(self.states.append)


@pytest.mark.timeout(40)
def test_idle_channel_survives_keepalive_pings_and_a_strict_server_would_not(transports) -> None:
    """Client pings every 1 s for 5 idle seconds. A server configured with the
    same keepalive values accepts them (no GOAWAY, the channel stays READY); a
    server left at gRPC's 5-minute minimum ping interval sends "too_many_pings"
    and drops the channel, which shows the check can fail."""
    fast = GrpcTransportConfig(keepalive_time_ms=1000, keepalive_timeout_ms=1000, server_min_ping_interval_ms=500)
    strict = GrpcTransportConfig(keepalive_time_ms=300_000, server_min_ping_interval_ms=300_000)
    good_handler, bad_handler = Handler(), Handler()
    _, good_addr = transports(fast, good_handler)
    _, bad_addr = transports(strict, bad_handler)
    client = transports(fast)
    cs = _chunks(b"\4" * 4096, 4096)
    assert client.push(good_addr, cs, timeout_s=5) == 1
    assert client.push(bad_addr, cs, timeout_s=5) == 1
    (good_ch,), (bad_ch,) = client.channels(good_addr), client.channels(bad_addr)
    good_log, bad_log = _StateLog(good_ch), _StateLog(bad_ch)
    time.sleep(5.0)  # idle: no calls in flight, only keepalive pings
    good_log.close()
    bad_log.close()
    assert set(good_log.states) <= {grpc.ChannelConnectivity.READY}, good_log.states
    assert any(s != grpc.ChannelConnectivity.READY for s in bad_log.states), bad_log.states
    assert client.push(good_addr, cs, timeout_s=5) == 1  # works at once after the idle phase
    assert good_handler.num_chunks == 2


# --------------------------------------------------------------------------- retries and channels


@pytest.mark.timeout(30)
def test_unavailable_is_retried_until_the_peer_comes_up(transports, caplog) -> None:
    port = _free_port()
    handler = Handler()
    cfg = GrpcTransportConfig(num_attempts=50, retry_initial_backoff_s=0.05, retry_max_backoff_s=0.2)
    late_server = GrpcTransport(GrpcTransportConfig(bind_port=port))
    timer = threading.Timer(0.8, late_server.start, args=(handler,))
    client = transports(cfg)
    caplog.set_level(logging.DEBUG, logger="dtrain.transports.grpc_common")
    t0 = time.monotonic()
    timer.start()
    try:
        assert client.push(f"127.0.0.1:{port}", _chunks(b"\5" * 4096, 1024), timeout_s=10) == 4
    finally:
        timer.cancel()
        late_server.stop(0)
    assert time.monotonic() - t0 >= 0.7
    assert handler.num_chunks == 4
    assert sum("UNAVAILABLE" in r.getMessage() and "retry" in r.getMessage() for r in caplog.records) >= 1


@pytest.mark.timeout(30)
def test_only_unavailable_is_retried_and_never_past_the_deadline(transports) -> None:
    cfg = GrpcTransportConfig(num_attempts=10, retry_initial_backoff_s=0.05, retry_max_backoff_s=0.05)
    handler = Handler()
    _, address = transports(cfg, handler)
    client = transports(cfg)
    handler.reject = (RejectCode.FAILED_PRECONDITION, "round 3 is finalized")
    with pytest.raises(Rejected):
        client.push(address, _chunks(b"\6" * 1024, 1024), timeout_s=5)
    with pytest.raises(Rejected):
        client.pull_mean(address, 3, 0, requester="a", timeout_s=5)
    handler.reject = None
    with pytest.raises(PeerTimeout):  # the owner's "not final" answer
        client.pull_mean(address, 3, 0, requester="a", timeout_s=1)
    assert handler.calls == [("push", 0), ("mean", 3, 0), ("mean", 3, 0)]  # each tried once

    # A handler that overruns is cut at the caller's deadline.
    handler.block_s = 3.0
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout):
        client.pull_mean(address, 3, 0, requester="a", timeout_s=0.8)
    assert time.monotonic() - t0 < 1.5

    # Unreachable with a huge attempt budget: retries stop at the deadline.
    patient = transports(GrpcTransportConfig(num_attempts=100, retry_initial_backoff_s=0.2, retry_max_backoff_s=0.2))
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable):
        patient.pull_state(f"127.0.0.1:{_free_port()}", 0, requester="a", timeout_s=1.0)
    assert 0.5 <= time.monotonic() - t0 < 1.5


@pytest.mark.timeout(30)
def test_a_call_past_its_deadline_renews_the_connection_and_the_old_one_closes_later(transports) -> None:
    """A pull that ran out of its deadline (its TCP connection may sit in retransmission
    back-off at 30% loss) renews the channel: the next call to that peer opens a new
    connection, and the old channel is closed renew_after_timeout_s later. A refusal renews
    nothing; with renewal off (0) the channel stays."""
    handler = Handler()
    _, address = transports(handler=handler)
    client = transports(GrpcTransportConfig(renew_after_timeout_s=0.5))
    client.push(address, _chunks(b"\7" * 1024, 1024), timeout_s=5)
    (first,) = client.channels(address)
    handler.reject = (RejectCode.FAILED_PRECONDITION, "round 3 is finalized")
    with pytest.raises(Rejected):
        client.pull_mean(address, 3, 0, requester="a", timeout_s=5)
    assert client.channels(address) == (first,)  # an answer, not a stall
    handler.reject, handler.block_s = None, 3.0
    with pytest.raises(PeerTimeout):
        client.pull_mean(address, 3, 0, requester="a", timeout_s=0.5)
    (second,) = client.channels(address)
    assert second is not first
    handler.block_s = 0.0
    assert client.push(address, _chunks(b"\7" * 1024, 1024), timeout_s=5) == 1  # on the new connection
    time.sleep(1.0)
    with pytest.raises(ValueError, match="closed channel"):  # the old one closed 0.5 s after
        first.unary_unary("/dtrain.v1.Peer/PullMean")(b"", timeout=1)
    keep = transports(GrpcTransportConfig(renew_after_timeout_s=0))
    keep.push(address, _chunks(b"\7" * 1024, 1024), timeout_s=5)
    (only,) = keep.channels(address)
    handler.block_s = 3.0
    with pytest.raises(PeerTimeout):
        keep.pull_mean(address, 3, 0, requester="a", timeout_s=0.5)
    assert keep.channels(address) == (only,)


@pytest.mark.timeout(30)
def test_several_channels_per_peer_are_used_round_robin(transports) -> None:
    handler = Handler()
    _, address = transports(handler=handler)
    client = transports(GrpcTransportConfig(num_channels_per_peer=3))
    assert client.push(address, _chunks(b"\7" * 1024, 1024), timeout_s=5) == 1
    channels = client.channels(address)
    assert len(channels) == 3
    logs = [_StateLog(ch) for ch in channels]
    for _ in range(3):
        assert client.push(address, _chunks(b"\7" * 1024, 1024), timeout_s=5) == 1
    for log in logs:
        log.close()
    # every channel has connected (its own subchannel), not just the first one
    assert all(grpc.ChannelConnectivity.READY in log.states for log in logs), [log.states for log in logs]
    assert handler.num_chunks == 4


class PartsHandler(Handler):
    """A :class:`Handler` that records how each push stream ended."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: list[tuple[str, int, int, tuple[int, int]]] = []

    def handle_push_ended(self, sender, round, num_accepted, *, at_deadline=False, part=(0, 1)) -> None:
        with self.lock:
            self.ended.append((sender, round, num_accepted, part))


@pytest.mark.timeout(30)
def test_a_push_goes_as_one_stream_per_channel_each_marked_as_its_part(transports) -> None:
    """With 3 channels per peer one push of 7 chunks goes as 3 streams at once, one per
    connection (all 3 connect within that one push), each a consecutive slice marked i/3:
    the owner gets every chunk once and hears each part end; with 1 channel, one unmarked
    stream."""
    handler = PartsHandler()
    _, address = transports(handler=handler)
    client = transports(GrpcTransportConfig(num_channels_per_peer=3))
    chunks = _chunks(bytes(range(256)) * 28, 1024)  # 7 chunks
    assert client.push(address, chunks, timeout_s=5) == 7
    logs = [_StateLog(ch) for ch in client.channels(address)]  # each says its state at once
    time.sleep(0.2)
    for log in logs:
        log.close()
    assert len(logs) == 3 and all(log.states[-1:] == [grpc.ChannelConnectivity.READY] for log in logs)
    assert sorted(c for _, c in handler.calls) == list(range(7))
    assert sorted(handler.ended, key=lambda e: e[3]) == [
        ("site-a", 1, 3, (0, 3)),
        ("site-a", 1, 2, (1, 3)),
        ("site-a", 1, 2, (2, 3)),
    ]
    one = transports(GrpcTransportConfig(num_channels_per_peer=1))
    handler.ended.clear()
    assert one.push(address, chunks, timeout_s=5) == 7
    assert handler.ended == [("site-a", 1, 7, (0, 1))]
    # a refusal in any stream is the push's error, raised once every stream ended
    handler.reject = ("FAILED_PRECONDITION", "round 1 is closed")
    with pytest.raises(Rejected, match="round 1 is closed") as info:
        client.push(address, chunks, timeout_s=5)
    assert info.value.code == RejectCode.FAILED_PRECONDITION
    assert sum(c[0] == "push" for c in handler.calls) == 2 * 7 + 3  # each of the 3 streams' first chunk refused
    # nobody listening: every stream gives up, and the push says the peer is unavailable
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable):
        client.push(f"127.0.0.1:{_free_port()}", chunks, timeout_s=3)
    assert time.monotonic() - t0 < 10


def test_push_parts_are_consecutive_nonempty_slices_of_about_equal_bytes() -> None:
    cs = _chunks(bytes(10 * 1024 + 512), 1024)  # 10 chunks of 1,024 B and one of 512
    for k in (1, 2, 3, 4, 11, 64):
        parts = push_parts(cs, k)
        assert len(parts) == min(k, len(cs)) and all(parts)
        assert [c for p in parts for c in p] == cs  # order kept, nothing twice
        sizes = [sum(len(c.payload) for c in p) for p in parts]
        assert max(sizes) - min(sizes) <= 2 * 1024, (k, sizes)  # within two chunks of each other
    assert push_parts(cs[:2], 8) == [cs[:1], cs[1:2]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["3/2", "0/0", "x/2", "1/65", "-1/2", "1"])
def test_a_malformed_push_part_is_refused_naming_the_metadata(transports, bad) -> None:
    handler = PartsHandler()
    _, address = transports(handler=handler)
    with grpc.insecure_channel(address) as ch:
        push = ch.stream_unary("/dtrain.v1.Peer/Push", request_serializer=None, response_deserializer=None)
        from dtrain.transports.grpc_wire import encode_contribution

        with pytest.raises(grpc.RpcError) as info:
            push(
                iter([encode_contribution(_chunks(b"\7" * 1024, 1024)[0])]),
                timeout=5,
                metadata=((PUSH_PART_METADATA_KEY, bad),),
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert PUSH_PART_METADATA_KEY in info.value.details() and repr(bad) in info.value.details()
    assert handler.num_chunks == 0 and handler.ended == []


@pytest.mark.timeout(30)
def test_pulls_waiting_for_finalization_do_not_starve_pushes(transports) -> None:
    handler = Handler()
    handler.mean = BucketMean(round=1, bucket=0, owner="b", chunks=(), checksum_before="", checksum_after="")
    handler.block_s = 1.5  # every pull waits in the handler, holding a server thread
    _, address = transports(GrpcTransportConfig(num_server_threads=16), handler)
    client = transports()
    results: list[object] = []
    pullers = [
        threading.Thread(target=lambda: results.append(client.pull_mean(address, 1, 0, requester="a", timeout_s=10)))
        for _ in range(8)
    ]
    for t in pullers:
        t.start()
    while sum(c[0] == "mean" for c in handler.calls) < 8:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert client.push(address, _chunks(b"\x08" * 4096, 1024), timeout_s=5) == 4
    assert time.monotonic() - t0 < 1.0  # served while all 8 pulls still wait
    for t in pullers:
        t.join(10)
    assert results == [handler.mean] * 8


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="part_bytes"):
        GrpcTransportConfig(max_message_bytes=128 * 1024, part_bytes=128 * 1024)
    with pytest.raises(ValueError, match="server_min_ping_interval_ms"):
        GrpcTransportConfig(keepalive_time_ms=10_000, server_min_ping_interval_ms=20_000)
    with pytest.raises(ValueError, match="num_channels_per_peer"):
        GrpcTransportConfig(num_channels_per_peer=0)
    with pytest.raises(ValueError, match=r"num_channels_per_peer \(9\) must be <= max_streams_per_sender \(8\)"):
        GrpcTransportConfig(num_channels_per_peer=9)
    assert GrpcTransportConfig(num_channels_per_peer=9, max_streams_per_sender=9).num_channels_per_peer == 9
    with pytest.raises(ValueError, match="cert_path"):
        TlsConfig(cert_path="/nonexistent.pem", key_path="/nonexistent.key")
    assert "s3cret" not in repr(GrpcTransportConfig(token="s3cret"))


# --------------------------------------------------------------------------- rendezvous


@pytest.mark.timeout(30)
def test_rendezvous_long_poll_quorum_timeout_and_restart() -> None:
    from dtrain.rendezvous import RendezvousConfig, RendezvousCore

    rcfg = RendezvousConfig(min_sites=1, initial_sites=2, quorum_timeout_s=0.5, heartbeat_timeout_s=5)
    port = _free_port()
    server = serve_rendezvous(RendezvousCore(rcfg), GrpcTransportConfig(bind_port=port, token=TOKEN), tick_s=0.05)
    client = GrpcRendezvousClient(server.address, token=TOKEN)
    try:
        assert client.join("site-a", "127.0.0.1:1001").members == ()
        info = client.join("site-b", "127.0.0.1:1002")
        assert [m.site_id for m in info.members] == ["site-a"] and info.needs_state is False
        # site-b never says ready: site-a's long poll is answered when the quorum timeout
        # expires, with no other call arriving (the server re-evaluates on its own).
        t0 = time.monotonic()
        d = client.ready("site-a", 0, timeout_s=5)
        elapsed = time.monotonic() - t0
        assert d.status == "plan" and d.plan.site_ids == ("site-a",), d
        assert 0.4 <= elapsed < 2.0
        # no round observed yet: the start bound of the derived deadlines, and why, in the plan
        assert d.plan.reduce_timeout_s == rcfg.start_deadlines().reduce_timeout_s == 10.0
        assert "reduce 10.00s (start bound" in d.plan.deadline_reason
        late = client.ready("site-b", 0, timeout_s=1)
        assert late.status == "missed" and late.next_round == 1
        hb = client.heartbeat("site-a", inner_step=7, last_loss=2.5)
        assert hb.known and not hb.resync_required and hb.next_round == 1 and hb.dead == ()
        client.leave("site-b")
        assert client.heartbeat("site-a").dead == ("site-b",)  # the reply carries who is gone
        # No decision within the wait (the core keeps answering "wait" to a site it
        # does not know): "wait" comes back at the timeout, not before.
        t0 = time.monotonic()
        w = client.ready("site-unknown", 1, timeout_s=0.6)
        assert w.status == "wait" and w.reason and 0.5 <= time.monotonic() - t0 < 3.0
        with pytest.raises(RendezvousError, match="UNAUTHENTICATED"):
            GrpcRendezvousClient(server.address, token="wrong").join("site-x", "127.0.0.1:1")

        # Restart on the same port with a fresh core: the same client re-registers.
        server.stop(0)
        with pytest.raises(RendezvousError):
            GrpcRendezvousClient(server.address, token=TOKEN, rpc_timeout_s=0.5).heartbeat("site-a")
        server = serve_rendezvous(RendezvousCore(rcfg), GrpcTransportConfig(bind_port=port, token=TOKEN), tick_s=0.05)
        assert client.heartbeat("site-a").known is False
        assert client.join("site-a", "127.0.0.1:1001").next_round == 0
    finally:
        client.close()
        server.stop(0)


@pytest.mark.timeout(10)
def test_unreachable_rendezvous_raises_rendezvous_error_quickly() -> None:
    client = GrpcRendezvousClient(f"127.0.0.1:{_free_port()}", rpc_timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="UNAVAILABLE"):
        client.join("site-a", "127.0.0.1:1")
    with pytest.raises(RendezvousError):
        client.ready("site-a", 0, timeout_s=5)
    assert time.monotonic() - t0 < 4.0
    client.close()


# --------------------------------------------------------------------------- wire format


def test_wire_encoding_is_plain_peer_proto() -> None:
    """grpc_wire's bytes are peer.proto messages, both ways."""
    from dtrain.transports import grpc_wire as w

    c = Contribution(
        round=3, bucket=7, chunk=2, offset=512, numel=256, codec="int8+zstd", sender="site-α", payload=b"\xff" * 300
    )
    m = pb.ContributionChunk.FromString(w.encode_contribution(c))
    assert (m.round, m.bucket, m.chunk, m.offset, m.numel, m.codec, m.sender, m.payload) == (
        3, 7, 2, 512, 256, "int8+zstd", "site-α", b"\xff" * 300
    )  # fmt: skip
    assert w.decode_contribution(m.SerializeToString()) == c
    assert w.decode_contribution(w.encode_contribution(Contribution(**{**c.__dict__, "payload": b""}))).payload == b""

    mean = BucketMean(
        round=3,
        bucket=7,
        owner="site-b",
        chunks=(
            MeanChunk(chunk=0, offset=0, numel=10, codec="fp32", payload=bytes(range(40)), senders=("a", "b")),
            MeanChunk(chunk=1, offset=10, numel=0, codec="fp32", payload=b"", senders=()),
            MeanChunk(chunk=2, offset=10, numel=3, codec="fp16", payload=b"\1\2\3\4\5\6", senders=("b",)),
        ),
        checksum_before="c1",
        checksum_after="c2",
    )
    wire = list(w.mean_to_wire(mean, part_bytes=16))
    parts = [pb.MeanPart.FromString(x) for x in wire]
    assert len(parts) == 3 + 1 + 1 and parts[0].header.num_chunks == 3 and all(len(p.data) <= 16 for p in parts)
    assert w.mean_from_wire(wire) == mean
    assert w.mean_from_wire(p.SerializeToString() for p in parts) == mean  # what protobuf itself writes

    state = BucketState(
        bucket=7, rounds_applied=4, theta=bytes(100), optimizer_state=b"\2" * 33, checksum="s", extra={"x": 1}
    )
    swire = list(w.state_to_wire(state, part_bytes=32))
    assert w.state_from_wire(pb.StatePart.FromString(x).SerializeToString() for x in swire) == state
    assert [pb.StatePart.FromString(x).WhichOneof("data") for x in swire] == ["theta"] * 4 + ["optimizer_state"] * 2


def test_malformed_streams_and_messages_are_rejected_as_invalid_argument(transports) -> None:
    from dtrain.transports import grpc_wire as w

    mean = BucketMean(
        round=1, bucket=0, owner="o", chunks=(MeanChunk(chunk=0, offset=0, numel=2, codec="fp32", payload=bytes(8), senders=("a",)),),
        checksum_before="", checksum_after="",
    )  # fmt: skip
    good = list(w.mean_to_wire(mean, part_bytes=4))
    bad_streams = {
        "empty stream": [],
        "the first part has no header": good[1:],
        "a second header": good + good[:1],
        "longer than announced": good + [pb.MeanPart(data=b"x").SerializeToString()],
        "has 4 bytes, announced 8": good[:1],
        "claims 4 bytes, 1 left": [good[0][:-3]],
    }
    for why, stream in bad_streams.items():
        with pytest.raises(Rejected, match=why) as info:
            w.mean_from_wire(stream)
        assert info.value.code == RejectCode.INVALID_ARGUMENT

    # Garbage on Push from a client of the generated stub: refused, handler never called.
    handler = Handler()
    _, address = transports(handler=handler)
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary("/dtrain.v1.Peer/Push", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as rpc:
            push(iter([b"\x42\xff\xff\xff\x0f"]), timeout=5)  # a payload field claiming 32 MiB, 0 present
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert handler.calls == []
