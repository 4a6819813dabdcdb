"""CatchUp against a scripted donor (no network): a bucket that cannot be replayed to the
donors' round is pulled again, and a pull that only repeats itself fails saying why (issue 33)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.codecs import get_codec
from dtrain.codecs.config import CodecConfig
from dtrain.errors import PeerTimeout, RejectCode, Rejected, StateTransferError
from dtrain.protocol import Member
from dtrain.rounds.catchup import CatchUp, first_wave, takes_from_queue
from dtrain.rounds.history import MeanHistory, history_info_state
from dtrain.state import GlobalState


def _state(seed: int) -> GlobalState:
    layout = BucketLayout([64], ["param"], BucketConfig(bucket_bytes=64, chunk_bytes=64))
    return GlobalState(layout, [torch.randn(64, generator=torch.Generator().manual_seed(seed))])


class _Donor:
    """A donor whose round moves on by one with every bucket it serves and that keeps no means."""

    def __init__(self) -> None:
        self.state = _state(1)
        self.round = 5
        self.served = 0

    def pull_state(self, address, bucket, *, requester, timeout_s):
        if bucket == len(self.state) + 1:
            lrs = [tuple(g["lr"] for g in o.param_groups) for o in self.state.optimizers]
            return history_info_state(MeanHistory(0, 0), self.round, lrs, index=bucket)
        self.round += 1
        self.served += 1
        return replace(self.state.bucket_state(bucket), rounds_applied=self.round)

    def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
        raise Rejected(RejectCode.FAILED_PRECONDITION, f"round {round} is over here: not kept")


def test_a_pull_that_only_repeats_itself_fails_naming_the_setting():
    donor, joiner = _Donor(), _state(2)
    before = joiner.checksums()
    cu = CatchUp(
        joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", progress_timeout_s=0.3, use_own=False
    )
    with pytest.raises(StateTransferError, match=r"repeated: a bucket's transfer outlasts the rounds the members keep"):
        cu.run([Member(site_id="d", address="d")])
    assert cu.stats.repulled > 0 and donor.served > len(joiner)
    assert joiner.checksums() == before and joiner.rounds_applied == 0  # nothing installed


def test_buckets_of_one_round_install_at_once():
    donor, joiner = _Donor(), _state(2)
    donor.pull_state = _frozen(donor)  # the donor stands still: every bucket at round 5
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    assert cu.run([Member(site_id="d", address="d")]) == 5
    assert joiner.checksums() == donor.state.checksums() and joiner.rounds_applied == 5
    assert cu.stats.buckets_from == {"d": len(joiner)} and cu.stats.repulled == 0


def _frozen(donor: _Donor):
    """``donor`` standing still at round 5, whichever threads ask at once (the summary is asked
    while buckets are in flight: unlocked, it could read the round a bucket pull had just moved)."""
    moving, lock = donor.pull_state, threading.Lock()

    def pull_state(address, bucket, *, requester, timeout_s):
        with lock:
            st = moving(address, bucket, requester=requester, timeout_s=timeout_s)
            donor.round = 5
        return replace(st, rounds_applied=5) if bucket < len(donor.state) else st

    return pull_state


def test_a_stalled_donor_costs_one_short_request_then_requests_get_twice_as_long():
    """Two donors at round 5; every request to "stall" hangs until its timeout (a TCP stream in
    retransmission back-off). With the first request timeout at 1 s (the site passes its last
    plan's broadcast deadline; 1 s is the least) the stalled donor is dropped after 1 s and the
    other serves every bucket; the next requests may take 2 s. Before, every request had 30 s."""
    import time

    from dtrain.errors import PeerTimeout

    good, joiner = _Donor(), _state(2)
    good.pull_state = _frozen(good)
    waited: list[float] = []

    class _Router:
        def pull_state(self, address, bucket, *, requester, timeout_s):
            if address == "stall":
                waited.append(timeout_s)
                time.sleep(timeout_s)
                raise PeerTimeout("stalled (test)")
            return good.pull_state(address, bucket, requester=requester, timeout_s=timeout_s)

        def pull_mean(self, *a, **kw):
            return good.pull_mean(*a, **kw)

    cu = CatchUp(
        joiner, _Router(), get_codec(CodecConfig(name="fp32")), requester="j", use_own=False, request_timeout_s=0.5
    )
    t0 = time.monotonic()
    assert cu.run([Member(site_id="stall", address="stall"), Member(site_id="d", address="d")]) == 5
    # its summary and its two first-wave buckets, at once: one request's time, 0.5 s asked: 1 s is
    # the least (was 30 s); requests that timed out together double the timeout once
    assert waited == [1.0, 1.0, 1.0] and time.monotonic() - t0 < 15.0
    assert cu.stats.donors_lost == ["stall"] and cu.stats.buckets_from == {"d": len(joiner)}
    assert cu.request_timeout_s == pytest.approx(2.0)
    assert joiner.checksums() == good.state.checksums()
    capped = CatchUp(joiner, _Router(), get_codec(CodecConfig(name="fp32")), requester="j", progress_timeout_s=3.0)
    assert capped.request_timeout_s == 3.0  # never past the progress timeout (30 s when no plan said)


def test_run_within_gives_up_on_a_request_that_ignores_its_timeout_logs_where_and_installs_nothing(caplog):
    """A donor's request blocks past any timeout (what a hung catch-up at close looked like:
    no log line after "catching up", no stack). ``run_within`` returns after its limit saying
    so, logs the catch-up thread's stack (naming the blocking call), and installs nothing,
    also once the request returns later."""
    import threading
    import time

    donor, joiner = _Donor(), _state(2)
    donor.pull_state = _frozen(donor)
    release = threading.Event()

    class _Hanging:
        def pull_state(self, address, bucket, *, requester, timeout_s):
            if bucket < len(joiner):
                release.wait(30.0)  # ignores timeout_s
            return donor.pull_state(address, bucket, requester=requester, timeout_s=timeout_s)

        def pull_mean(self, *a, **kw):
            return donor.pull_mean(*a, **kw)

    before = joiner.checksums()
    cu = CatchUp(joiner, _Hanging(), get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="dtrain.rounds.catchup"):
        why = cu.run_within([Member(site_id="d", address="d")], min_round=5, limit_s=0.5)
    assert why == "the catch-up did not finish within 0.5 s" and time.monotonic() - t0 < 10.0
    assert "catch-up still running after 0.5 s; cancelled" in caplog.text
    assert "thread catchup-j-d-0" in caplog.text and "in pull_state" in caplog.text  # where it waits
    release.set()
    time.sleep(1.0)  # the request returns; the cancelled run must not install what it pulls
    assert joiner.checksums() == before and joiner.rounds_applied == 0


def test_run_within_reports_a_failed_catch_up_in_words():
    donor, joiner = _Donor(), _state(2)
    cu = CatchUp(
        joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", progress_timeout_s=0.3, use_own=False
    )
    why = cu.run_within([Member(site_id="d", address="d")], min_round=0, limit_s=20.0)
    assert why is not None and "repeated: a bucket's transfer outlasts the rounds the members keep" in why


def test_run_within_installs_a_catch_up_that_ends_in_time():
    donor, joiner = _Donor(), _state(2)
    donor.pull_state = _frozen(donor)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    assert cu.run_within([Member(site_id="d", address="d")], min_round=5, limit_s=20.0) is None
    assert joiner.checksums() == donor.state.checksums() and joiner.rounds_applied == 5


class _TailDonor:
    """One donor at round ``round`` whose last bucket's answer waits (up to 5 s) for the next
    summary request, and that moves to ``moved_to`` as it serves that bucket when set (a round
    that closes during the tail). Records what it was asked, in order."""

    def __init__(self, moved_to: int | None = None) -> None:
        self.state, self.round, self.moved_to = _state(1), 5, moved_to
        self.asked: list[str] = []
        self.lock, self.summary = threading.Lock(), threading.Event()
        self.last = len(self.state) - 1

    def pull_state(self, address, bucket, *, requester, timeout_s):
        n = len(self.state)
        if bucket == n + 1:
            with self.lock:
                self.asked.append("summary")
                r = self.round
            self.summary.set()
            lrs = [tuple(g["lr"] for g in o.param_groups) for o in self.state.optimizers]
            return history_info_state(MeanHistory(0, 0), r, lrs, index=bucket)
        with self.lock:
            first_last = bucket == self.last and f"bucket {bucket}" not in self.asked
            self.asked.append(f"bucket {bucket}")
            if first_last:
                self.summary.clear()
        if first_last:
            self.summary.wait(5.0)  # the donors' summary asked while this bucket is in flight
            with self.lock:
                if self.moved_to is not None:
                    self.round = self.moved_to
        with self.lock:
            r = self.round
            self.asked.append(f"answered {bucket}")
        return replace(self.state.bucket_state(bucket), rounds_applied=r)

    def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
        raise Rejected(RejectCode.FAILED_PRECONDITION, f"round {round} is over here: not kept")


def test_the_donors_are_asked_where_they_are_while_the_last_bucket_is_in_flight_not_after_it():
    """The summary that confirms the round is asked once the last bucket was asked for, and
    answers before it: nothing moved, so the catch-up installs without a round trip after the
    last bytes (3 donors at 300 Mbit/s, RTT 40 ms: one RTT of a 1 s pull)."""
    donor, joiner = _TailDonor(), _state(2)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    assert cu.run([Member(site_id="d", address="d")]) == 5
    last = f"answered {donor.last}"
    assert donor.asked.count("summary") == 2  # the first, and one during the tail: none after
    assert donor.asked.index("summary", 1) < donor.asked.index(last)
    assert joiner.checksums() == donor.state.checksums() and joiner.rounds_applied == 5


def test_a_round_that_closes_during_the_tail_is_asked_about_again_and_installed_whole():
    """The last bucket comes back at round 6 after the tail's summary said 5: that answer no
    longer holds, so the donors are asked again after the last bytes, and the buckets of round
    5 (no means kept to replay) are pulled again at 6: one round, never a mix."""
    donor, joiner = _TailDonor(moved_to=6), _state(2)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    assert cu.run([Member(site_id="d", address="d")]) == 6
    assert "summary" in donor.asked[donor.asked.index(f"answered {donor.last}") :]  # asked again
    assert joiner.checksums() == donor.state.checksums() and joiner.rounds_applied == 6
    assert cu.stats.repulled == len(joiner) - 1


def test_a_donor_asks_for_a_tail_bucket_while_its_other_stream_still_sends():
    """8 buckets, 3 donors x 2 streams: donor "a" ends one of its first two while the other is
    still in flight, 2 buckets left. "a" takes one of them at once, behind its other transfer
    (its connection never waits a round trip with nothing to send); the last one goes to another
    donor's first free stream, not to "a" while its tail bucket is in flight: on a shared link
    the last buckets then run on two connections, not alone on one (16 MB from 3 donors at
    100 Mbit/s: the last 2 of 8 buckets on one donor, 0.5 s of tail)."""
    layout = BucketLayout([128], ["param"], BucketConfig(bucket_bytes=64, chunk_bytes=64))
    src = GlobalState(layout, [torch.randn(128, generator=torch.Generator().manual_seed(1))])
    joiner = GlobalState(layout, [torch.zeros(128)])
    n = len(src)
    # a's first bucket ends at once, its second once a tail bucket was asked for; b's and c's
    # 0.3 s after that, so "a" alone has a free stream while the last bucket waits; the tail
    # buckets end once both were asked for (each wait gives up after 5 s: a broken rule fails)
    first_wave, release, others, last_asked = threading.Barrier(6), *(threading.Event() for _ in range(3))
    lock, started = threading.Lock(), []
    wave_in_flight: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    tail_asked: list[tuple[str, int]] = []  # (donor, its first-wave buckets still in flight)
    tail_in_flight: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    most_tail: dict[str, int] = {"a": 0, "b": 0, "c": 0}

    class _Donors:
        def pull_state(self, address, bucket, *, requester, timeout_s):
            if bucket == n + 1:
                lrs = [tuple(g["lr"] for g in o.param_groups) for o in src.optimizers]
                return history_info_state(MeanHistory(0, 0), 5, lrs, index=bucket)
            with lock:
                started.append(address)
                wave = len(started) <= 6
                first_of_a = wave and address == "a" and "a" not in started[:-1]
                second_of_a = wave and address == "a" and not first_of_a
                if wave:
                    wave_in_flight[address] += 1
                else:
                    tail_asked.append((address, wave_in_flight[address]))
                    tail_in_flight[address] += 1
                    most_tail[address] = max(most_tail[address], tail_in_flight[address])
                    (release if len(tail_asked) == 1 else last_asked).set()
            try:
                if wave:
                    first_wave.wait(timeout=5)
                    if second_of_a:
                        release.wait(timeout=5)
                    elif not first_of_a:
                        others.wait(timeout=5)
                else:
                    last_asked.wait(timeout=5)  # a tail bucket stays in flight until both were asked for
                return replace(src.bucket_state(bucket), rounds_applied=5)
            finally:
                with lock:
                    if wave:
                        wave_in_flight[address] -= 1
                    else:
                        tail_in_flight[address] -= 1
                if second_of_a:
                    timer.start()

        def pull_mean(self, *a, **kw):
            raise Rejected(RejectCode.FAILED_PRECONDITION, "not kept")

    timer = threading.Timer(0.3, others.set)
    cu = CatchUp(joiner, _Donors(), get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    try:
        assert cu.run([Member(site_id=s, address=s) for s in ("a", "b", "c")]) == 5
    finally:
        timer.cancel()
    assert tail_asked[0] == ("a", 1)  # asked while a's other first-wave bucket was in flight
    assert tail_asked[1][0] != "a"  # the last one not on "a" while its tail bucket is in flight
    assert max(most_tail.values()) == 1
    assert sum(cu.stats.buckets_from.values()) == n and joiner.checksums() == src.checksums()


def test_takes_from_queue_one_tail_bucket_per_donor_at_a_time():
    assert takes_from_queue(3, 3, tail_in_flight=True)  # not the tail yet: any free stream
    assert takes_from_queue(2, 3, tail_in_flight=False)  # the tail: a donor without one in flight
    assert not takes_from_queue(2, 3, tail_in_flight=True)
    assert not takes_from_queue(1, 2, tail_in_flight=True)


class _WaveDonor:
    """Donors at round 5 whose summaries answer only once ``expect`` bucket requests arrived (or
    after 5 s): records which buckets were asked for before any summary was answered."""

    def __init__(self, src: GlobalState, expect: int) -> None:
        self.src, self.expect = src, expect
        self.lock, self.enough = threading.Lock(), threading.Event()
        self.before: list[int] = []
        self.summaries_answered = 0
        self.pulled: list[int] = []
        if expect == 0:
            self.enough.set()

    def pull_state(self, address, bucket, *, requester, timeout_s):
        n = len(self.src)
        if bucket == n + 1:
            self.enough.wait(5.0)
            with self.lock:
                self.summaries_answered += 1
            lrs = [tuple(g["lr"] for g in o.param_groups) for o in self.src.optimizers]
            return history_info_state(MeanHistory(4, 1 << 20), 5, lrs, index=bucket)
        with self.lock:
            self.pulled.append(bucket)
            if not self.summaries_answered:
                self.before.append(bucket)
                if len(self.before) >= self.expect:
                    self.enough.set()
        return replace(self.src.bucket_state(bucket), rounds_applied=5)

    def pull_mean(self, *a, **kw):
        raise Rejected(RejectCode.FAILED_PRECONDITION, "not kept")


def test_the_first_wave_goes_out_beside_the_donors_summaries_and_is_not_pulled_again():
    """A joiner far behind (own θ at round 0, the group at 5, the members keeping 2 rounds):
    each of its 2 x 2 streams asks for a bucket before any summary is answered, and every
    bucket is pulled once (16 MB from 3 donors at 100 Mbit/s, RTT 40 ms: the summary's round
    trip was 1.3x against 1.37x of the naive figure)."""
    layout = BucketLayout([128], ["param"], BucketConfig(bucket_bytes=64, chunk_bytes=64))
    src = GlobalState(layout, [torch.randn(128, generator=torch.Generator().manual_seed(1))])
    joiner = GlobalState(layout, [torch.zeros(128)])
    donor = _WaveDonor(src, expect=4)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", kept_rounds=2)
    assert cu.run([Member(site_id=s, address=s) for s in ("a", "b")], min_round=5) == 5
    assert sorted(donor.before) == [0, 1, 2, 3]
    assert sorted(donor.pulled) == list(range(len(src))) and cu.stats.repulled == 0
    assert joiner.checksums() == src.checksums() and joiner.rounds_applied == 5


def test_a_site_whose_own_buckets_may_be_replayed_waits_for_the_summaries():
    """One round behind with the members said to keep 4: its own θ_b may be replayed, so nothing
    is asked for before the summaries say what the members keep (a straggler does not pull its
    state whole on a guess); this donor keeps none, so the buckets are then pulled whole."""
    layout = BucketLayout([128], ["param"], BucketConfig(bucket_bytes=64, chunk_bytes=64))
    src = GlobalState(layout, [torch.randn(128, generator=torch.Generator().manual_seed(1))])
    joiner = GlobalState(layout, [torch.zeros(128)])
    for b in range(len(joiner)):
        joiner.bucket_round[b] = 4
    donor = _WaveDonor(src, expect=0)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", kept_rounds=4)
    assert cu.run([Member(site_id="a", address="a")], min_round=5) == 5  # this donor keeps none: whole
    assert donor.before == [] and sorted(donor.pulled) == list(range(len(src)))


def test_first_wave_takes_only_buckets_the_site_cannot_start_from_its_own():
    rounds = [0, 0, 4, 0, 0]
    assert first_wave(rounds, set(), min_round=5, use_own=True, kept_rounds=2, limit=3) == [0, 1, 3]
    assert first_wave(rounds, {0}, min_round=5, use_own=True, kept_rounds=2, limit=9) == [1, 3, 4]
    assert first_wave(rounds, set(), min_round=5, use_own=True, kept_rounds=None, limit=9) == []
    assert first_wave(rounds, set(), min_round=5, use_own=False, kept_rounds=None, limit=2) == [0, 1]
    assert first_wave(rounds, set(), min_round=5, use_own=True, kept_rounds=5, limit=9) == []


def test_a_first_wave_bucket_from_a_donor_behind_the_group_is_dropped_not_installed():
    """Two members: "a" at round 5 and "j", another joiner still at round 0. Buckets asked of "j"
    before its summary came back of round 0: dropped (counted), pulled whole from "a"; "j" serves
    no whole bucket, and nothing is pulled twice."""
    layout = BucketLayout([128], ["param"], BucketConfig(bucket_bytes=64, chunk_bytes=64))
    src = GlobalState(layout, [torch.randn(128, generator=torch.Generator().manual_seed(1))])
    behind = GlobalState(layout, [torch.zeros(128)])
    joiner = GlobalState(layout, [torch.zeros(128)])
    n, lock, served_by_j = len(src), threading.Lock(), []

    class _Members:
        def pull_state(self, address, bucket, *, requester, timeout_s):
            st, r = (src, 5) if address == "a" else (behind, 0)
            if bucket == n + 1:
                lrs = [tuple(g["lr"] for g in o.param_groups) for o in st.optimizers]
                return history_info_state(MeanHistory(0, 0), r, lrs, index=bucket)
            if address == "j":
                with lock:
                    served_by_j.append(bucket)
            return replace(st.bucket_state(bucket), rounds_applied=r)

        def pull_mean(self, *a, **kw):
            raise Rejected(RejectCode.FAILED_PRECONDITION, "not kept")

    cu = CatchUp(joiner, _Members(), get_codec(CodecConfig(name="fp32")), requester="x", kept_rounds=2)
    assert cu.run([Member(site_id="j", address="j"), Member(site_id="a", address="a")], min_round=5) == 5
    assert cu.stats.first_wave_dropped == len(served_by_j) and "j" not in cu.stats.buckets_from
    assert cu.stats.buckets_from == {"a": n} and cu.stats.repulled == 0
    assert joiner.checksums() == src.checksums()


def test_a_mean_not_there_yet_is_asked_for_again_not_ruled_out():
    """A donor answers NOT_FOUND for a mean of its own open round that it has not received yet:
    "not yet", so the same donor is asked again; FAILED_PRECONDITION ("not kept") rules it out."""

    class _NotYet(_Donor):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[tuple[int, int]] = []

        def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
            self.asked.append((round, bucket))
            if self.asked.count((round, bucket)) == 1:
                raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} bucket {bucket} here")
            return super().pull_mean(address, round, bucket, requester=requester, timeout_s=timeout_s)

    donor, joiner = _NotYet(), _state(2)
    cu = CatchUp(
        joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", progress_timeout_s=0.3, use_own=False
    )
    with pytest.raises(StateTransferError):  # it keeps no means: every replay ends in a pull again
        cu.run([Member(site_id="d", address="d")])
    assert donor.asked, "no replay was asked for"
    # every mean first answered "not yet" was asked for again (ruled out, the bucket would have been
    # pulled whole instead), but for those still waiting for their second ask when the run gave up
    again = {k for k in set(donor.asked) if donor.asked.count(k) == 2}
    assert again and len(set(donor.asked) - again) <= len(joiner), donor.asked
    assert max(map(donor.asked.count, donor.asked)) == 2  # the second answer (not kept) rules the donor out


def _plan(r: int, *sites: str):
    from dtrain.protocol import RoundPlan

    return RoundPlan(
        round=r, members=tuple(Member(site_id=s, address=s) for s in sites), reduce_timeout_s=1, broadcast_timeout_s=2
    )


def _info(rounds_applied: int, skipped=()):
    from dtrain.rounds.history import HistoryInfo

    return HistoryInfo(rounds_applied=rounds_applied, span=None, lrs={}, skipped=tuple(skipped))


def test_a_round_is_void_only_when_every_other_member_says_it_skipped_it():
    from dtrain.rounds.catchup import decide_void

    plan = _plan(5, "a", "b", "c")
    void, why = decide_void(plan, "a", {"b": _info(5, [3, 5]), "c": _info(5, [5])})
    assert void and "every other member (b, c) skipped it too" in why
    # a member not heard from may have run it (dead, unreachable, or not asked yet)
    assert decide_void(plan, "a", {"b": _info(5, [5])}) == (
        False,
        "no summary from c, a member of round 5: it may have run it",
    )
    # a member at the round that did not skip it may be running it now
    void, why = decide_void(plan, "a", {"b": _info(5, [5]), "c": _info(5, [4])})
    assert not void and "c, a member of round 5, is at round 5 and did not skip it" in why
    # a member past it ran it (or took θ from one that did)
    assert not decide_void(plan, "a", {"b": _info(6, [5]), "c": _info(5, [5])})[0]
    # a donor that was not a member but is past the round: it ran without this plan's members
    void, why = decide_void(plan, "a", {"b": _info(5, [5]), "c": _info(5, [5]), "d": _info(6)})
    assert not void and why == "d is at round 6: round 5 ran"
    # this site the plan's only member: nobody else could have run it
    void, why = decide_void(_plan(5, "a"), "a", {})
    assert void and "this site was its only member" in why


def test_void_round_passes_every_bucket_unchanged_and_keeps_the_round_in_the_history():
    from dtrain.configs import RoundConfig
    from dtrain.rounds import RoundEngine
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    layout = BucketLayout([128], ["param"], BucketConfig(bucket_bytes=64, chunk_bytes=64))
    st = GlobalState(layout, [torch.arange(128, dtype=torch.float32)])
    st.rounds_applied = 4
    st.bucket_round = [4] * len(st)
    eng = RoundEngine("a", st, InprocTransport(InprocNetwork()), RoundConfig())
    before = [b.detach().clone() for b in st.theta]
    with pytest.raises(ValueError, match=r"void_round\(3\): θ is at round 4, not 3"):
        eng.void_round(3, "test")
    eng.void_round(4, "test")
    assert st.rounds_applied == 5 and st.bucket_round == [5] * len(st)
    assert all(torch.equal(a, b) for a, b in zip(before, st.theta))
    assert eng.history.span() == (4, 4)
    assert all(eng.history.get(4, b).mean is None for b in range(len(st)))


class _Donors:
    """A transport over in-memory donors: site id -> (state, round, rounds skipped); a donor
    in ``stalled`` times out on its summary."""

    def __init__(self, donors: dict) -> None:
        self.donors, self.stalled = donors, set()

    def pull_state(self, address, bucket, *, requester, timeout_s):
        from dtrain.errors import PeerTimeout

        state, r, skipped = self.donors[address]
        if bucket == len(state) + 1:
            if address in self.stalled:
                raise PeerTimeout(f"{address} stalled")
            lrs = [tuple(g["lr"] for g in o.param_groups) for o in state.optimizers]
            return history_info_state(MeanHistory(4, 10**6), r, lrs, index=bucket, skipped=skipped)
        return state.bucket_state(bucket)

    def pull_mean(self, *a, **k):
        raise Rejected(RejectCode.FAILED_PRECONDITION, "nothing kept")


def _at(seed: int, r: int) -> GlobalState:
    st = _state(seed)
    st.rounds_applied, st.bucket_round = r, [r] * len(st)
    return st


def test_a_void_round_never_installs_a_theta_older_than_that_round_whatever_donors_remain():
    """Round 5, skipped by members a and b; a joiner j at round 1 is live too. Counted void
    (b skipped it too), the run installs round 5 from a's own θ, never the joiner's round 1;
    and a later run whose summaries no longer say so (b stalled) decides afresh: it fails
    rather than take the joiner's θ."""
    R = 5
    me, before = _at(7, R), None
    before = [t.clone() for t in me.theta]
    net = _Donors({"b": (_at(7, R), R, (R,)), "j": (_at(99, 1), 1, ())})
    plan = _plan(R, "a", "b")
    donors = [Member(site_id="b", address="b"), Member(site_id="j", address="j")]
    cu = CatchUp(me, net, get_codec(CodecConfig(name="fp32")), requester="a", progress_timeout_s=2.0)
    assert cu.run(donors, min_round=R + 1, missed=plan) == R
    assert "every other member (b) skipped it too" in cu.stats.void
    assert me.rounds_applied == R and all(torch.equal(a, b) for a, b in zip(me.theta, before))
    net.stalled.add("b")
    with pytest.raises(StateTransferError):
        cu.run(donors, min_round=R + 1, missed=plan)
    assert cu.stats.void is None  # decided again from this run's summaries: b said nothing
    assert me.rounds_applied == R and all(torch.equal(a, b) for a, b in zip(me.theta, before))


