"""CatchUp against a scripted donor (no network): a bucket that cannot be replayed to the
donors' round is pulled again, and a pull that only repeats itself fails saying why (issue 33)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.codecs import get_codec
from dtrain.codecs.config import CodecConfig
from dtrain.errors import RejectCode, Rejected, StateTransferError
from dtrain.protocol import Member
from dtrain.rounds.catchup import CatchUp
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
    moving = donor.pull_state

    def pull_state(address, bucket, *, requester, timeout_s):
        st = moving(address, bucket, requester=requester, timeout_s=timeout_s)
        donor.round = 5
        return replace(st, rounds_applied=5) if bucket < len(donor.state) else st

    return pull_state
