"""The servers' limits and health service (issue 13): the standard
``grpc.health.v1`` service on the Peer server and the rendezvous, RESOURCE_EXHAUSTED
at once past ``max_concurrent_rpcs`` and ``max_streams_per_sender``, the idle
Push timeout, the server-side cap on waits, and a newer Ready superseding the
oldest of one site id."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtrain._proto.dtrain.v1 import rendezvous_pb2
from dtrain.errors import RejectCode, Rejected, RendezvousError
from dtrain.protocol import BucketMean, Contribution
from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.grpc import GrpcRendezvousClient, serve_rendezvous
from dtrain.transports.grpc import PEER_SERVICE, GrpcTransport, GrpcTransportConfig
from dtrain.transports.grpc_wire import encode_contribution

TOKEN = "limits-test-token"
META = (("dtrain-token", TOKEN),)
SERVING = health_pb2.HealthCheckResponse.SERVING


class Handler:
    """Accepts every chunk; records the wait each mean pull was given."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.num_chunks = 0
        self.pull_timeouts: list[float] = []

    def handle_contribution(self, c: Contribution) -> None:
        with self.lock:
            self.num_chunks += 1

    def handle_pull_mean(
        self, round: int, bucket: int, requester: str, timeout_s: float, *, have_checksum: str = ""
    ) -> BucketMean:
        with self.lock:
            self.pull_timeouts.append(timeout_s)
        return BucketMean(round=round, bucket=bucket, owner="o", chunks=(), checksum_before="", checksum_after="")

    def handle_pull_state(self, bucket: int, requester: str):
        raise NotImplementedError


def _chunk(sender: str, chunk: int = 0) -> bytes:
    c = Contribution(round=0, bucket=0, chunk=chunk, offset=0, numel=1, codec="fp32", sender=sender, payload=bytes(4))
    return encode_contribution(c)