class _ClosingDonor:
    """One donor in round 5 whose bucket 0 already took round 5's outer step (its
    ``bucket_round`` is 6) while the round is still open (its summary says 5), as a donor's
    buckets are stepped one by one as their means arrive; the round closes once ``open_for``
    summaries were answered. Its θ passes round 5 unchanged, so every mean of round 5 is
    answered without chunks."""

    def __init__(self, open_for: int) -> None:
        self.state, self.open_for, self.summaries = _state(1), open_for, 0
        self.lock = threading.Lock()
        self.pulled: list[int] = []

    def _round(self) -> int:
        return 5 if self.summaries <= self.open_for else 6

    def pull_state(self, address, bucket, *, requester, timeout_s):
        with self.lock:
            if bucket == len(self.state) + 1:
                self.summaries += 1
                lrs = [tuple(g["lr"] for g in o.param_groups) for o in self.state.optimizers]
                return history_info_state(MeanHistory(4, 1 << 20), self._round(), lrs, index=bucket)
            self.pulled.append(bucket)
            r = 6 if bucket == 0 else self._round()
        return replace(self.state.bucket_state(bucket), rounds_applied=r)

    def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
        from dtrain.protocol import BucketMean

        if round != 5:
            raise Rejected(RejectCode.FAILED_PRECONDITION, f"round {round} is not kept here")
        return BucketMean(round=5, bucket=bucket, owner="", chunks=(), checksum_before="", checksum_after="")


