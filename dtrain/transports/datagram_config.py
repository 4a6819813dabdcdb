"""The datagram data path's configuration (:class:`DatagramTransportConfig`).

Kept apart from ``dtrain.transports.datagram`` (which re-exports it) so that it imports
neither torch, numpy nor grpc: the command line builds its flags (``--net.datagram.*``,
TOML ``[net.datagram]``) from this class before anything heavy is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from dtrain.transports.grpc_config import GrpcTransportConfig

__all__ = ["NATIVE_MODES", "DatagramTransportConfig", "NativeMode", "max_datagram_bytes_for_mtu"]

#: ``DatagramTransportConfig.native``: the compiled batch loop where it builds, required, or never.
NativeMode = Literal["auto", "on", "off"]
NATIVE_MODES: tuple[str, ...] = get_args(NativeMode)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, kw_only=True)
class DatagramTransportConfig:
    """The datagram data path of one site.

    Attributes:
        grpc: the gRPC transport for control-plane pulls (state, fallback means); the
            worker sets it from ``net.grpc`` and the addresses, token and TLS of ``net``.
        run_id: the u32 every datagram of the run carries, in [0, 2**32); every site of a
            run must use the same one (a datagram of another run is dropped unopened).
        max_datagram_bytes: UDP payload per datagram, an int in [256, 65507]: the path
            MTU less 28 bytes of IPv4/UDP headers and room for tunnels (1400 for a 1500-byte
            MTU; 8900 for jumbo frames of 9000). It sets the chunk size (one chunk, one
            datagram), so every site of a run must use the same value: a larger datagram
            than a receiver's own bound is dropped there and counted as oversized.
        max_rate_mbit: sending-rate ceiling, never exceeded (Mbit/s), a finite number > 0.
        initial_rate_mbit: the first round's rate, in [min_rate_mbit, max_rate_mbit]
            (None: the ceiling).
        min_rate_mbit: floor of the rate controller, in (0, max_rate_mbit].
        rtt_s: the path RTT assumed before it is measured, seconds > 0: the socket buffers
            are sized from it; the timers that wait for a peer's answer (a NACK's, the
            REPORT's, an owner's first mean datagram) start from it and then follow the
            round trip measured per peer (:mod:`~.datagram_rtt`, RFC 6298's SRTT/RTO from
            SEND_END -> REPORT).
        recv_stall_s: the receive socket holds this long of traffic at ``max_rate_mbit``
            (at least 2 RTT): a receive thread kept from running that long (a busy CPU,
            the GIL) loses nothing. Through netem on the 2-core machine, receivers with
            2 RTT (2.4 MB at 95 Mbit/s) overflowed 10-30 % of a round's datagrams and the
            rate controller then cut the rate to 10-30 Mbit/s.
        recv_coalesce_s: after the socket turns readable the receive thread waits this long
            before it reads, so one wake-up reads a batch, not one datagram: paced
            datagrams arrive ~0.1 ms apart, and the fixed cost of a wake-up and of a
            batch's checks (~30-50 µs) then dominated (through netem the compiled loop's
            receive thread cost ~30 µs of CPU per datagram, against ~8 µs in a burst).
            0: read at once. It adds at most this much to each datagram's latency.
        burst_bytes: largest paced micro-burst, an int >= max_datagram_bytes.
        max_nack_rounds: re-requests of missing mean chunks per bucket and round; as an
            owner, NACKs numbered past it are not answered (a member's own bound: an honest
            one never sends them), and each number is answered with at most the whole mean.
        nack_copies: how many times an owner re-sends each chunk a NACK lists (and the
            final meta after them), 1..4: at loss p a re-request then leaves p^copies of
            what it asked for missing, so fewer NACK rounds (an RTT and a wait behind the
            owner's other sends each) are needed; the cost is the re-sent bytes times
            ``nack_copies`` (at 10% loss ~+10% of the mean's bytes with 2).
        nack_idle_s: a mean that made no progress for this long gets a NACK.
        fallback_reserve_s: a mean still incomplete this long before the pull's
            deadline is pulled over gRPC.
        report_wait_s: the least ``push`` waits for the owner's REPORT, seconds (three of
            the path's measured RTOs where that is longer); later copies of the SEND_END
            follow from a daemon thread.
        reorder_grace_s: the least a sender's end (BUCKET_END, SEND_END) waits, in seconds
            (>= 0), for contributions it announced that have not arrived: they may have been
            overtaken by the end (reordering), not lost. The wait is twice the path's observed
            reordering, at least this (:mod:`~.datagram_reorder`), and paid only when something
            is missing at the end.
        max_reorder_grace_s: the most that wait lasts, seconds (>= reorder_grace_s); a
            contribution later than it is refused once its bucket closed, counted
            ``late_after_end`` and ``rejected_failed_precondition``.
        max_round_buffer_bytes: receive budget per round (fragments and means), an int
            >= max_datagram_bytes.
        max_pending_datagrams: datagrams held for a round whose plan has not
            arrived here yet, an int >= 0.
        test_drop: test-only probability in [0, 1) that a received datagram of a
            data kind (CONTRIB, MEAN, MEAN_META) is discarded before it is opened.
        test_drop_seed: seed of ``test_drop``, an int >= 0.
        native: the compiled batch loop (:mod:`~.datagram_native`: seal, open, ``sendmmsg``,
            ``recvmmsg`` per batch): ``"auto"`` where it builds (else the Python loop, same
            wire format), ``"on"`` (``start`` fails without it) or ``"off"``.
        gso: with the compiled loop on Linux, send each run of equal-sized datagrams of a
            batch as one UDP segmentation offload write (``UDP_SEGMENT``, a bool): the same
            datagrams on the wire for about half the send call's CPU. A kernel that refuses
            it is logged once and the transport goes on with ``sendmmsg``.
        gro: with the compiled loop on Linux, let the kernel hand runs of equal-sized
            datagrams of one flow to the receive thread as one coalesced read (``UDP_GRO``, a
            bool), cut back into the same datagrams in C: one read where ``recvmmsg`` took ~45
            (on loopback from a GSO sender; a NIC coalesces the same way, a path that
            delivers datagrams one by one reads as before). A kernel that refuses it is
            logged once and the transport reads with ``recvmmsg``.
        switch_interval_s: ``sys.setswitchinterval`` for this process at ``start`` when it
            is longer, > 0 (None: left alone). The receive thread needs the GIL within a
            datagram's time; CPython's default 5 ms hand-over let the engine's threads
            starve it (3 sites x 4 M int8 parameters in one process on loopback: 7.1 s a
            round with 1408 chunks lost at the socket and re-sent; 4.1 s and none at 0.5 ms).
    """

    grpc: GrpcTransportConfig = field(default_factory=GrpcTransportConfig)
    run_id: int = 0
    max_datagram_bytes: int = 1400
    max_rate_mbit: float = 1000.0
    initial_rate_mbit: float | None = None
    min_rate_mbit: float = 1.0
    rtt_s: float = 0.1
    recv_stall_s: float = 1.0
    recv_coalesce_s: float = 0.002
    burst_bytes: int = 64 << 10
    max_nack_rounds: int = 8
    nack_copies: int = 2
    nack_idle_s: float = 0.05
    fallback_reserve_s: float = 1.0
    report_wait_s: float = 0.5
    reorder_grace_s: float = 0.005
    max_reorder_grace_s: float = 0.25
    max_round_buffer_bytes: int = 512 << 20
    max_pending_datagrams: int = 4096
    test_drop: float = 0.0
    test_drop_seed: int = 0
    native: NativeMode = "auto"
    gso: bool = True
    gro: bool = True
    switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        need("grpc", isinstance(self.grpc, GrpcTransportConfig), "a GrpcTransportConfig")
        need("run_id", _is_int(self.run_id) and 0 <= self.run_id < 1 << 32, "an int in [0, 2**32)")
        need(
            "max_datagram_bytes",
            _is_int(self.max_datagram_bytes) and 256 <= self.max_datagram_bytes <= 65507,
            "an int in [256, 65507] bytes (the path MTU less 28 and a margin: 1400 for an MTU of 1500)",
        )
        need("max_rate_mbit", _is_num(self.max_rate_mbit) and self.max_rate_mbit > 0, "a finite number > 0 Mbit/s")
        need(
            "min_rate_mbit",
            _is_num(self.min_rate_mbit) and 0 < self.min_rate_mbit <= self.max_rate_mbit,
            f"in (0, max_rate_mbit = {self.max_rate_mbit!r}] Mbit/s",
        )
        need(
            "initial_rate_mbit",
            self.initial_rate_mbit is None
            or (_is_num(self.initial_rate_mbit) and self.min_rate_mbit <= self.initial_rate_mbit <= self.max_rate_mbit),
            f"none (the ceiling) or in [min_rate_mbit, max_rate_mbit] = "
            f"[{self.min_rate_mbit!r}, {self.max_rate_mbit!r}] Mbit/s",
        )
        for name in ("rtt_s", "nack_idle_s", "fallback_reserve_s", "report_wait_s"):
            v = getattr(self, name)
            need(name, _is_num(v) and v > 0, "a finite number > 0 seconds")
        need("recv_stall_s", _is_num(self.recv_stall_s) and self.recv_stall_s >= 0, "a finite number >= 0 seconds")
        need(
            "reorder_grace_s",
            _is_num(self.reorder_grace_s) and self.reorder_grace_s >= 0,
            "a finite number >= 0 seconds",
        )
        need(
            "max_reorder_grace_s",
            _is_num(self.max_reorder_grace_s)
            and _is_num(self.reorder_grace_s)
            and self.max_reorder_grace_s >= self.reorder_grace_s,
            f"a finite number >= reorder_grace_s ({self.reorder_grace_s!r}) seconds",
        )
        need(
            "recv_coalesce_s", _is_num(self.recv_coalesce_s) and 0 <= self.recv_coalesce_s <= 0.1, "in [0, 0.1] seconds"
        )
        for name in ("burst_bytes", "max_round_buffer_bytes"):
            v = getattr(self, name)
            need(
                name,
                _is_int(v) and _is_int(self.max_datagram_bytes) and v >= self.max_datagram_bytes,
                f"an int >= max_datagram_bytes ({self.max_datagram_bytes!r})",
            )
        need("max_nack_rounds", _is_int(self.max_nack_rounds) and self.max_nack_rounds >= 0, "an int >= 0")
        need("nack_copies", _is_int(self.nack_copies) and 1 <= self.nack_copies <= 4, "an int in [1, 4]")
        need(
            "max_pending_datagrams",
            _is_int(self.max_pending_datagrams) and self.max_pending_datagrams >= 0,
            "an int >= 0",
        )
        need("test_drop", _is_num(self.test_drop) and 0.0 <= self.test_drop < 1.0, "in [0, 1)")
        need("test_drop_seed", _is_int(self.test_drop_seed) and self.test_drop_seed >= 0, "an int >= 0")
        need("native", self.native in NATIVE_MODES, f"one of {', '.join(NATIVE_MODES)}")
        need("gso", isinstance(self.gso, bool), "a bool (true or false)")
        need("gro", isinstance(self.gro, bool), "a bool (true or false)")
        need(
            "switch_interval_s",
            self.switch_interval_s is None or (_is_num(self.switch_interval_s) and self.switch_interval_s > 0),
            "none (left alone) or a finite number > 0 seconds",
        )


def max_datagram_bytes_for_mtu(mtu_bytes: int) -> int:
    """``max_datagram_bytes`` for a path of ``mtu_bytes``: 28 bytes of IPv4 and UDP headers and 72
    of room for tunnels less (1400 at 1500, the default; 8900 for jumbo frames of 9000).

    Raises:
        ValueError: ``mtu_bytes`` leaves less than 256 bytes, or more than 65507.
    """
    size = mtu_bytes - 100
    if not 256 <= size <= 65507:
        raise ValueError(f"mtu_bytes must be in [356, 65607], got {mtu_bytes!r}")
    return size
