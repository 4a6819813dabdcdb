"""Datagram wire format and sealing (dtrain/transports/datagram_wire.py): what
authenticates is handed on exactly once, everything else is dropped and counted."""

from __future__ import annotations

import os

import pytest

from dtrain.transports.datagram_wire import (
    CLAIM_BYTES,
    HEADER,
    HEADER_BYTES,
    TAG_BYTES,
    VERSION,
    Dropped,
    Kind,
    Opener,
    ReplayWindow,
    Sealer,
    codec_id,
    contribution_body,
    max_body_bytes,
    split_contribution_body,
)

pytestmark = pytest.mark.timeout(20)

KEY = bytes(range(32))


def _opener(round: int = 3, key: bytes = KEY, members: int = 3) -> Opener:
    op = Opener(run=7, max_datagram_bytes=1400)
    op.open_round(round, key, members)
    return op


def _sealed(body: bytes = b"payload-bytes", *, key: bytes = KEY, round: int = 3, sender: int = 1) -> bytes:
    s = Sealer(key, run=7, round=round, sender=sender)
    return s.seal(Kind.CONTRIB, body, bucket=2, chunk=5, offset=640, numel=128, codec=codec_id("int8"))


def _dropped(op: Opener, data: bytes) -> str:
    with pytest.raises(Dropped) as info:
        op.open(data)
    return info.value.reason


def test_a_sealed_datagram_opens_with_every_header_field() -> None:
    op = _opener()
    h, body = op.open(_sealed())
    assert body == b"payload-bytes"
    assert (h.kind, h.run, h.round, h.bucket, h.chunk, h.offset, h.numel, h.sender) == (
        Kind.CONTRIB,
        7,
        3,
        2,
        5,
        640,
        128,
        1,
    )
    assert h.codec == codec_id("int8") and (h.frag, h.nfrags) == (0, 1)
    assert len(_sealed()) == HEADER_BYTES + len(b"payload-bytes") + TAG_BYTES
    assert sum(op.counts().values()) == 0


def test_sequence_numbers_are_fresh_per_datagram() -> None:
    s = Sealer(KEY, run=7, round=3, sender=0)
    seqs = [HEADER.unpack_from(s.seal(Kind.CONTRIB, b"x"), 0)[11] for _ in range(5)]
    assert seqs == [0, 1, 2, 3, 4]


def test_replayed_datagram_is_dropped_and_counted() -> None:
    op = _opener()
    d = _sealed()
    op.open(d)
    assert _dropped(op, d) == "replayed"
    assert _dropped(op, d) == "replayed"
    assert op.counts()["replayed"] == 2


def test_forged_body_or_header_is_dropped() -> None:
    op = _opener()
    d = bytearray(_sealed())
    d[-20] ^= 1  # a ciphertext bit
    assert _dropped(op, bytes(d)) == "forged"
    d = bytearray(_sealed())
    d[17] ^= 1  # the chunk field of the header (associated data)
    assert _dropped(op, bytes(d)) == "forged"
    d = bytearray(_sealed())
    d[29] ^= 1  # the sender index: sender 0 is a member, but the nonce no longer matches
    assert _dropped(op, bytes(d)) == "forged"
    assert op.counts()["forged"] == 3


def test_the_body_is_sealed_with_aes_256_gcm_and_a_chacha_sealed_datagram_does_not_open() -> None:
    """The wire's AEAD is AES-256-GCM (version 3) under the round's key, the header its associated
    data and the nonce sender | 0 | sequence: a plain AESGCM opens a sealed datagram. A datagram
    sealed as version 2 did (ChaCha20-Poly1305, same key and nonce) is refused: as ``bad_version``
    with its own version byte, as ``forged`` under version 3's."""
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    d = _sealed(b"gcm-body")
    head = d[:HEADER_BYTES]
    assert head[2] == VERSION == 3
    nonce = struct.pack("<HHQ", 1, 0, 0)  # sender 1, its first datagram of the round
    assert AESGCM(KEY).decrypt(nonce, d[HEADER_BYTES:], head) == b"gcm-body"
    op = _opener()
    v2 = bytearray(head)
    v2[2] = 2
    assert _dropped(op, bytes(v2) + ChaCha20Poly1305(KEY).encrypt(nonce, b"gcm-body", bytes(v2))) == "bad_version"
    assert _dropped(op, head + ChaCha20Poly1305(KEY).encrypt(nonce, b"gcm-body", head)) == "forged"
    assert op.open(d)[1] == b"gcm-body"  # the genuine one still opens (its sequence not yet seen)