def test_a_bucket_pulled_a_step_ahead_of_its_donors_summary_is_kept_not_pulled_again():
    """A bucket stepped in the donor's open round comes back one round ahead of what the
    donor's summaries say until that round closes. A donor's round never goes back: the run
    brings the other buckets to that bucket's round from the kept means and pulls nothing
    twice (a summary that lowered the target dropped the bucket as "ahead of every donor" and
    pulled it again: CI failed test_a_joiner_whose_pull_spans_ten_rounds on repulled == 2)."""
    donor, joiner = _ClosingDonor(open_for=3), _state(2)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    assert cu.run([Member(site_id="d", address="d")]) == 6
    assert cu.stats.repulled == 0 and sorted(donor.pulled) == list(range(len(joiner))), donor.pulled
    assert joiner.checksums() == donor.state.checksums() and joiner.rounds_applied == 6
    assert set(joiner.bucket_round) == {6}


class _RoundPerPullDonor:
    """One donor, round 5 open, keeping ``kept`` closed rounds of means; pulling bucket 1 finds it
    already stepped in the open round (``bucket_round`` 6), and each later whole-bucket pull
    takes a round (the round closes as it is served). A mean of the open round is "not yet"
    (NOT_FOUND) the first time a bucket asks for it, there the next. θ passes each round
    unchanged, so every mean is answered without chunks. Records every request, in order."""

    def __init__(self, kept: int) -> None:
        self.state, self.round, self.kept = _state(1), 5, kept
        self.lock = threading.Lock()
        self.asked: list[tuple] = []

    def pull_state(self, address, bucket, *, requester, timeout_s):
        with self.lock:
            if bucket == len(self.state) + 1:
                self.asked.append(("summary", self.round))
                lrs = [tuple(g["lr"] for g in o.param_groups) for o in self.state.optimizers]
                span = MeanHistory(self.kept, 1 << 20)
                return history_info_state(span, self.round, lrs, index=bucket)
            self.asked.append(("bucket", bucket))
            if bucket >= 2:
                self.round += 1
            r = self.round + 1 if bucket == 1 and self.round == 5 else self.round
        return replace(self.state.bucket_state(bucket), rounds_applied=r)

    def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
        from dtrain.protocol import BucketMean

        with self.lock:
            self.asked.append(("mean", round, bucket))
            if round < self.round - self.kept or round > self.round:
                raise Rejected(RejectCode.FAILED_PRECONDITION, f"round {round} is not kept here")
            stepped = round < self.round or (round, bucket) == (5, 1) or self.asked.count(("mean", round, bucket)) > 1
            if not stepped:
                raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} bucket {bucket} yet")
        return BucketMean(round=round, bucket=bucket, owner="", chunks=(), checksum_before="", checksum_after="")