class Streams:
    """Raw Push streams that send ``first`` (or nothing) and then idle until closed."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.push = self.channel.stream_unary("/dtrain.v1.Peer/Push")
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []

    def _requests(self, first: bytes | None) -> Iterator[bytes]:
        if first is not None:
            yield first
        self.release.wait(30)

    def open(self, first: bytes | None = None, timeout_s: float = 30.0) -> grpc.Future:
        call = self.push.future(self._requests(first), timeout=timeout_s, metadata=META)
        self.calls.append(call)
        return call

    def close(self) -> None:
        self.release.set()
        for c in self.calls:
            c.cancel()
        self.channel.close()


def _wait_until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _check(address: str, service: str = "", token: bool = False) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest(service=service)
        return stub.Check(req, timeout=5, metadata=META if token else None).status


@pytest.mark.timeout(30)
def test_health_service_on_the_peer_server_and_the_rendezvous() -> None:
    peer = GrpcTransport(GrpcTransportConfig(token=TOKEN))
    address = peer.start(Handler())
    rdv = serve_rendezvous(RendezvousCore(RendezvousConfig()), GrpcTransportConfig(token=TOKEN))
    try:
        # Check needs no token (orchestrators' probes send no metadata)
        assert _check(address) == SERVING and _check(address, PEER_SERVICE) == SERVING
        assert _check(rdv.address) == SERVING and _check(rdv.address, "dtrain.v1.Rendezvous") == SERVING
        assert _check(address, token=True) == SERVING
        with pytest.raises(grpc.RpcError) as e:
            _check(address, "dtrain.v1.NoSuchService")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # Watch (a stream) needs the token
        with grpc.insecure_channel(rdv.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5, metadata=META)
            assert next(watch).status == SERVING
            watch.cancel()
    finally:
        peer.stop(0)
        rdv.stop(0)
    with pytest.raises(grpc.RpcError) as e:
        _check(address)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(30)
def test_a_sender_past_max_streams_per_sender_is_refused_at_once() -> None:
    handler = Handler()
    server = GrpcTransport(GrpcTransportConfig(token=TOKEN, max_streams_per_sender=3))
    address = server.start(handler)
    streams = Streams(address)
    try:
        held = [streams.open(_chunk("mallory", i)) for i in range(3)]
        _wait_until(lambda: handler.num_chunks == 3, 10, "3 streams to deliver their first chunk")
        with pytest.raises(grpc.RpcError) as e:
            streams.open(_chunk("mallory", 9)).result(timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'mallory' already has 3 Push calls open" in e.value.details()
        # another sender is not affected, and a stream of one sender stays one sender's
        with pytest.raises(grpc.RpcError) as e:
            streams.push(iter([_chunk("alice"), _chunk("mallory", 1)]), timeout=10, metadata=META)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one sender" in e.value.details()
        assert not any(c.done() for c in held)
        # a closed stream frees its slot
        held[0].cancel()
        _wait_until(lambda: held[0].done(), 5, "the cancel")
        _wait_until(lambda: _push_once(streams, "mallory"), 10, "mallory's slot to be freed")
    finally:
        streams.close()
        server.stop(0)


def _push_once(streams: Streams, sender: str) -> bool:
    try:
        return streams.push(iter([_chunk(sender, 5)]), timeout=5, metadata=META) is not None
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        return False


@pytest.mark.timeout(30)
def test_a_full_server_answers_resource_exhausted_at_once_and_idle_streams_are_ended() -> None:
    handler = Handler()
    cfg = GrpcTransportConfig(token=TOKEN, max_concurrent_rpcs=4, stream_idle_timeout_s=1.5)
    server = GrpcTransport(cfg)
    address = server.start(handler)
    streams = Streams(address)
    client = GrpcTransport(GrpcTransportConfig(token=TOKEN, num_attempts=1))
    try:
        idle = [streams.open() for _ in range(4)]  # no message: pre-first-message streams
        time.sleep(0.3)
        with pytest.raises(Rejected) as e:
            client.pull_mean(address, 0, 0, requester="alice", timeout_s=10)
        assert e.value.code == RejectCode.RESOURCE_EXHAUSTED, e.value
        # the idle streams are ended by the server (DEADLINE_EXCEEDED, with the reason) ...
        for call in idle:
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "idle for 1.5 s (stream_idle_timeout_s)" in err.value.details()
        # ... which frees their slots
        assert client.pull_mean(address, 0, 0, requester="alice", timeout_s=10).round == 0
    finally:
        streams.close()
        client.stop(0)
        server.stop(0)


@pytest.mark.timeout(30)
def test_waits_are_capped_on_the_server() -> None:
    handler = Handler()
    server = GrpcTransport(GrpcTransportConfig(max_wait_ms=200))
    address = server.start(handler)
    client = GrpcTransport(GrpcTransportConfig())
    rdv = serve_rendezvous(
        RendezvousCore(RendezvousConfig(min_sites=2)), GrpcTransportConfig(max_wait_ms=300), tick_s=0.05
    )
    rc = GrpcRendezvousClient(rdv.address)
    try:
        client.pull_mean(address, 0, 0, requester="a", timeout_s=60)
        assert 0 < handler.pull_timeouts[0] <= 0.2  # asked for 60 s
        rc.join("site-a", "127.0.0.1:1")
        d = rc.ready("site-a", 0, timeout_s=60)  # min_sites=2: no plan; answered "wait" at the cap
        assert d.status == "wait" and "waits for 2 sites" in d.reason, d
    finally:
        rc.close()
        rdv.stop(0)
        client.stop(0)
        server.stop(0)


@pytest.mark.timeout(30)
def test_a_newer_ready_supersedes_the_oldest_of_the_same_site() -> None:
    """12 long polls claiming site-a (max 8 per site id): the 4 oldest are
    answered "wait" at once; the plan formed later reaches the 8 still waiting
    and site-a's own call."""
    rcfg = RendezvousConfig(min_sites=2, initial_sites=2, quorum_timeout_s=30)
    rdv = serve_rendezvous(RendezvousCore(rcfg), GrpcTransportConfig(token=TOKEN), tick_s=0.05)
    a = GrpcRendezvousClient(rdv.address, token=TOKEN)
    b = GrpcRendezvousClient(rdv.address, token=TOKEN)
    channel = grpc.insecure_channel(rdv.address)
    ready = channel.unary_unary(
        "/dtrain.v1.Rendezvous/Ready",
        request_serializer=rendezvous_pb2.ReadyRequest.SerializeToString,
        response_deserializer=rendezvous_pb2.ReadyReply.FromString,
    )
    try:
        a.join("site-a", "127.0.0.1:1")
        b.join("site-b", "127.0.0.1:2")
        req = rendezvous_pb2.ReadyRequest(site_id="site-a", round=0, wait_ms=20_000)
        polls = []
        for _ in range(12):
            polls.append(ready.future(req, timeout=25, metadata=META))
            time.sleep(0.02)  # in order
        _wait_until(lambda: sum(p.done() for p in polls) >= 4, 10, "4 polls superseded")
        time.sleep(0.2)
        assert [p.done() for p in polls] == [True] * 4 + [False] * 8
        assert {p.result().status for p in polls[:4]} == {"wait"}
        d = b.ready("site-b", 0, timeout_s=10)
        assert d.status == "plan" and d.plan.site_ids == ("site-a", "site-b"), d
        assert [p.result(timeout=10).status for p in polls[4:]] == ["plan"] * 8
        assert a.ready("site-a", 0, timeout_s=5).status == "plan"
    finally:
        channel.close()
        a.close()
        b.close()
        rdv.stop(0)


