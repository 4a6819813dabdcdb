"""Rendezvous addresses: several front-ends fail over; etcd urls carry the run, timing and TLS files."""

from __future__ import annotations

import pytest

from dtrain.app.config import NetConfig
from dtrain.errors import RendezvousError
from dtrain.protocol import JoinInfo
from dtrain.rendezvous.connect import FailoverRendezvousClient, rendezvous_client
from dtrain.rendezvous.etcd_store import EtcdStoreConfig, timing_from_url

pytestmark = pytest.mark.timeout(30)


class _Fake:
    def __init__(self, name: str, error: str | None = None) -> None:
        self.address, self.error, self.calls = name, error, 0

    def join(self, site_id: str, address: str) -> JoinInfo:
        self.calls += 1
        if self.error:
            raise RendezvousError(f"rendezvous join at {self.address} failed: {self.error}")
        return JoinInfo(next_round=3, members=(), heartbeat_interval_s=1.0, needs_state=False)

    def close(self) -> None:
        pass


def test_fails_over_to_the_next_front_end_and_stays_there() -> None:
    down, up = _Fake("fe1", "UNAVAILABLE: connection refused"), _Fake("fe2")
    c = FailoverRendezvousClient([down, up])
    assert c.join("a", "x").next_round == 3
    assert c.join("a", "x").next_round == 3
    assert (down.calls, up.calls) == (1, 2)  # the second call went straight to fe2


def test_every_front_end_down_names_each_and_a_refusal_is_not_retried() -> None:
    c = FailoverRendezvousClient([_Fake("fe1", "UNAVAILABLE: a"), _Fake("fe2", "DEADLINE_EXCEEDED: b")])
    with pytest.raises(RendezvousError, match="no front-end answered: .*fe1.*UNAVAILABLE.*fe2.*DEADLINE_EXCEEDED"):
        c.join("a", "x")
    refused, other = _Fake("fe1", "FAILED_PRECONDITION: site id 'a' is held"), _Fake("fe2")
    with pytest.raises(RendezvousError, match="is held"):
        FailoverRendezvousClient([refused, other]).join("a", "x")
    assert other.calls == 0


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
