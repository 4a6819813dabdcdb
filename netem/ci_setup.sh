#!/usr/bin/env bash
# Install what the netem harness needs (Debian/Ubuntu, run as root).
#
#   netem/ci_setup.sh /path/to/venv/bin/python
#
# System packages: iproute2 (ip, tc), nftables (nft: loss and partition rules),
# iptables (NFQUEUE rule for the userspace delayer; fallback for loss/partition),
# ethtool (TSO/GSO off on veth ends), iputils-ping (RTT tests),
# libnetfilter-queue-dev + gcc (to build the netfilterqueue Python package and the
# compiled delayer netem/delayer.c, which the Topology builds on first use).
# Then pip-installs netfilterqueue==1.1.0 into the given venv.
#
# Idempotent: skips apt-get when every package is already installed and pip
# when netfilterqueue already imports. Quiet on success; on any failure it
# prints the failing command's output and exits non-zero.
set -euo pipefail

PY="${1:?usage: $0 /path/to/venv/bin/python}"
PKGS=(iproute2 nftables iptables ethtool iputils-ping libnetfilter-queue-dev gcc)
NFQ_REQ="netfilterqueue==1.1.0"

die() { echo "netem/ci_setup.sh: $*" >&2; exit 1; }
run_quiet() {  # run a command; show its output only if it fails
    local log
    log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "failed: $*"
    fi
    rm -f "$log"
}

[ "$(id -u)" = 0 ] || die "must run as root (apt-get and network namespaces)"
[ -x "$PY" ] || die "not an executable python: $PY"
command -v apt-get >/dev/null || die "apt-get not found (Debian/Ubuntu only)"

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    run_quiet apt-get update -q
    run_quiet apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! "$PY" -c "import netfilterqueue" >/dev/null 2>&1; then
    run_quiet "$PY" -m pip install -q --disable-pip-version-check "$NFQ_REQ"
fi

# Check that everything is really there (loudly, with the name of what is missing).
for c in ip tc nft iptables ethtool ping; do
    command -v "$c" >/dev/null || die "$c still missing after install"
done
"$PY" -c "import netfilterqueue" || die "netfilterqueue does not import in $PY"
command -v gcc >/dev/null || die "gcc still missing after install"
[ -f /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || die "libnetfilter_queue headers missing after install"
