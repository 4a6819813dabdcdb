"""Python's cyclic garbage collector, run between rounds instead of inside them.

A site process holds a few hundred thousand long-lived objects that the cyclic collector
tracks (torch modules and their parameters' Python wrappers, the bucket layout's chunk
tuples, imported modules). CPython's automatic collector walks all of them in every
generation-2 collection, which it starts whenever enough objects have survived younger
collections: on the datagram path, where a round makes and frees ~11,500 datagram objects
per site, that was every round or two, at a random point of the round. A collection holds
the GIL, so every thread of the site stops with it: the pacer, the receive thread (whose
socket buffer then overflows), the owner's finalizer. Measured on the datagram experiment
(``experiments/datagram_vs_grpc.py --quick``, 4 sites, ~320,000 tracked objects per site):
generation-2 collections of 0.16-0.71 s, about one per site and round, and rounds whose start
was late by up to 0.76 s because of one (docs/DECISIONS.md, "Garbage collection between rounds").

:class:`RoundCollector` does what torchtitan's ``GarbageCollection`` does
(``torchtitan/tools/utils.py``, its ``training.gc_freq``): automatic collection off, one
collection at a known point of the loop. Here that point is right after a round closes
(before the next inner phase), and the objects that exist after set-up are frozen first
(``gc.freeze``: moved to a permanent generation that no collection walks), so the collection
between rounds walks only what the rounds made. Cycles still get collected, just not inside
a round; memory that only a cycle holds lives until the next round boundary at most
(``every_rounds`` boundaries with a larger setting).

The collector's state is process-wide: several workers in one process (tests, in-process
experiments) share it; the first :meth:`RoundCollector.start` turns automatic collection
off and the last :meth:`RoundCollector.close` turns it back on as it was.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

__all__ = ["RoundCollector"]

log = logging.getLogger(__name__)

_state_lock = threading.Lock()
_users = 0  # RoundCollectors started and not closed, in this process
_was_enabled = True  # gc.isenabled() before the first of them started


class RoundCollector:
    """Cyclic garbage collection between rounds (see the module docstring).

    Args:
        every_rounds: collect after every ``every_rounds``-th round, an int >= 0 (1: after
            every round); 0 leaves Python's automatic collector as it is (no freeze, no
            collection here).
        site: this site's id, for the log lines.

    Raises:
        ValueError: ``every_rounds`` is not an int >= 0 (the message names the field).
    """

    def __init__(self, every_rounds: int, *, site: str = "") -> None:
        if not isinstance(every_rounds, int) or isinstance(every_rounds, bool) or every_rounds < 0:
            raise ValueError(
                f"gc_every_rounds must be an int >= 0 (0: Python's automatic collector), got {every_rounds!r}"
            )
        self.every_rounds = every_rounds
        self.site = site
        self.collections = 0  # collections this object ran
        self._started = False

    def start(self) -> None:
        """After set-up: collect once, freeze what survived, turn automatic collection off.
        Does nothing when ``every_rounds`` is 0 or it already started."""
        global _users, _was_enabled
        if not self.every_rounds or self._started:
            return
        with _state_lock:
            if _users == 0:
                _was_enabled = gc.isenabled()
                t = time.perf_counter()
                gc.collect()
                gc.freeze()
                gc.disable()
                log.info(
                    "%s: automatic garbage collection off; %d objects frozen in %.3f s, collected after every %d round(s)",
                    self.site,
                    gc.get_freeze_count(),
                    time.perf_counter() - t,
                    self.every_rounds,
                )
            _users += 1
        self._started = True

    def after_round(self, rounds_done: int) -> float:
        """Call when a round has closed (``rounds_done`` rounds so far at this site): collects
        every generation when ``rounds_done`` is a multiple of ``every_rounds``. Returns the
        seconds the collection took (0.0 when none ran)."""
        if not self._started or rounds_done % self.every_rounds:
            return 0.0
        t = time.perf_counter()
        found = gc.collect()
        dt = time.perf_counter() - t
        self.collections += 1
        log.debug(
            "%s: garbage collection after round %d: %d objects freed in %.3f s", self.site, rounds_done, found, dt
        )
        return dt

    def close(self) -> None:
        """Undo :meth:`start` (the last open collector of the process turns automatic
        collection back on, if it was on, and unfreezes). Idempotent."""
        global _users
        if not self._started:
            return
        self._started = False
        with _state_lock:
            _users -= 1
            if _users == 0:
                gc.unfreeze()
                if _was_enabled:
                    gc.enable()
