"""Fixtures for the netem tests.

Tests marked ``netem`` need root, ``ip netns`` and the netfilterqueue package; they
skip with the reason otherwise, or fail when DTRAIN_NETEM_REQUIRED=1 (set it in CI so
that a broken setup cannot pass by skipping). After each netem test a fixture checks
that no namespace, helper process or state file of the harness remains and that the
root namespace's links and rules did not change.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from netem_helpers import leftovers, netem_missing  # sets the per-process prefix first

import netem  # noqa: E402,I001


def _output(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except FileNotFoundError:
        return ""


def _root_snapshot() -> tuple[set[str], str, str]:
    """Root-namespace link names, nft ruleset and iptables rules (the harness never
    touches the root namespace)."""
    links = _output(["ip", "-o", "link", "show"])
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return names, _output(["nft", "list", "ruleset"]), _output(["iptables", "-S"])


@pytest.fixture(autouse=True)
def _netem_guard(request):
    """Skip/fail netem tests that cannot run; after each, check nothing was left behind."""
    if request.node.get_closest_marker("netem") is None:
        yield
        return
    missing = netem_missing()
    if missing:
        reason = "netem harness unavailable: " + "; ".join(missing)
        if os.environ.get("DTRAIN_NETEM_REQUIRED") == "1":
            pytest.fail(reason + " (DTRAIN_NETEM_REQUIRED=1)")
        pytest.skip(reason)
    before = _root_snapshot()
    yield
    left = leftovers()
    if left:
        netem.cleanup_all()
    assert not left, f"the harness left behind: {left}"
    after = _root_snapshot()
    assert not after[0] - before[0], f"new links in the root namespace: {after[0] - before[0]}"
    assert after[1:] == before[1:], "the root namespace's nft/iptables rules changed"
