"""Blocking calls fanned out over a few threads, any of which can be given up while in flight.

The broadcast step pulls every bucket's mean from its owner (a blocking transport call
with the broadcast deadline as its timeout). When the owner is declared lost meanwhile
(the rendezvous holds it dead, or rank 0's notice says so), its pulls are given up at once
instead of at the deadline: a SIGSTOPped owner's kernel still accepts the connection, so
the call would otherwise wait the whole deadline out. No transport call is cancelled: the
given-up call ends at its own timeout on a daemon thread (so it never delays the process's
exit), its answer is dropped, and a fresh thread takes its place so that the other owners'
pulls keep their concurrency.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable, Generic, Hashable, Iterable, TypeVar

__all__ = ["Fanout"]

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

_WAKE = object()


class Fanout(Generic[K, R]):
    """``call(key)`` for every key, at most ``width`` at a time (plus one per given-up call).

    Args:
        call: the blocking call; it must return by its own timeout. An exception it
            raises is handed back as the result (the key is done).
        keys: what to call it with, in order.
        width: concurrent calls (>= 1).
        name: thread name prefix.
    """

    def __init__(self, call: Callable[[K], R], keys: Iterable[K], width: int, name: str) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width!r}")
        self._call = call
        self._name = name
        self._lock = threading.Lock()
        self._todo: collections.deque[K] = collections.deque(keys)
        self._pending: set[K] = set(self._todo)  # neither answered nor given up
        self._in_flight: set[K] = set()
        self._given_up: set[K] = set()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(min(width, len(self._todo))):
            self._spawn()

    @property
    def pending(self) -> frozenset[K]:
        """The keys neither answered nor given up."""
        with self._lock:
            return frozenset(self._pending)

    def in_flight(self) -> list[K]:
        """The keys whose call runs now (not given up)."""
        with self._lock:
            return sorted(self._in_flight - self._given_up, key=repr)

    def next(self, timeout_s: float) -> tuple[K, R | BaseException] | None:
        """The next answer, ``(key, result or the exception raised)``; None when woken
        (:meth:`wake`) or after ``timeout_s`` with nothing answered. Answers of given-up
        keys are dropped."""
        while True:
            try:
                item = self._results.get(timeout=max(0.0, timeout_s))
            except queue.Empty:
                return None
            if item is _WAKE:
                return None
            key, result = item
            with self._lock:
                if key in self._given_up:
                    continue
                self._pending.discard(key)
            return key, result

    def wait(
        self, deadline: float, lost: Callable[[K], bool], on_give_up: Callable[[K, bool], None]
    ) -> list[tuple[K, R | BaseException]]:
        """Every answer, ``(key, result or the exception raised)``, in the order they came.
        Woken (:meth:`wake`), it gives up each pending key that ``lost(key)`` says is lost;
        5 s past ``deadline`` (``time.monotonic()``: a call that overran its own timeout),
        every pending key. ``on_give_up(key, late)`` is told of each."""
        answers: list[tuple[K, R | BaseException]] = []
        while self.pending:
            got = self.next(timeout_s=deadline - time.monotonic() + 5.0)
            if got is not None:
                answers.append(got)
                continue
            late = time.monotonic() > deadline + 5.0
            for key in sorted(self.pending, key=repr):
                if late or lost(key):
                    self.give_up(key)
                    on_give_up(key, late)
        return answers

    def wake(self) -> None:
        """Make a waiting :meth:`next` return None now (another thread changed what is pending)."""
        self._results.put(_WAKE)

    def give_up(self, key: K) -> None:
        """Stop waiting for ``key`` (pending or in flight): it is no longer pending; its
        answer, if its call is in flight, is dropped, and a fresh thread takes its place."""
        with self._lock:
            if key not in self._pending:
                return
            self._pending.discard(key)
            self._given_up.add(key)
            replace = key in self._in_flight and bool(self._todo)
        if replace:
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name=f"{self._name}-{len(self._given_up)}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                key = None
                while self._todo:
                    k = self._todo.popleft()
                    if k not in self._given_up:
                        key = k
                        break
                if key is None:
                    return
                self._in_flight.add(key)
            try:
                result: R | BaseException = self._call(key)
            except Exception as e:  # handed back: the caller decides what it means
                result = e
            with self._lock:
                self._in_flight.discard(key)
                abandoned = key in self._given_up
            self._results.put((key, result))
            if abandoned:  # a replacement thread took over this one's share of the work
                return
