"""Rendezvous addresses: several front-ends fail over; etcd urls carry the run, timing and TLS files."""

from __future__ import annotations

import pytest

from dtrain.app.config import NetConfig
from dtrain.errors import AuthenticationError, PermanentError, RendezvousError, RendezvousRefused
from dtrain.protocol import JoinInfo
from dtrain.rendezvous.connect import FailoverRendezvousClient, rendezvous_client
from dtrain.rendezvous.core import SiteIdTaken
from dtrain.rendezvous.etcd_store import EtcdStoreConfig, timing_from_url

pytestmark = pytest.mark.timeout(30)


class _Fake:
    def __init__(self, name: str, error: Exception | None = None) -> None:
        self.address, self.error, self.calls = name, error, 0

    def join(self, site_id: str, address: str) -> JoinInfo:
        self.calls += 1
        if self.error:
            raise self.error
        return JoinInfo(next_round=3, members=(), heartbeat_interval_s=1.0, needs_state=False)

    def close(self) -> None:
        pass


def test_fails_over_to_the_next_front_end_and_stays_there() -> None:
    down, up = (
        _Fake("fe1", RendezvousError("rendezvous join at fe1 failed: UNAVAILABLE: connection refused")),
        _Fake("fe2"),
    )
    c = FailoverRendezvousClient([down, up])
    assert c.join("a", "x").next_round == 3
    assert c.join("a", "x").next_round == 3
    assert (down.calls, up.calls) == (1, 2)  # the second call went straight to fe2


def test_every_front_end_down_names_each() -> None:
    c = FailoverRendezvousClient(
        [
            _Fake("fe1", RendezvousError("rendezvous join at fe1 failed: UNAVAILABLE: a")),
            _Fake("fe2", RendezvousError("rendezvous join at fe2 failed: DEADLINE_EXCEEDED: b")),
        ]
    )
    with pytest.raises(RendezvousError, match="no front-end answered: .*fe1.*UNAVAILABLE.*fe2.*DEADLINE_EXCEEDED"):
        c.join("a", "x")


