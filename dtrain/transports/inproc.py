"""In-process transport for unit tests and fast simulations.

Sites are threads of one process; a shared :class:`InprocNetwork` maps addresses
to handlers and injects seeded faults: per-contribution loss (the chunk silently
never arrives, as with a lost datagram), whole-reply loss on pulls, delay, and
failed (dead) or partitioned sites. It honours the contract of
``dtrain.transports.base`` so the round engine runs unchanged over it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dtrain.errors import PeerTimeout, PeerUnavailable
from dtrain.protocol import BucketMean, BucketState, Contribution
from dtrain.transports.base import PeerHandler, Transport

__all__ = ["InprocFaults", "FaultRule", "InprocNetwork", "InprocTransport"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class InprocFaults:
    """Seeded fault injection of an :class:`InprocNetwork`.

    Attributes:
        push_loss: probability in [0, 1) that one contribution chunk is dropped
            silently (the sender is not told, as with packet loss).
        pull_loss: probability in [0, 1) that a pulled mean never arrives (the
            caller sees ``PeerTimeout`` at once rather than at its deadline, to
            keep simulations fast).
        delay_s: one-way delay added to each call, seconds (>= 0).
        seed: RNG seed for the drops.
    """

    push_loss: float = 0.0
    pull_loss: float = 0.0
    delay_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("push_loss", "pull_loss"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s!r}")


_RULE_KINDS = ("push", "pull_mean", "pull_state")
_RULE_ACTIONS = ("drop", "kill_dst", "kill_src", "cut", "lose_reply")


@dataclass(frozen=True, kw_only=True)
class FaultRule:
    """A targeted fault: calls matching every field that is not None get ``action``.

    Attributes:
        kind: ``"push"`` (one contribution chunk), ``"pull_mean"`` or ``"pull_state"``.
        sender: site_id of the contribution's sender or of the pull's requester.
        dst: address of the destination site.
        round: round number (never matches a ``pull_state``, which has none).
        bucket: bucket index.
        action: ``"drop"``: a pushed chunk is lost silently, a pulled mean or
            state is lost (``PeerTimeout`` at once); ``"kill_dst"``: the
            destination goes down before it handles the call (as if it died at
            that moment; ``PeerUnavailable``), and down listeners are told;
            ``"kill_src"`` (``push`` only): the sending site goes down at that
            chunk (it dies mid-push; the chunk is not delivered); ``"cut"``
            (``pull_mean`` and ``pull_state``): the call never reaches the destination
            (a partition, a stalled stream) and times out after its ``timeout_s``
            (``PeerTimeout``);
            ``"lose_reply"`` (``pull_mean`` only): the destination answers (its mean
            left it) and the answer is lost: the call times out after its
            ``timeout_s`` (a reply lost on a lossy link, as a TCP stream retransmits
            until the caller's deadline).
        times: how many calls the rule applies to (None: all of them).
    """

    kind: str
    sender: str | None = None
    dst: str | None = None
    round: int | None = None
    bucket: int | None = None
    action: str = "drop"
    times: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _RULE_KINDS:
            raise ValueError(f"kind must be one of {_RULE_KINDS}, got {self.kind!r}")
        if self.action not in _RULE_ACTIONS:
            raise ValueError(f"action must be one of {_RULE_ACTIONS}, got {self.action!r}")
        if self.action == "lose_reply" and self.kind != "pull_mean":
            raise ValueError(f"action 'lose_reply' applies to kind 'pull_mean' only, got kind {self.kind!r}")
        if self.action == "cut" and self.kind == "push":
            raise ValueError("action 'cut' applies to kinds 'pull_mean' and 'pull_state' only, got kind 'push'")
        if self.action == "kill_src" and self.kind != "push":
            raise ValueError(f"action 'kill_src' applies to kind 'push' only, got kind {self.kind!r}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"times must be >= 1 or None, got {self.times!r}")

    def matches(self, kind: str, sender: str, dst: str, round: int | None, bucket: int | None) -> bool:
        return (
            self.kind == kind
            and self.sender in (None, sender)
            and self.dst in (None, dst)
            and (self.round is None or self.round == round)
            and self.bucket in (None, bucket)
        )


class InprocNetwork:
    """Registry of in-process sites plus the faults applied between them.

    Faults: random ones from :class:`InprocFaults` (seeded; which call draws
    which number depends on thread scheduling), targeted ones from
    :class:`FaultRule` (:meth:`add_rule`), and sites marked down
    (:meth:`set_down`).
    """

    def __init__(self, faults: InprocFaults | None = None) -> None:
        self.faults = faults or InprocFaults()
        self._rng = random.Random(self.faults.seed)
        self._lock = threading.Lock()
        self._handlers: dict[str, PeerHandler] = {}
        self._down: set[str] = set()
        self._next_port = 1
        self._rules: list[list] = []  # [rule, remaining or None]
        self._down_listeners: list[Callable[[str], None]] = []

    def add_rule(self, rule: FaultRule) -> None:
        """Apply ``rule`` to the calls from now on (rules are checked in order)."""
        with self._lock:
            self._rules.append([rule, rule.times])

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def add_down_listener(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(address)`` whenever a site is set down (by :meth:`set_down` or a rule)."""
        with self._lock:
            self._down_listeners.append(fn)

    def is_down(self, address: str) -> bool:
        with self._lock:
            return address in self._down

    def _rule_action(self, kind: str, sender: str, dst: str, round: int | None, bucket: int | None) -> str | None:
        with self._lock:
            for entry in self._rules:
                rule, left = entry
                if left == 0 or not rule.matches(kind, sender, dst, round, bucket):
                    continue
                if left is not None:
                    entry[1] = left - 1
                action = rule.action
                break
            else:
                return None
        log.debug("inproc: rule %s on %s %s->%s r%s b%s", action, kind, sender, dst, round, bucket)
        if action == "kill_dst":
            self.set_down(dst)
        return action

    def set_faults(self, faults: InprocFaults) -> None:
        with self._lock:
            self.faults = faults
            self._rng = random.Random(faults.seed)

    def register(self, handler: PeerHandler) -> str:
        with self._lock:
            address = f"inproc:{self._next_port}"
            self._next_port += 1
            self._handlers[address] = handler
            return address

    def unregister(self, address: str) -> None:
        with self._lock:
            self._handlers.pop(address, None)

    def set_down(self, address: str, down: bool = True) -> None:
        """Make a site unreachable (``down=True``) as if it died or was partitioned."""
        with self._lock:
            was = address in self._down
            (self._down.add if down else self._down.discard)(address)
            listeners = list(self._down_listeners) if down and not was else []
        for fn in listeners:
            fn(address)

    def _draw(self, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < p

    def _handler(self, address: str) -> PeerHandler:
        with self._lock:
            if address in self._down or address not in self._handlers:
                raise PeerUnavailable(f"{address} is not reachable")
            return self._handlers[address]


class InprocTransport(Transport):
    """One site's view of an :class:`InprocNetwork`."""

    def __init__(self, network: InprocNetwork) -> None:
        self.network = network
        self.address: str | None = None
        self._sent = 0
        self._received = 0
        self._count_lock = threading.Lock()
        self._stopped = False

    def start(self, handler: PeerHandler) -> str:
        self.address = self.network.register(handler)
        return self.address

    def _delay(self, timeout_s: float) -> None:
        d = self.network.faults.delay_s
        if d > 0:
            time.sleep(min(d, timeout_s))
            if d > timeout_s:
                raise PeerTimeout(f"one-way delay {d} s exceeds the deadline {timeout_s} s")

    def _check_self(self) -> None:
        if self._stopped:
            raise PeerUnavailable("transport stopped")
        if self.address is not None and self.address in self.network._down:
            raise PeerUnavailable(f"this site ({self.address}) is down")

    def push(
        self,
        address: str,
        contributions: Sequence[Contribution],
        *,
        timeout_s: float,
        pace: Callable[[int], None] | None = None,
    ) -> int:
        self._check_self()
        handler = self.network._handler(address)
        self._delay(timeout_s)
        accepted = 0
        for c in contributions:
            if pace is not None:
                pace(len(c.payload))
            with self._count_lock:
                self._sent += len(c.payload)
            action = self.network._rule_action("push", c.sender, address, c.round, c.bucket)
            if action == "kill_dst":
                raise PeerUnavailable(f"{address} went down (inproc rule)")
            if action == "kill_src":
                if self.address is not None:
                    self.network.set_down(self.address)
                raise PeerUnavailable(f"this site ({self.address}) went down (inproc rule)")
            if action == "drop" or self.network._draw(self.network.faults.push_loss):
                log.debug("inproc: dropped chunk r%d b%d c%d from %s", c.round, c.bucket, c.chunk, c.sender)
                accepted += 1  # the sender cannot tell a lost chunk from a delivered one
                continue
            handler.handle_contribution(c)
            accepted += 1
        return accepted

    def pull_mean(
        self, address: str, round: int, bucket: int, *, requester: str, timeout_s: float, have_checksum: str = ""
    ) -> BucketMean:
        self._check_self()
        handler = self.network._handler(address)
        action = self.network._rule_action("pull_mean", requester, address, round, bucket)
        if action == "kill_dst":
            raise PeerUnavailable(f"{address} went down (inproc rule)")
        if action == "cut":
            time.sleep(max(0.0, timeout_s))
            raise PeerTimeout(f"mean of bucket {bucket} round {round} from {address}: no answer (inproc cut)")
        t0 = time.monotonic()
        self._delay(timeout_s)
        left = max(0.0, timeout_s - (time.monotonic() - t0))
        mean = handler.handle_pull_mean(round, bucket, requester, left, have_checksum=have_checksum)
        if action == "lose_reply":
            time.sleep(max(0.0, timeout_s - (time.monotonic() - t0)))
            raise PeerTimeout(f"mean of bucket {bucket} round {round} from {address}: reply lost (inproc lose_reply)")
        if action == "drop" or self.network._draw(self.network.faults.pull_loss):
            raise PeerTimeout(f"mean of bucket {bucket} round {round} from {address} lost (inproc pull_loss)")
        with self._count_lock:
            self._received += sum(len(ch.payload) for ch in mean.chunks)
        return mean

    def pull_state(self, address: str, bucket: int, *, requester: str, timeout_s: float) -> BucketState:
        self._check_self()
        handler = self.network._handler(address)
        action = self.network._rule_action("pull_state", requester, address, None, bucket)
        if action == "kill_dst":
            raise PeerUnavailable(f"{address} went down (inproc rule)")
        if action == "cut":
            time.sleep(max(0.0, timeout_s))
            raise PeerTimeout(f"state of bucket {bucket} from {address}: no answer (inproc cut)")
        self._delay(timeout_s)
        state = handler.handle_pull_state(bucket, requester)
        if action == "drop":
            raise PeerTimeout(f"state of bucket {bucket} from {address} lost (inproc rule)")
        with self._count_lock:
            self._received += len(state.theta) + len(state.optimizer_state)
        return state

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopped = True
        if self.address is not None:
            self.network.unregister(self.address)

    def bytes_sent(self) -> int:
        with self._count_lock:
            return self._sent

    def bytes_received(self) -> int:
        with self._count_lock:
            return self._received