def test_new_limits_are_validated_naming_the_field() -> None:
    for field, bad in (
        ("max_concurrent_rpcs", 0),
        ("max_streams_per_sender", 0),
        ("max_wait_ms", 1),
        ("stream_idle_timeout_s", 0.0),
        ("num_server_threads", 1),
    ):
        with pytest.raises(ValueError, match=field):
            GrpcTransportConfig(**{field: bad})


class _FreezableProxy:
    """A TCP forwarder on 127.0.0.1 whose connections can be frozen one by one (bytes stop
    flowing both ways, the sockets stay open): a connection stalled as on a lossy link."""

    def __init__(self, target: str) -> None:
        import socket

        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.frozen: set[int] = set()
        self.num_accepted = 0
        self._socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                a, _ = self._listener.accept()
            except OSError:
                return
            b = socket.create_connection(self._target)
            i, self.num_accepted = self.num_accepted, self.num_accepted + 1
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(i, src, dst), daemon=True).start()

    def _pump(self, i: int, src, dst) -> None:
        while True:
            try:
                data = src.recv(65536)
                while i in self.frozen:
                    time.sleep(0.01)
                if not data:
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.mark.timeout(60)
def test_heartbeats_go_on_while_the_main_rendezvous_connection_is_stalled() -> None:
    """The rendezvous client's joins and Ready long polls share one connection; its
    heartbeats have their own. With the first connection frozen (as a TCP connection stuck
    in retransmission on a 10%-loss link once was for 7.6 s, long enough for the rendezvous
    to declare the site dead), heartbeats still arrive."""
    rdv = serve_rendezvous(RendezvousCore(RendezvousConfig(min_sites=2)), GrpcTransportConfig(), tick_s=0.05)
    proxy = _FreezableProxy(rdv.address)
    rc = GrpcRendezvousClient(proxy.address, rpc_timeout_s=2.0, hedge_ready=False)
    try:
        rc.join("site-a", "127.0.0.1:1")  # the main connection: accepted first
        assert rc.heartbeat("site-a").known
        assert proxy.num_accepted == 2  # the heartbeat opened a second connection
        proxy.frozen.add(0)
        for _ in range(3):
            assert rc.heartbeat("site-a").known
        with pytest.raises(RendezvousError):  # the main connection is stalled indeed
            rc.ready("site-a", 0, timeout_s=0.2)
    finally:
        proxy.frozen.clear()
        rc.close()
        proxy.close()
        rdv.stop(0)


@pytest.mark.timeout(30)
def test_a_hedged_ready_is_answered_while_its_main_connection_is_stalled() -> None:
    """hedge_ready (the default): each Ready long poll also goes over a connection of its own,
    so a main connection stuck in TCP retransmission (a lost segment of the plan's reply) does
    not hold the site back: the other answers; the rendezvous counts the site ready once, and the
    plan reaches it with the other site's."""
    rdv = serve_rendezvous(RendezvousCore(RendezvousConfig(min_sites=2)), GrpcTransportConfig(), tick_s=0.05)
    proxy = _FreezableProxy(rdv.address)
    a = GrpcRendezvousClient(proxy.address, rpc_timeout_s=2.0)
    b = GrpcRendezvousClient(rdv.address, rpc_timeout_s=2.0)
    try:
        a.join("site-a", "127.0.0.1:1")  # connection 0: joins and the first copy of each Ready
        b.join("site-b", "127.0.0.1:2")
        proxy.frozen.add(0)
        d = a.ready("site-a", 0, timeout_s=0.2)  # the second copy opens connection 1 and answers
        assert d.status == "wait" and d.reason.startswith("1 of 2 live sites ready"), d
        assert proxy.num_accepted == 2
        stalled = a._ready_calls[0]
        for _ in range(3):  # the stalled connection gets no new call: nothing piles up behind it
            assert a.ready("site-a", 0, timeout_s=0.2).status == "wait"
            assert a._ready_calls[0] is stalled and not stalled.done()
            assert a._hedge_exec._work_queue.qsize() == 0  # no call waited for a thread
        with cf.ThreadPoolExecutor(2) as ex:
            fa = ex.submit(a.ready, "site-a", 0, 10.0)
            fb = ex.submit(b.ready, "site-b", 0, 10.0)
            da, db = fa.result(timeout=15), fb.result(timeout=15)
        assert da.status == db.status == "plan", (da, db)
        assert da.plan == db.plan and da.plan.site_ids == ("site-a", "site-b")
    finally:
        proxy.frozen.clear()
        a.close()
        b.close()
        proxy.close()
        rdv.stop(0)