@pytest.mark.parametrize(
    "error",
    [
        RendezvousRefused("FAILED_PRECONDITION", "rendezvous join at fe1 refused: run over"),
        SiteIdTaken("site id 'a' is held by a live site at h:2"),
        AuthenticationError("rendezvous join at fe1 refused this site's token (UNAUTHENTICATED: wrong token)"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_answer_is_not_tried_on_another_front_end(error: Exception) -> None:
    refused, other = _Fake("fe1", error), _Fake("fe2")
    with pytest.raises(type(error)) as e:
        FailoverRendezvousClient([refused, other]).join("a", "x")
    assert e.value is error and (refused.calls, other.calls) == (1, 0)


def test_an_outage_is_known_by_its_type_not_its_text() -> None:
    """A plain RendezvousError is an outage even if its text names a refusal's code."""
    odd, up = _Fake("fe1", RendezvousError("FAILED_PRECONDITION in the text only")), _Fake("fe2")
    assert FailoverRendezvousClient([odd, up]).join("a", "x").next_round == 3
    assert up.calls == 1


@pytest.mark.parametrize(
    "code,kind,permanent",
    [
        ("UNAUTHENTICATED", AuthenticationError, True),
        ("ALREADY_EXISTS", SiteIdTaken, True),
        ("FAILED_PRECONDITION", RendezvousRefused, False),
        ("INVALID_ARGUMENT", RendezvousRefused, False),
        ("PERMISSION_DENIED", RendezvousRefused, False),
        ("UNAVAILABLE", RendezvousError, False),
        ("DEADLINE_EXCEEDED", RendezvousError, False),
        ("INTERNAL", RendezvousError, False),
    ],
)
def test_a_grpc_status_maps_to_an_error_type_by_its_code(code: str, kind: type, permanent: bool) -> None:
    import grpc

    from dtrain.rendezvous.grpc import rendezvous_error

    # the details say nothing of the kind: only the code decides
    e = rendezvous_error(grpc.StatusCode[code], "site id 'a' is held; wrong token", "rendezvous join at h:1")
    assert type(e) is kind and isinstance(e, RendezvousError)
    assert isinstance(e, PermanentError) is permanent
    assert code in str(e) or kind is SiteIdTaken
    assert str(e).startswith("rendezvous join at h:1")
    if kind is RendezvousRefused:
        assert e.code.value == code


def test_etcd_urls_give_endpoints_run_timing_and_tls(tmp_path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    url = f"etcds://h1:2379,h2:2379/run7?initial_sites=3&quorum_timeout_s=2.5&username=u&password_file={pw}&ca_file=/ca"
    store = EtcdStoreConfig.parse(url)
    assert store.endpoints == ("h1:2379", "h2:2379") and store.run == "run7" and store.https
    assert (store.username, store.password, store.ca_file) == ("u", "secret", "/ca")
    timing = timing_from_url(url)
    assert (timing.initial_sites, timing.quorum_timeout_s) == (3, 2.5)
    with pytest.raises(ValueError, match="unknown name 'quorum'"):
        EtcdStoreConfig.parse("etcd://h:2379/r?quorum=1")
    with pytest.raises(ValueError, match="an etcd store is etcd://host:port"):
        EtcdStoreConfig.parse("http://h:2379")
    with pytest.raises(ValueError, match="endpoints must be host:port"):
        EtcdStoreConfig.parse("etcd://h1,h2")


def test_the_worker_takes_several_addresses_or_an_etcd_url() -> None:
    assert NetConfig(rendezvous="10.0.0.1:1, 10.0.0.2:2").rendezvous == "10.0.0.1:1,10.0.0.2:2"
    assert NetConfig(rendezvous="etcd://h:2379/r?initial_sites=2").rendezvous == "etcd://h:2379/r?initial_sites=2"
    with pytest.raises(ValueError, match="rendezvous must be host:port"):
        NetConfig(rendezvous="10.0.0.1:1,nope")
    c = rendezvous_client("127.0.0.1:1,127.0.0.1:2")
    assert isinstance(c, FailoverRendezvousClient) and [x.address for x in c.clients] == ["127.0.0.1:1", "127.0.0.1:2"]
    c.close()


def test_a_site_on_etcd_starts_while_etcd_is_down_and_its_calls_say_why() -> None:
    from dtrain.rendezvous.etcd_client import EtcdError
    from dtrain.rendezvous.etcd_store import EtcdRendezvousClient

    c = EtcdRendezvousClient(EtcdStoreConfig.parse("etcd://127.0.0.1:1/r", timeout_s=0.5))  # does not raise
    try:
        with pytest.raises(EtcdError, match=r"no member answered within 0.5s: 127.0.0.1:1: ConnectionRefusedError"):
            c.join("a", "addr-a")
        assert isinstance(EtcdError("x"), RendezvousError)  # a site defers and retries, as for any rendezvous
    finally:
        c.close()


def test_etcd_refusals_carry_the_grpc_code_etcd_answered() -> None:
    """etcd's JSON gateway answers ``{"code": 5, "error": "etcdserver: requested lease not
    found"}``: the client reads the code, not the words (``lease_revoke`` of an unknown lease)."""
    from dtrain.errors import RejectCode
    from dtrain.rendezvous.etcd_client import EtcdError, _reject_code

    assert _reject_code(5) is RejectCode.NOT_FOUND and _reject_code(16) is RejectCode.UNAUTHENTICATED
    assert _reject_code(14) is RejectCode.UNAVAILABLE and _reject_code(9) is RejectCode.FAILED_PRECONDITION
    for odd in (0, 17, -1, None, "5", True):
        assert _reject_code(odd) is RejectCode.UNKNOWN
    assert EtcdError("x").code is None and EtcdError("x", RejectCode.NOT_FOUND).code is RejectCode.NOT_FOUND
