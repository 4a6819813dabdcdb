"""Find out which emulation backends work on this kernel, on a scratch namespace.

The probe builds a throw-away namespace ``dtnetem-probe<pid>`` holding a veth pair
(nothing in the root namespace), tries each mechanism there and deletes it.
The result is cached per process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass

from . import _rules
from ._sys import PREFIX, CommandError, delete_namespace, ns_cmd, run

__all__ = ["Capabilities", "NetemUnavailable", "missing_requirements", "probe", "choose_backends"]

logger = logging.getLogger(__name__)


class NetemUnavailable(RuntimeError):
    """The harness cannot run here; the message says what is missing."""


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What worked on the scratch namespace (True = usable)."""

    kernel_netem: bool
    tbf: bool
    nftables: bool
    iptables_nfqueue: bool
    iptables_statistic: bool
    ethtool: bool
    netfilterqueue: bool
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def missing_requirements() -> list[str]:
    """What prevents the harness from running at all (empty list: it can run).

    Checks root, the ``ip`` command, ``ip netns`` itself, ``tc``, ``iptables`` and
    ``ethtool`` (without it a ``UDP_SEGMENT`` write crosses the hub whole and is lost
    whole: ``netem._rules.offloads_off_argv``), and the ``netfilterqueue``
    package needed by the userspace delayer (kernels here have no netem qdisc).
    """
    missing = []
    if os.geteuid() != 0:
        missing.append(f"not root (euid {os.geteuid()}); network namespaces need root")
        return missing
    if shutil.which("ip") is None:
        missing.append("`ip` (iproute2) is not installed")
        return missing
    ns = f"{PREFIX}check{os.getpid()}"
    try:
        run(["ip", "netns", "add", ns])
    except CommandError as e:
        missing.append(f"`ip netns add` fails: {e.stderr.strip()}")
        return missing
    finally:
        run(["ip", "netns", "delete", ns], check=False)
    for tool in ("tc", "iptables", "iptables-restore", "ethtool"):  # ethtool: per-packet loss (_rules)
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` is not installed (run netem/ci_setup.sh)")
    if importlib.util.find_spec("netfilterqueue") is None:
        missing.append(
            "python package netfilterqueue is not importable (run netem/ci_setup.sh "
            "PYTHON, which installs libnetfilter-queue-dev and netfilterqueue==1.1.0)"
        )
    return missing


def _ok(argv: list[str], *, input: str | None = None, what: str, notes: list[str]) -> bool:
    try:
        run(argv, input=input)
        return True
    except (CommandError, FileNotFoundError) as e:
        notes.append(f"{what}: {e}")
        return False


_CACHE: Capabilities | None = None


def probe(*, refresh: bool = False) -> Capabilities:
    """Probe the kernel and tools (cached; ``refresh`` probes again).

    Raises:
        NetemUnavailable: when not root, or ``ip netns``/veth do not work.
    """
    global _CACHE
    if _CACHE is not None and not refresh:
        return _CACHE
    missing = [m for m in missing_requirements() if "netfilterqueue" not in m]
    if missing:
        raise NetemUnavailable("; ".join(missing))
    ns = f"{PREFIX}probe{os.getpid()}"
    notes: list[str] = []
    x = lambda argv: ns_cmd(ns, argv)  # noqa: E731
    try:
        run(["ip", "netns", "add", ns])
        try:
            run(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
            for dev in ("pa", "pb"):
                run(["ip", "-n", ns, "link", "set", dev, "up"])
        except CommandError as e:
            raise NetemUnavailable(f"veth setup fails in a namespace: {e}") from e
        caps = Capabilities(
            kernel_netem=_ok(
                x(["tc", "qdisc", "add", "dev", "pa", "root", "netem", "delay", "1ms"]), what="tc netem", notes=notes
            ),
            tbf=_ok(x(_rules.tbf_argv("pb", 10.0)), what="tc tbf", notes=notes),
            nftables=shutil.which("nft") is not None
            and _ok(
                x(["nft", "-f", "-"]),
                input=_rules.nft_hub_base() + _rules.nft_chain("loss", ['oifname "pb" numgen random mod 1000000 < 5']),
                what="nft inet table with numgen",
                notes=notes,
            ),
            iptables_nfqueue=_ok(
                x(["iptables", "-A", "FORWARD", "-o", "pb", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]),
                what="iptables NFQUEUE",
                notes=notes,
            ),
            iptables_statistic=_ok(
                x(
                    [
                        "iptables",
                        "-A",
                        "FORWARD",
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        "0.5",
                        "-j",
                        "DROP",
                    ]
                ),
                what="iptables statistic",
                notes=notes,
            ),
            ethtool=_ok(x(_rules.offloads_off_argv("pa")), what="ethtool (offloads off)", notes=notes),
            netfilterqueue=importlib.util.find_spec("netfilterqueue") is not None,
            notes=tuple(notes),
        )
    finally:
        delete_namespace(ns)
    logger.info("netem backends probed: %s", caps)
    _CACHE = caps
    return caps


def choose_backends(
    caps: Capabilities,
    *,
    kernel_netem: bool | None = None,
    filter_backend: str | None = None,
    compiled_delayer: bool = False,
) -> dict[str, str | None]:
    """Pick a backend per property from ``caps`` (None: that property cannot be emulated).

    Args:
        caps: Probe result.
        kernel_netem: False forces the fallbacks even where the kernel has netem; None
            (default) uses netem when present. True requires it.
        filter_backend: "nftables" or "iptables" for loss (without kernel netem),
            partitions and flapping; None (default) prefers nftables.

    Raises:
        NetemUnavailable: ``kernel_netem=True`` without kernel netem, a forced
            filter backend that does not work, or no rate backend.
        compiled_delayer: True when the compiled NFQUEUE delayer (``netem/delayer.c``) was
            built: delay/jitter backend ``nfqueue-c`` instead of the Python delayer
            ``nfqueue-userspace`` (which needs the netfilterqueue package).
    """
    use_netem = caps.kernel_netem if kernel_netem is None else kernel_netem
    if use_netem and not caps.kernel_netem:
        raise NetemUnavailable("kernel_netem=True but `tc qdisc add ... netem` fails here")
    if not caps.tbf:
        raise NetemUnavailable("tc tbf does not work here; no rate backend")
    if use_netem:
        delay = "netem"
    elif caps.iptables_nfqueue and compiled_delayer:
        delay = "nfqueue-c"
    elif caps.iptables_nfqueue and caps.netfilterqueue:
        delay = "nfqueue-userspace"
    else:
        delay = None
    works = {"nftables": caps.nftables, "iptables": caps.iptables_statistic}
    if filter_backend is not None:
        if not works.get(filter_backend):
            raise NetemUnavailable(f"filter_backend={filter_backend!r} does not work here")
        filt = filter_backend
    else:
        filt = next((k for k, ok in works.items() if ok), None)
    return {
        "delay": delay,
        "jitter": delay,
        "reorder": None if use_netem else delay,  # the userspace delayers' (kernel netem's reorder skips the delay)
        "loss": "netem" if use_netem else filt,
        "rate": "tbf+netem" if use_netem else "tbf",
        "partition": filt,
        "flap": None if filt is None else f"agent+{filt}",
    }