def test_a_staged_bucket_whose_mean_is_not_there_yet_waits_for_it_not_behind_the_queue():
    """A mean of the donor's open round not there yet is asked for again by the same stream
    before it takes another whole bucket: sent to the back of the queue, the staged bucket
    waited for every queued pull (each a round here), fell out of the one round kept and was
    pulled again."""
    donor, joiner = _RoundPerPullDonor(kept=1), _state(2)
    n = len(joiner)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False, streams_per_donor=1)
    assert cu.run([Member(site_id="d", address="d")]) == donor.round
    assert cu.stats.repulled == 0, donor.asked
    assert sorted(b for kind, b, *_ in (a for a in donor.asked if a[0] == "bucket")) == list(range(n))
    first = donor.asked.index(("mean", 5, 0))
    assert donor.asked[first + 1] == ("mean", 5, 0), donor.asked  # asked again before the next pull
    assert joiner.checksums() == donor.state.checksums() and set(joiner.bucket_round) == {donor.round}


def test_a_mean_that_never_comes_is_waited_for_within_the_request_timeout_and_the_run_fails_saying_why():
    """A donor whose open round never closes answers "not yet" for ever: the stream asks again
    every 20 ms until its request's timeout, then gives the bucket back; with nothing else to
    pull, the run fails on its progress timeout, installs nothing, and says why."""

    class _NeverCloses(_RoundPerPullDonor):
        def pull_state(self, address, bucket, *, requester, timeout_s):
            with self.lock:
                if bucket != len(self.state) + 1:
                    self.asked.append(("bucket", bucket))
                    r = 6 if bucket == 1 else 5
                    return replace(self.state.bucket_state(bucket), rounds_applied=r)
            return super().pull_state(address, bucket, requester=requester, timeout_s=timeout_s)

        def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
            with self.lock:
                self.asked.append(("mean", round, bucket))
            raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} bucket {bucket} yet")

    donor, joiner = _NeverCloses(kept=4), _state(2)
    before = joiner.checksums()
    cu = CatchUp(
        joiner,
        donor,
        get_codec(CodecConfig(name="fp32")),
        requester="j",
        use_own=False,
        streams_per_donor=1,
        request_timeout_s=1.0,
        progress_timeout_s=1.5,
    )
    t0 = time.monotonic()
    with pytest.raises(StateTransferError, match=r"no progress for 1.5 s at round 6"):
        cu.run([Member(site_id="d", address="d")])
    assert time.monotonic() - t0 < 10.0
    asks = donor.asked.count(("mean", 5, 0))
    assert asks >= 10, donor.asked  # asked again and again by the stream, not once per pass
    assert joiner.checksums() == before and joiner.rounds_applied == 0


