"""Pacing, rate control and socket buffer sizing of the datagram data path.

* :class:`Pacer` (from :mod:`dtrain.transports.pacing`, shared with the round engine's
  fragment pacing): a virtual-clock token bucket shared by every sending thread of a
  site; datagrams leave at the current rate with micro-bursts of at most
  ``burst_bytes`` (the quantum Linux's fq qdisc also allows), never in unpaced bursts.
* :class:`RateController`: between rounds, from the receivers' reports of what
  arrived and over how long, picks the next round's rate: down to the estimated
  bottleneck on a congestion signal (a stretched receive window, or loss above the
  path's own random loss), up otherwise; never above ``max_rate_mbit``.
* :func:`socket_buffer_bytes`: two rate x RTT products (at least 100 ms of traffic), or
  a receive-thread stall's worth (the receive socket: ``recv_stall_s``), so a stall loses
  nothing at the socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dtrain.transports.pacing import Pacer

__all__ = ["Pacer", "RateController", "ReceiverReport", "describe_reports", "socket_buffer_bytes"]

_MIB = 1 << 20


def socket_buffer_bytes(rate_mbit: float, rtt_s: float, *, stall_s: float = 0.0) -> int:
    """SO_SNDBUF / SO_RCVBUF size for ``rate_mbit`` over a path of ``rtt_s``: rate x
    max(2 x max(RTT, 50 ms), ``stall_s``), clamped to [256 KiB, 64 MiB]. ``stall_s``: how
    long a receive thread may not run (CPU or GIL) without the socket dropping anything."""
    want = rate_mbit * 1e6 / 8.0 * max(2.0 * max(rtt_s, 0.05), stall_s)
    return int(min(64 * _MIB, max(256 << 10, want)))


@dataclass(frozen=True, kw_only=True)
class ReceiverReport:
    """What one receiver saw of one sender's datagrams in one round.

    Attributes:
        sent_datagrams / sent_bytes / send_s: the sender's own counts and the time
            from its first to its last datagram to this receiver.
        received_datagrams / received_bytes / recv_s: the receiver's counts and the
            time from the first to the last arrival (kernel arrival times where the
            receiver has them).
        receiver_drops: datagrams the receiver's socket dropped at a full buffer while
            this sender's arrived (``SO_RXQ_OVFL``; the receiver, not the path, was too slow).
    """

    sent_datagrams: int
    sent_bytes: int
    send_s: float
    received_datagrams: int
    received_bytes: int
    recv_s: float
    receiver_drops: int = 0

    @property
    def loss(self) -> float:
        return 1.0 - self.received_datagrams / self.sent_datagrams if self.sent_datagrams else 0.0


def describe_reports(reports: Sequence[ReceiverReport]) -> str:
    """One line for the log of what a round's receiver reports say, summed over the
    receivers: datagrams arrived of sent, the send and receive windows (s, shortest to
    longest); "no reports" for none."""
    if not reports:
        return "no reports"
    sent = sum(r.sent_datagrams for r in reports)
    got = sum(r.received_datagrams for r in reports)
    send = sorted(r.send_s for r in reports)
    recv = sorted(r.recv_s for r in reports)
    return (
        f"{len(reports)} report(s): {got}/{sent} datagrams arrived, send window {send[0]:.4f}-{send[-1]:.4f} s, "
        f"receive window {recv[0]:.4f}-{recv[-1]:.4f} s"
    )


def _paced_s(send_s: float, sent_bytes: int, rate_mbit: float) -> float:
    """The longer of a measured send window (s) and ``sent_bytes`` at ``rate_mbit``."""
    return max(send_s, sent_bytes * 8.0 / 1e6 / rate_mbit) if rate_mbit > 0 else send_s


class RateController:
    """Picks each round's sending rate from the previous round's receiver reports.

    Congestion signals (any one): the receivers' sockets dropped more than
    ``overflow_tolerance`` of what arrived at a full buffer (``receiver_drops``: a
    receiver too slow for the rate, e.g. CPU-starved); the receive window is longer than ``(1 +
    queue_tolerance) x`` the send window plus ``jitter_s`` (a queue built up); with
    ``loss_signal``, the loss exceeds the lowest loss seen in an uncongested round by
    ``loss_margin`` (what a shallow-buffered bottleneck adds on top of the path's random
    loss; off by default, because a path whose random loss rises is then throttled too:
    through netem with the loss stepped 1 -> 5 -> 10 % it cut the rate from 29 to 17
    Mbit/s); the loss exceeds ``congestion_loss``. On congestion the bottleneck is estimated as the delivery
    rate corrected for the random loss, and the rate drops to 0.95x of it. Without
    congestion the rate grows x1.5 per round until the first congestion (slow start),
    then by at most 5 % above the estimate per round. Never above ``max_rate_mbit``.

    Args:
        max_rate_mbit: ceiling, never exceeded.
        min_rate_mbit: floor.
        initial_rate_mbit: the first round's rate (None: the ceiling).
        min_window_s: a report whose (paced, see :meth:`decide`) send window is at least this
            long (s) carries a rate signal either way (congestion or none).
        min_datagrams: a report whose send window is shorter than ``min_window_s`` carries a
            signal only if at least this many of its datagrams arrived, and then only a
            congestion signal (see below).
        overflow_tolerance: fraction of socket drops at the receivers taken as noise.

    Short send windows. A sender at a rate far above a small model's round sends a
    receiver its datagrams in a few ms (at 1000 Mbit/s, 180 datagrams of 1,400 B leave in
    2 ms), far below ``min_window_s``. Such a train is exactly what shows a bottleneck best:
    a 100 Mbit/s link stretches it to ~10x on arrival, and the train's bytes over the receive
    window are the bottleneck's rate. So a short-window report is used when, on its own, it
    shows congestion (receive window stretched beyond ``(1 + queue_tolerance) x`` its send
    window plus ``jitter_s``, loss, or receiver overflow, as above) and at least
    ``min_datagrams`` of it arrived: a window of a few datagrams is a few inter-packet gaps
    that one delay of the path or the receiver's kernel dominates, and a loss fraction of 1
    in 3 is noise, not congestion. A short window that shows no congestion keeps the rate
    (it is no evidence for raising it: a rate slightly above the bottleneck builds a queue
    too short to see within ``jitter_s`` in a few ms). Reports of at most one arrived
    datagram never count (no window at all).

    Bad input: a report with ``sent_datagrams`` 0 has loss 0; negative windows are taken as
    they come (a receive window shorter than the send window shows no queue).
    """

    def __init__(
        self,
        *,
        max_rate_mbit: float,
        min_rate_mbit: float = 1.0,
        initial_rate_mbit: float | None = None,
        queue_tolerance: float = 0.1,
        jitter_s: float = 0.005,
        loss_margin: float = 0.02,
        loss_signal: bool = False,
        congestion_loss: float = 0.3,
        min_window_s: float = 0.02,
        min_datagrams: int = 16,
        overflow_tolerance: float = 0.01,
    ) -> None:
        if not 0 < min_rate_mbit <= max_rate_mbit:
            raise ValueError(f"need 0 < min_rate_mbit <= max_rate_mbit, got {min_rate_mbit!r}, {max_rate_mbit!r}")
        self.max_rate_mbit = max_rate_mbit
        self.min_rate_mbit = min_rate_mbit
        self.rate_mbit = min(max_rate_mbit, initial_rate_mbit or max_rate_mbit)
        self.bottleneck_mbit: float | None = None
        self.base_loss: float | None = None  # lowest loss of an uncongested round
        self._tol = queue_tolerance
        self._jitter_s = jitter_s
        self._loss_margin = loss_margin
        self._loss_signal = loss_signal
        self._congestion_loss = congestion_loss
        self._min_window_s = min_window_s
        self._min_datagrams = max(2, min_datagrams)
        self._overflow_tolerance = overflow_tolerance

    def _congestion(self, recv_s: float, send_s: float, loss: float, overflow: float = 0.0) -> str:
        if overflow > self._overflow_tolerance:
            return f"receiver overflow: {overflow:.1%} of the datagrams dropped at its full socket"
        if recv_s > (1.0 + self._tol) * send_s + self._jitter_s:
            return f"queue: received over {recv_s:.3f} s what left in {send_s:.3f} s"
        if self._loss_signal and self.base_loss is not None and loss > self.base_loss + self._loss_margin:
            return f"loss {loss:.1%} above the path's {self.base_loss:.1%}"
        if loss > self._congestion_loss:
            return f"loss {loss:.1%} above {self._congestion_loss:.0%}"
        return ""

    def decide(self, reports: Sequence[ReceiverReport]) -> tuple[float, str]:
        """Next rate (Mbit/s) and why; updates :attr:`rate_mbit`.

        ``reports``: the previous round's, one per receiver of this sender, sent at
        :attr:`rate_mbit`. Each report's send window is taken as its paced window: the
        longer of the measured one and its bytes at the rate (the pacer lets two bursts
        leave at once, so a short train's measured window is about half its paced time:
        9 ms for 240 kB at 97 Mbit/s through netem, whose paced time is 20 ms; compared with
        the receive window it read as a queue). Used: those with a paced window of at least
        ``min_window_s`` and more than one datagram arrived, and the shorter ones that on
        their own show congestion with at least ``min_datagrams`` arrived (class
        docstring). None used: the rate is kept."""
        rate_mbit = self.rate_mbit
        useful: list[ReceiverReport] = []
        short_why = ""  # the first short-window report's own congestion signal
        for r in reports:
            send_s = _paced_s(r.send_s, r.sent_bytes, rate_mbit)
            if r.received_datagrams <= 1:
                continue
            if send_s >= self._min_window_s:
                useful.append(r)
            elif r.received_datagrams >= self._min_datagrams:
                why_r = self._congestion(r.recv_s, send_s, r.loss, r.receiver_drops / r.received_datagrams)
                if why_r:
                    useful.append(r)
                    short_why = short_why or f"{why_r} (send window under {self._min_window_s:.3f} s)"
        if not useful:
            return self.rate_mbit, "no report with a rate signal: rate kept"
        recv_s = max(r.recv_s for r in useful)
        # the pacer is shared by every receiver's train: their bytes together at the rate
        send_s = _paced_s(max(r.send_s for r in useful), sum(r.sent_bytes for r in useful), rate_mbit)
        sent = sum(r.sent_datagrams for r in useful)
        loss = 1.0 - sum(r.received_datagrams for r in useful) / sent if sent else 0.0
        delivered_mbit = sum(r.received_bytes for r in useful) * 8.0 / 1e6 / max(recv_s, 1e-9)
        received = sum(r.received_datagrams for r in useful)
        overflow = sum(r.receiver_drops for r in useful) / max(1, received)
        why = self._congestion(recv_s, send_s, loss, overflow) or short_why
        if why:
            self.bottleneck_mbit = delivered_mbit / (1.0 - (self.base_loss or 0.0))
            new = 0.95 * self.bottleneck_mbit
            why += f"; bottleneck ~{self.bottleneck_mbit:.1f} Mbit/s"
        else:
            self.base_loss = loss if self.base_loss is None else min(self.base_loss, loss)
            if self.bottleneck_mbit is None:
                new = self.rate_mbit * 1.5
                why = f"no congestion (loss {loss:.1%}): slow start"
            else:
                if self.rate_mbit >= self.bottleneck_mbit:
                    self.bottleneck_mbit = self.rate_mbit
                new = min(self.rate_mbit * 1.25, 1.05 * self.bottleneck_mbit)
                why = f"no congestion (loss {loss:.1%}): probing up"
        self.rate_mbit = min(self.max_rate_mbit, max(self.min_rate_mbit, new))
        return self.rate_mbit, f"{why} -> {self.rate_mbit:.1f} Mbit/s"
