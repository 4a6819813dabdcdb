"""Garbage collection between rounds (dtrain.app.gc_control.RoundCollector): automatic
collection is off while a collector runs, cycles are freed at the round boundaries it is
told of and not before, and the process's collector state comes back as it was."""

from __future__ import annotations

import gc
import weakref

import pytest

from dtrain.app.config import WorkerConfig
from dtrain.app.gc_control import RoundCollector


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


@pytest.fixture(autouse=True)
def _restore_gc():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


def test_cycles_are_freed_at_the_round_boundaries_only() -> None:
    gc.enable()
    c = RoundCollector(2, site="site-0")
    c.start()
    try:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what existed at start is frozen
        ref = _cycle()
        junk = [[_Node()] for _ in range(20_000)]  # tracked allocations that would start collections
        del junk
        assert ref() is not None
        assert c.after_round(1) == 0.0 and ref() is not None  # not a multiple of 2: no collection
        assert c.after_round(2) >= 0.0 and ref() is None  # collected here
        assert c.collections == 1
    finally:
        c.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_the_automatic_collector_alone() -> None:
    gc.enable()
    c = RoundCollector(0)
    c.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert c.after_round(1) == 0.0 and c.collections == 0
    c.close()
    assert gc.isenabled()


def test_the_last_of_several_collectors_turns_automatic_collection_back_on() -> None:
    gc.enable()
    a, b = RoundCollector(1, site="a"), RoundCollector(1, site="b")
    a.start()
    b.start()
    a.close()
    a.close()  # idempotent: does not count twice
    assert not gc.isenabled()
    b.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collector_started_while_automatic_collection_was_off_leaves_it_off() -> None:
    gc.disable()
    c = RoundCollector(1)
    c.start()
    c.close()
    assert not gc.isenabled()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_every_rounds_is_refused_naming_the_field(bad) -> None:
    with pytest.raises(ValueError, match="gc_every_rounds must be an int >= 0"):
        RoundCollector(bad)
    with pytest.raises(ValueError, match="gc_every_rounds"):
        WorkerConfig(gc_every_rounds=bad)