class _StaleDonors:
    """Donors ``a`` and ``b`` both at round ``round`` (30); ``a`` keeps the means of rounds 10 on,
    ``b`` of 23 on (θ passes every round unchanged, so each mean comes without chunks). Records
    the requests."""

    round, kept_from = 30, {"a": 10, "b": 23}

    def __init__(self) -> None:
        self.state = _state(1)
        self.asked: list[tuple] = []

    def pull_state(self, address, bucket, *, requester, timeout_s):
        self.asked.append(("summary", address))
        lrs = [tuple(g["lr"] for g in o.param_groups) for o in self.state.optimizers]
        kept = MeanHistory(self.round - self.kept_from[address], 1 << 20)
        return history_info_state(kept, self.round, lrs, index=bucket)

    def pull_mean(self, address, round, bucket, *, requester, timeout_s, have_checksum=""):
        from dtrain.protocol import BucketMean

        self.asked.append(("mean", address, round))
        if not self.kept_from[address] <= round < self.round + self.open_mean(address, round):
            raise Rejected(RejectCode.FAILED_PRECONDITION, f"round {round} is not kept here")
        return BucketMean(round=round, bucket=bucket, owner="", chunks=(), checksum_before="", checksum_after="")

    def open_mean(self, address, round) -> bool:
        """Whether the mean of the open round is there (never, here)."""
        return False


