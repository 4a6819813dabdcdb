"""``dtrain doctor``: a preflight of the paths between sites, and what to change for them.

One site serves the probe (``dtrain doctor --serve --listen 0.0.0.0:29401``); another
measures its path to it (``dtrain doctor --peer HOST:29401[,HOST2:29401]``) with
:func:`dtrain.probe.measure_path`, reads this host's TCP settings
(:func:`read_kernel_settings`) and prints the figures and :func:`advise`'s recommendations:
kernel settings to change and the dtrain options that fit the path, each with its reason.

Peers are named on the command line, not taken from the rendezvous's member list: the
preflight runs before a run, when no rendezvous or worker exists yet, and a member's
advertised address is its Peer gRPC port, not a probe server. The same probe functions
are a library (``dtrain.probe``) the rendezvous can call at join.

:func:`advise` is pure: a :class:`~dtrain.probe.PathReport` and :class:`KernelSettings`
in, a list of :class:`Advice` out.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from dtrain.app.procs import wait_for_signal
from dtrain.probe import PathReport, ProbeError, ProbeServer, measure_path
from dtrain.transports.datagram_config import max_datagram_bytes_for_mtu
from dtrain.transports.datagram_pacing import socket_buffer_bytes

__all__ = [
    "Advice",
    "KernelSettings",
    "read_kernel_settings",
    "advise",
    "format_report",
    "run_doctor",
    "CODEC_BITS",
]

log = logging.getLogger(__name__)

#: Bits per value on the wire by codec, headers and block scales included (the byte layouts
#: at a 1,400-byte chunk: int8 1,280 values in 1,332 bytes, int4 2,304 in 1,332).
CODEC_BITS: dict[str, float] = {"fp32": 32.0, "bf16": 16.0, "int8": 8.33, "int4": 4.63}
#: Linux's initial congestion window, bytes (10 segments of 1,460).
INITIAL_WINDOW_BYTES = 14_600
#: Loss at or above which the datagram path beats gRPC (docs/DECISIONS.md, "Datagram path
#: measurements": 4 sites, 100 Mbit/s, 40 ms one way; exchange time over the physical limit
#: at 1% loss: datagram 1.00-1.03x, gRPC BBR 1.01x, reno 3.36x; at 5%: 1.06-1.12x, 1.20x, 7.37x).
DATAGRAM_LOSS = 0.01
#: Loss at or above which a loss-based congestion control (cubic, reno) loses most of the rate.
CC_LOSS = 0.001
#: An RTT at or above which BBR is recommended even without loss (cubic's window growth is per RTT).
CC_RTT_S = 0.03
_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class KernelSettings:
    """This host's TCP settings (Linux ``/proc/sys``; None: not readable here).

    Attributes:
        congestion_control: ``net.ipv4.tcp_congestion_control``.
        available_congestion_control: ``net.ipv4.tcp_available_congestion_control``.
        rmem_max_bytes, wmem_max_bytes: ``net.core.rmem_max`` / ``wmem_max``: the largest
            SO_RCVBUF / SO_SNDBUF a program may set (the datagram path sets both).
        tcp_rmem_bytes, tcp_wmem_bytes: ``net.ipv4.tcp_rmem`` / ``tcp_wmem``: min, default
            and max of TCP's autotuned buffers (gRPC's connections use these).
        slow_start_after_idle: ``net.ipv4.tcp_slow_start_after_idle``.
    """

    congestion_control: str | None = None
    available_congestion_control: tuple[str, ...] = ()
    rmem_max_bytes: int | None = None
    wmem_max_bytes: int | None = None
    tcp_rmem_bytes: tuple[int, int, int] | None = None
    tcp_wmem_bytes: tuple[int, int, int] | None = None
    slow_start_after_idle: bool | None = None


def read_kernel_settings(proc_sys: str | Path = "/proc/sys") -> KernelSettings:
    """Read :class:`KernelSettings` under ``proc_sys`` (this process's network namespace).
    A file that is missing or unreadable leaves its field None."""
    root = Path(proc_sys)

    def text(rel: str) -> str | None:
        try:
            return (root / rel).read_text().strip()
        except OSError:
            return None

    def ints(rel: str) -> tuple[int, ...] | None:
        t = text(rel)
        try:
            return tuple(int(x) for x in t.split()) if t else None
        except ValueError:
            return None

    def triple(rel: str) -> tuple[int, int, int] | None:
        v = ints(rel)
        return (v[0], v[1], v[2]) if v and len(v) == 3 else None

    one = {k: (v[0] if (v := ints(rel)) else None) for k, rel in (
        ("rmem", "net/core/rmem_max"), ("wmem", "net/core/wmem_max"), ("ssai", "net/ipv4/tcp_slow_start_after_idle")
    )}  # fmt: skip
    return KernelSettings(
        congestion_control=text("net/ipv4/tcp_congestion_control"),
        available_congestion_control=tuple((text("net/ipv4/tcp_available_congestion_control") or "").split()),
        rmem_max_bytes=one["rmem"],
        wmem_max_bytes=one["wmem"],
        tcp_rmem_bytes=triple("net/ipv4/tcp_rmem"),
        tcp_wmem_bytes=triple("net/ipv4/tcp_wmem"),
        slow_start_after_idle=None if one["ssai"] is None else bool(one["ssai"]),
    )


@dataclass(frozen=True, kw_only=True)
class Advice:
    """One recommendation.

    Attributes:
        kind: ``"kernel"`` (a sysctl on this host; set it on every site) or ``"dtrain"`` (a
            ``dtrain worker`` / ``launch`` option).
        setting: the sysctl key or the flag.
        value: what to set it to.
        reason: why, with the measured figures.
    """

    kind: Literal["kernel", "dtrain"]
    setting: str
    value: str
    reason: str


def _mbit(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e6


def _pow2_mib(n_bytes: float) -> int:
    """``n_bytes`` rounded up to a power of two MiB (at least 4 MiB)."""
    return max(4, 1 << max(0, math.ceil(math.log2(max(n_bytes, 1) / _MIB)))) * _MIB


def advise(
    report: PathReport, kernel: KernelSettings, *, model_params: int = 0, sync_budget_s: float = 10.0
) -> list[Advice]:
    """What to change for the path in ``report`` on a host with ``kernel``'s settings (pure).

    Rules, each a reason in the output: socket buffers of two bandwidth-delay products
    (TCP's autotuning gives a flow about half its buffer as window); slow start after idle
    off (a round's exchange follows an idle inner phase); BBR at loss >= ``CC_LOSS`` or RTT
    >= ``CC_RTT_S``; the datagram data path at loss >= ``DATAGRAM_LOSS``, else gRPC; the
    datagram size and rate for the path's MTU, rate and RTT; with ``model_params`` > 0, the
    least lossy codec whose estimated exchange (2 x params x bits per value over the measured
    rate) fits ``sync_budget_s``.

    Args:
        report: the measured path; fields that are None skip the rules that need them.
        kernel: this host's settings; None fields skip their rules.
        model_params: parameters the run synchronises (0: no codec advice).
        sync_budget_s: longest acceptable exchange per round, seconds.

    Returns:
        the recommendations, kernel settings first, in a stable order.
    """
    out: list[Advice] = []
    rate = max(
        (r for r in (report.throughput_one_flow_bytes_per_s, report.throughput_flows_bytes_per_s) if r), default=None
    )
    rtt, loss = report.rtt_median_s, report.loss_fraction
    if rate and rtt:
        out += _buffer_advice(kernel, rate, rtt)
    if kernel.slow_start_after_idle and rtt:
        rtts = math.ceil(math.log2(max(2.0, (rate or 0) * rtt / INITIAL_WINDOW_BYTES)))
        out.append(
            Advice(
                kind="kernel",
                setting="net.ipv4.tcp_slow_start_after_idle",
                value="0",
                reason=f"each round's exchange follows an idle inner phase; with this setting at 1, TCP restarts it "
                f"from the initial window and needs ~{rtts} RTTs ({rtts * rtt:.2f} s) to reach the path's rate again",
            )
        )
    out += _congestion_advice(kernel, rtt, loss)
    out += _data_path_advice(report, rate, rtt, loss)
    if model_params > 0 and rate:
        out.append(_codec_advice(model_params, rate, sync_budget_s))
    return out


def _buffer_advice(kernel: KernelSettings, rate: float, rtt: float) -> list[Advice]:
    bdp = rate * rtt
    need = _pow2_mib(2 * bdp)
    why = f"the path's bandwidth-delay product is {bdp / _MIB:.2f} MiB ({_mbit(rate):.0f} Mbit/s x {rtt * 1e3:.0f} ms)"
    out = []
    for key, cur in (("net.ipv4.tcp_rmem", kernel.tcp_rmem_bytes), ("net.ipv4.tcp_wmem", kernel.tcp_wmem_bytes)):
        if cur is not None and cur[2] < need:
            out.append(
                Advice(
                    kind="kernel",
                    setting=key,
                    value=f"{cur[0]} {cur[1]} {need}",
                    reason=f"a TCP flow's window is about half its buffer, at most {cur[2] / _MIB:.1f} MiB here; {why}",
                )
            )
    sock = socket_buffer_bytes(_mbit(rate), rtt, stall_s=1.0)  # what the datagram path asks (recv_stall_s 1 s)
    for key, cur in (("net.core.rmem_max", kernel.rmem_max_bytes), ("net.core.wmem_max", kernel.wmem_max_bytes)):
        if cur is not None and cur < sock:
            out.append(
                Advice(
                    kind="kernel",
                    setting=key,
                    value=str(_pow2_mib(sock)),
                    reason=f"caps the socket buffer a program sets ({cur / _MIB:.2f} MiB); the datagram path asks "
                    f"{sock / _MIB:.1f} MiB at this rate (1 s of traffic, its recv_stall_s) and gets less",
                )
            )
    return out


def _congestion_advice(kernel: KernelSettings, rtt: float | None, loss: float | None) -> list[Advice]:
    cc = kernel.congestion_control
    if cc is None or cc == "bbr":
        return []
    lossy = loss is not None and loss >= CC_LOSS
    far = rtt is not None and rtt >= CC_RTT_S
    if not (lossy or far):
        return []
    why = f"loss {loss:.2%}" if lossy else f"RTT {rtt * 1e3:.0f} ms"
    load = "" if "bbr" in kernel.available_congestion_control else " (load it first: modprobe tcp_bbr)"
    return [
        Advice(
            kind="kernel",
            setting="net.ipv4.tcp_congestion_control",
            value="bbr",
            reason=f"{cc} halves its window at each loss and grows it once per RTT; on this path ({why}) BBR keeps "
            f"the rate (measured at 1% loss: gRPC with BBR 1.01x the physical limit, with reno 3.36x){load}",
        )
    ]


def _data_path_advice(report: PathReport, rate: float | None, rtt: float | None, loss: float | None) -> list[Advice]:
    out = []
    mtu = report.mtu_bytes
    if loss is not None and loss >= DATAGRAM_LOSS:
        out.append(
            Advice(
                kind="dtrain",
                setting="--data-path",
                value="datagram",
                reason=f"one-way loss {loss:.1%}: TCP retransmits and backs off, the datagram path does neither and "
                "divides each mean by the contributions that arrived (measured at 5% / 10% loss: datagram "
                "1.06-1.12x the physical limit, gRPC with BBR 1.20x / 1.70x)",
            )
        )
        if rate:
            out.append(
                Advice(
                    kind="dtrain",
                    setting="--max-rate-mbit",
                    value=f"{math.floor(_mbit(rate))}",
                    reason=f"the path carried {_mbit(rate):.0f} Mbit/s; the datagram path never sends faster "
                    "than this ceiling, and a faster one only fills the bottleneck's queue",
                )
            )
        if rtt:
            out.append(
                Advice(
                    kind="dtrain",
                    setting="--net.datagram.rtt-s",
                    value=f"{rtt:.3f}",
                    reason="the measured median RTT: its socket buffers are sized from it, and its timers "
                    "start from it until they have measured the round trip to each peer",
                )
            )
    elif loss is not None:
        out.append(
            Advice(
                kind="dtrain",
                setting="--data-path",
                value="grpc",
                reason=f"one-way loss {loss:.2%} is below {DATAGRAM_LOSS:.0%}: gRPC over TCP with BBR is as fast "
                "(1.01x the physical limit at 1% loss), delivers every byte and needs no rate setting",
            )
        )
    if mtu is not None and 356 <= mtu:
        size = max_datagram_bytes_for_mtu(min(mtu, 65607))
        if size != 1400 or any(a.value == "datagram" for a in out):
            where = " (above the usual 1,500)" if mtu > 1500 else (" (below the usual 1,500)" if mtu < 1500 else "")
            out.append(
                Advice(
                    kind="dtrain",
                    setting="--max-datagram-bytes",
                    value=str(size),
                    reason=f"path MTU {mtu} bytes{where}: one chunk is one datagram, the MTU less 28 bytes of "
                    "IPv4 + UDP headers and 72 of room for tunnels (datagram path only; every site the same)",
                )
            )
    return out


def _codec_advice(model_params: int, rate: float, budget_s: float) -> Advice:
    est = {name: 2 * model_params * bits / 8 / rate for name, bits in CODEC_BITS.items()}
    table = ", ".join(f"{n} {t:.1f} s" for n, t in est.items())
    for name, t in est.items():
        if t <= budget_s:
            return Advice(
                kind="dtrain",
                setting="--codec",
                value=name,
                reason=f"the least lossy codec whose exchange fits {budget_s:g} s at {_mbit(rate):.0f} Mbit/s "
                f"(estimated 2 x {model_params:,} params x bits per value: {table})",
            )
    return Advice(
        kind="dtrain",
        setting="--codec",
        value="int4",
        reason=f"no codec's exchange fits {budget_s:g} s at {_mbit(rate):.0f} Mbit/s ({table}): also raise "
        "--sync-every or overlap the exchange with --diloco.num-fragments / --diloco.overlap-steps",
    )


def format_report(report: PathReport, kernel: KernelSettings, advice: list[Advice]) -> str:
    """The human-readable text of one peer's figures, this host's settings and the advice."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{_mbit(v):.1f} Mbit/s ({v / 1e6:.2f} MB/s)"

    lines = [
        f"path to {report.peer} (this host -> peer)",
        f"  rtt         median {ms(report.rtt_median_s)}, p90 {ms(report.rtt_p90_s)}, min {ms(report.rtt_min_s)}"
        f" ({report.rtt_lost} echoes lost)",
        f"  throughput  {rate(report.throughput_one_flow_bytes_per_s)} one TCP flow, "
        f"{rate(report.throughput_flows_bytes_per_s)} over {report.num_flows} flows",
        f"  path MTU    {report.mtu_bytes if report.mtu_bytes is not None else '-'} bytes"
        f" ({'IPv6' if report.ipv6 else 'IPv4'})",
        "  loss        "
        + (
            "-"
            if report.loss_fraction is None
            else f"{report.loss_fraction:.2%} of {report.num_loss_probes} UDP probes"
        ),
    ]
    lines += [f"  note: {n}" for n in report.notes]
    k = kernel
    lines += [
        "this host's TCP settings",
        f"  congestion control {k.congestion_control} (available: {' '.join(k.available_congestion_control) or '-'}),"
        f" slow start after idle {k.slow_start_after_idle}",
        f"  rmem_max {k.rmem_max_bytes}, wmem_max {k.wmem_max_bytes}, tcp_rmem {k.tcp_rmem_bytes},"
        f" tcp_wmem {k.tcp_wmem_bytes}",
    ]
    for kind, title in (("kernel", "change on every site (sysctl -w KEY=VALUE)"), ("dtrain", "dtrain options")):
        items = [a for a in advice if a.kind == kind]
        lines.append(f"{title}:" if items else f"{title}: nothing to change")
        sep = "=" if kind == "kernel" else " "
        lines += [f"  {a.setting}{sep}{a.value}\n      {a.reason}" for a in items]
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class _PeerResult:
    report: PathReport
    advice: list[Advice] = field(default_factory=list)


def run_doctor(cfg, out=print) -> int:
    """``dtrain doctor`` with ``cfg`` (:class:`dtrain.app.config.DoctorConfig`): serve the
    probe until SIGINT/SIGTERM or ``serve_s``, or measure each peer and print.

    Returns:
        0, or 1 when a peer could not be measured at all (its error is printed).
    """
    if cfg.serve:
        return _serve(cfg, out)
    kernel = read_kernel_settings()
    results, rc = [], 0
    for peer in cfg.peer_list():
        try:
            report = measure_path(peer, cfg.probe)
        except (ProbeError, OSError) as e:
            out(f"dtrain doctor: {e}")
            rc = 1
            continue
        advice = advise(report, kernel, model_params=cfg.model_params, sync_budget_s=cfg.sync_budget_s)
        results.append(_PeerResult(report=report, advice=advice))
        if not cfg.json:
            out(format_report(report, kernel, advice))
    if cfg.json:
        doc = {
            "kernel": asdict(kernel),
            "peers": [{"report": r.report.as_dict(), "advice": [asdict(a) for a in r.advice]} for r in results],
        }
        out(json.dumps(doc))
    return rc


def _serve(cfg, out) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with ProbeServer(cfg.listen.host, cfg.listen.port) as srv:
        out(
            f"dtrain doctor: probe server on {srv.address} (tcp and udp); peers run: dtrain doctor --peer HOST:{srv.port}"
        )
        wait_for_signal(stop, cfg.serve_s)  # not stop.wait(): a signal taken by another thread would not wake it
    return 0
