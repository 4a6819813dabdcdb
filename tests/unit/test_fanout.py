"""Fanout: blocking calls on a few threads, any of which can be given up in flight."""

from __future__ import annotations

import threading
import time

import pytest

from dtrain.rounds.fanout import Fanout


@pytest.mark.timeout(30)
def test_a_call_given_up_in_flight_frees_its_thread_for_the_other_keys() -> None:
    """One thread, a first call that blocks until released: giving it up starts a fresh
    thread, so the other keys are answered before the blocked call ends; its answer,
    when it comes, is dropped."""
    release = threading.Event()

    def call(k: int) -> int:
        if k == 0:
            release.wait(20)
        return 10 * k

    fan = Fanout(call, [0, 1, 2], width=1, name="t")
    while fan.in_flight() != [0]:
        time.sleep(0.01)
    lost = {0}
    gave_up: list[tuple[int, bool]] = []
    threading.Timer(0.1, fan.wake).start()
    answers = fan.wait(time.monotonic() + 20, lambda k: k in lost, lambda k, late: gave_up.append((k, late)))
    assert answers == [(1, 10), (2, 20)] and gave_up == [(0, False)]
    assert not release.is_set() and fan.pending == frozenset()
    release.set()
    assert fan.next(timeout_s=0.5) is None  # the given-up answer is dropped


@pytest.mark.timeout(30)
def test_an_exception_is_handed_back_and_an_overrun_is_given_up_5_s_past_the_deadline() -> None:
    block = threading.Event()

    def call(k: str) -> str:
        if k == "boom":
            raise RuntimeError("transport bug")
        if k == "hang":
            block.wait(20)  # a call that ignores its own timeout
        return k

    fan = Fanout(call, ["ok", "boom", "hang"], width=3, name="t")
    gave_up: list[tuple[str, bool]] = []
    t0 = time.monotonic()
    answers = dict(fan.wait(t0 - 4.5, lambda k: False, lambda k, late: gave_up.append((k, late))))
    block.set()
    assert answers["ok"] == "ok" and isinstance(answers["boom"], RuntimeError) and "hang" not in answers
    assert gave_up == [("hang", True)]
    assert time.monotonic() - t0 < 5.0  # at deadline + 5 s = t0 + 0.5 s, not when the call ended


def test_width_must_be_positive() -> None:
    with pytest.raises(ValueError, match="width must be >= 1"):
        Fanout(lambda k: k, [1], width=0, name="t")