def _mid_pass(donors: _StaleDonors, rounds: dict[str, int], *, target: int, tag: int) -> tuple[CatchUp, Member]:
    """A run's state mid-pass, as ``CatchUp._drive`` and the pulls leave it: donors ``a`` and
    ``b`` last seen at ``rounds``, the target, and bucket 0 staged at round ``tag``."""
    import copy

    from dtrain.rounds.catchup import _Staged

    joiner = _state(2)
    cu = CatchUp(joiner, donors, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    cu._live = {sid: Member(site_id=sid, address=sid) for sid in ("a", "b")}
    cu._rounds, cu._target = dict(rounds), target
    cu._staged[0] = _Staged(copy.deepcopy(joiner.optimizers[0]), tag)
    return cu, cu._live["a"]


def test_a_donor_that_looked_behind_is_asked_where_it_is_before_the_bucket_goes_elsewhere():
    """A staged bucket at round 18, the run's target 30 (a pull from ``b`` said so), and ``a``
    last seen at round 21 while it has gone on to 30. ``a`` replays the bucket to 22 (its round
    as last seen, and the one after it), then is asked where it is and replays it to the
    target. Before, ``a`` was ruled out for the bucket at 21; ``b``, past what it keeps, ruled
    itself out too, and the bucket was pulled again (test_a_joiner_whose_pull_spans_ten_rounds
    failed in CI on ``repulled == 1``)."""
    donors = _StaleDonors()
    cu, a = _mid_pass(donors, {"a": 21, "b": 30}, target=30, tag=18)
    assert cu._advance(a, 0, timeout_s=1.0) == (False, None)
    assert cu._staged[0].tag == 30 and cu._rounds["a"] == 30
    assert donors.asked == [("mean", "a", r) for r in range(18, 22)] + [("summary", "a")] + [
        ("mean", "a", r) for r in range(22, 30)
    ]


class _OpenRoundDonor(_StaleDonors):
    """Donor ``a`` in its open round 25, keeping 10-24; its mean of round 25 for the bucket is
    "not yet" (NOT_FOUND) the first two times it is asked for, there the third."""

    round = 25

    def open_mean(self, address, round) -> bool:
        if round == self.round and self.asked.count(("mean", address, round)) < 3:
            raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} yet")
        return True