def test_a_contributions_claim_is_sealed_with_it() -> None:
    """A CONTRIB plaintext is the claim (u64) then the payload: a changed claim byte fails
    authentication like any other; a version-1 datagram (no claim) is refused as such; a
    plaintext shorter than the claim is malformed; a claim that does not fit is refused."""
    op = _opener()
    body = contribution_body(12_345_678_901, b"payload")
    assert len(body) == CLAIM_BYTES + 7 and split_contribution_body(body) == (12_345_678_901, b"payload")
    _, opened = op.open(_sealed(body))
    assert split_contribution_body(opened) == (12_345_678_901, b"payload")
    d = bytearray(_sealed(body))
    d[HEADER_BYTES] ^= 1  # the claim's lowest byte, in the sealed body
    assert _dropped(op, bytes(d)) == "forged"
    old = bytearray(_sealed(body))
    old[2] = 1  # a version-1 sender: its body has no claim
    assert VERSION == 3 and _dropped(op, bytes(old)) == "bad_version"
    with pytest.raises(Dropped, match="malformed"):
        split_contribution_body(b"\x01" * (CLAIM_BYTES - 1))
    for bad in (-1, 1 << 64, 1.5, True):
        with pytest.raises(ValueError, match="Contribution.tokens must be an int"):
            contribution_body(bad, b"")  # type: ignore[arg-type]


def test_wrong_key_wrong_round_wrong_run_are_dropped() -> None:
    op = _opener()
    assert _dropped(op, _sealed(key=os.urandom(32))) == "forged"
    assert _dropped(op, _sealed(round=4)) == "unknown_round"  # its plan has not arrived here
    op.open_round(4, KEY, 3)
    op.close_round(3)
    assert _dropped(op, _sealed(round=3)) == "stale_round"
    other = Opener(run=8, max_datagram_bytes=1400)
    other.open_round(4, KEY, 3)
    assert _dropped(other, _sealed(round=4)) == "wrong_run"
    c = op.counts()
    assert (c["forged"], c["unknown_round"], c["stale_round"]) == (1, 1, 1)
    assert other.counts()["wrong_run"] == 1


def test_truncated_oversized_and_junk_are_dropped() -> None:
    op = _opener()
    d = _sealed()
    assert _dropped(op, d[: HEADER_BYTES + 3]) == "truncated"
    assert _dropped(op, d[:-1]) == "forged"  # a cut tag
    assert _dropped(op, _sealed(b"z" * 1400)) == "oversized"
    assert _dropped(op, b"\x00" * 200) == "bad_magic"
    bad = bytearray(d)
    bad[2] = 9
    assert _dropped(op, bytes(bad)) == "bad_version"
    c = op.counts()
    assert (c["truncated"], c["forged"], c["oversized"], c["bad_magic"], c["bad_version"]) == (1, 1, 1, 1, 1)


def test_sender_index_beyond_the_members_is_dropped() -> None:
    op = _opener(members=2)
    assert _dropped(op, _sealed(sender=5)) == "bad_sender"


def test_opening_a_third_round_retires_the_oldest() -> None:
    op = Opener(run=7, max_datagram_bytes=1400)
    for r in (3, 4, 5):
        op.open_round(r, KEY, 3)
    assert not op.is_open(3) and op.is_open(4) and op.is_open(5)
    assert _dropped(op, _sealed(round=3)) == "stale_round"


def test_replay_window_accepts_reordering_and_refuses_old() -> None:
    w = ReplayWindow(size=8)
    assert [w.check_and_add(s) for s in (0, 2, 1, 2, 9, 3, 1)] == [True, True, True, False, True, True, False]
    assert w.check_and_add(1) is False  # 1 <= 9 - 8: outside the window
    assert w.check_and_add(10) is True


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Sealer(b"short", run=0, round=0, sender=0)
    with pytest.raises(ValueError, match="codec 'nope'"):
        codec_id("nope")
    assert max_body_bytes(1400) == 1400 - HEADER_BYTES - TAG_BYTES
