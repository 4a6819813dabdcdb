"""A rogue client holding the shared token that keeps many calls in flight:
idle Push streams, pulls that wait, Ready long polls. Used by the starvation
tests; bounded in count (``keep(n, ...)``) and time (``stop()``, and every call
has a deadline)."""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import grpc

from dtrain._proto.dtrain.v1 import peer_pb2, rendezvous_pb2

CALL_TIMEOUT_S = 60.0


class RogueFlood:
    """Keeps calls in flight against one server, re-opening each one that ends."""

    def __init__(self, address: str, token: str) -> None:
        self.metadata = (("dtrain-token", token),)
        self.channel = grpc.insecure_channel(address)
        self._push = self.channel.stream_unary("/dtrain.v1.Peer/Push")
        self._pull = self.channel.unary_stream(
            "/dtrain.v1.Peer/PullMean", request_serializer=peer_pb2.PullMeanRequest.SerializeToString
        )
        self._ready = self.channel.unary_unary(
            "/dtrain.v1.Rendezvous/Ready",
            request_serializer=rendezvous_pb2.ReadyRequest.SerializeToString,
            response_deserializer=rendezvous_pb2.ReadyReply.FromString,
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._calls: list[grpc.Future] = []
        self.num_opened = 0
        self.codes: dict[str, int] = {}  # how the calls that ended ended

    # -- kinds of calls
    def _idle_requests(self) -> Iterator[bytes]:
        self._stop.wait(CALL_TIMEOUT_S)  # sends nothing until stopped
        return
        yield b""

    def idle_push(self) -> grpc.Future:
        return self._push.future(self._idle_requests(), timeout=CALL_TIMEOUT_S, metadata=self.metadata)

    def waiting_pull(self, round_of: Callable[[], int], bucket: int, requester: str) -> Callable[[], object]:
        """PullMean of round ``round_of()`` (asked anew at each re-open): a site
        waits for its next round to open, then for the bucket to finalize."""

        def open_call():
            req = peer_pb2.PullMeanRequest(round=round_of(), bucket=bucket, requester=requester, timeout_ms=60_000)
            return self._pull(req, timeout=CALL_TIMEOUT_S, metadata=self.metadata)

        return open_call

    def long_poll(self, site_id: str, round: int = 0) -> grpc.Future:
        req = rendezvous_pb2.ReadyRequest(site_id=site_id, round=round, wait_ms=60_000)
        return self._ready.future(req, timeout=CALL_TIMEOUT_S, metadata=self.metadata)

    # -- keeping n in flight
    def keep(self, n: int, open_call: Callable[[], object]) -> None:
        """Keep ``n`` calls made by ``open_call`` in flight until :meth:`stop`."""
        for _ in range(n):
            self._open(open_call)

    def _open(self, open_call: Callable[[], object]) -> None:
        if self._stop.is_set():
            return
        call = open_call()
        with self._lock:
            self.num_opened += 1
            self._calls.append(call)
        call.add_done_callback(lambda c: self._ended(c, open_call))

    def _ended(self, call, open_call: Callable[[], object]) -> None:
        try:
            code = call.code().name
        except Exception:  # noqa: BLE001 - a stream's code is read once it ended
            code = "?"
        with self._lock:
            self.codes[code] = self.codes.get(code, 0) + 1
            if call in self._calls:
                self._calls.remove(call)
        if not self._stop.is_set():
            threading.Thread(target=self._open, args=(open_call,), daemon=True).start()

    def num_in_flight(self) -> int:
        with self._lock:
            return sum(1 for c in self._calls if not c.done())

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        self.channel.close()