def test_a_donor_in_its_open_round_brings_a_bucket_to_the_target_once_that_rounds_mean_arrives():
    """The target is 26 (a bucket stepped in a donor's open round 25 came back a round ahead),
    ``a`` is in round 25 and the staged bucket at 22: ``a`` replays 22-24, then waits for its
    round 25's mean ("not yet" twice) and brings the bucket to 26. Before, ``a`` was ruled out
    for it at 25, and the bucket waited for ``b``'s stream, busy pulling, past what ``b`` kept:
    pulled again (the same CI test, under load)."""
    donor = _OpenRoundDonor()
    cu, a = _mid_pass(donor, {"a": 25, "b": 26}, target=26, tag=22)
    assert cu._advance(a, 0, timeout_s=5.0) == (False, None)
    assert cu._staged[0].tag == 26
    assert donor.asked == [("mean", "a", r) for r in (22, 23, 24, 25, 25, 25)]


def test_a_bucket_in_flight_is_not_taken_from_the_queue_by_a_second_stream():
    """A bucket one stream replays is not handed to another from the queue: two streams stepped
    one staged bucket's optimizer at once, its replay missed the owner's checksum (twice, the
    same round) and it was pulled again (the same CI test, under load: the donors' summaries
    queued every bucket behind the new target while a stream was replaying one of them)."""
    donor, joiner = _StaleDonors(), _state(2)
    cu = CatchUp(joiner, donor, get_codec(CodecConfig(name="fp32")), requester="j", use_own=False)
    cu._live, cu._rounds, cu._target, cu._summarized = {"a": Member(site_id="a", address="a")}, {"a": 30}, 30, True
    cu._queue.extend([0, 1])
    cu._inflight.add(0)  # a stream of this donor (or another) replays bucket 0
    assert cu._next("a") == 1 and cu._inflight == {0, 1} and list(cu._queue) == [0]


def test_a_donor_that_looked_behind_and_times_out_when_asked_is_dropped_and_the_bucket_kept():
    """The summary asked of a donor that looked behind times out: the donor is dropped (named
    in the run's stats), the bucket, replayed as far as it got, stays staged and goes back to
    the queue for another donor; no whole pull is repeated."""

    class _DiesWhenAsked(_StaleDonors):
        def pull_state(self, address, bucket, *, requester, timeout_s):
            self.asked.append(("summary", address))
            raise PeerTimeout(f"{address}: no answer in {timeout_s} s")

    donors = _DiesWhenAsked()
    cu, a = _mid_pass(donors, {"a": 21, "b": 30}, target=30, tag=18)
    assert cu._advance(a, 0, timeout_s=1.0) == (True, None)
    assert cu.stats.donors_lost == ["a"] and "a" not in cu._live and cu.stats.repulled == 0
    assert cu._staged[0].tag == 22  # replayed to a's round as last seen and its open one
    assert donors.asked == [("mean", "a", r) for r in range(18, 22)] + [("summary", "a")]
