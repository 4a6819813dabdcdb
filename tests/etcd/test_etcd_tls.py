"""TLS to etcd with client certificates: the rendezvous on an etcd cluster that requires
them (``--client-cert-auth``); without a client certificate the call is refused."""

from __future__ import annotations

import pytest

from dtrain.rendezvous import RendezvousConfig
from dtrain.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls
from dtrain.rendezvous.etcd_store import EtcdRendezvousClient, EtcdStoreConfig
from tests.etcd_cluster import EtcdCluster, TlsFiles, require_etcd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tls_cluster(tmp_path):
    binary = require_etcd()
    files = TlsFiles.make(tmp_path / "pki")
    cluster = EtcdCluster(tmp_path, binary, tls=files)
    try:
        cluster.start()
        yield cluster, files
    finally:
        cluster.stop()


def test_the_rendezvous_runs_over_tls_with_a_client_certificate(tls_cluster) -> None:
    cluster, files = tls_cluster
    url = f"etcds://{','.join(cluster.endpoints)}/tls?ca_file={files.ca}&cert_file={files.client_cert}&key_file={files.client_key}"
    store = EtcdStoreConfig.parse(url)
    assert store.https and store.cert_file == str(files.client_cert)
    c = EtcdRendezvousClient(store, RendezvousConfig(min_sites=1))
    try:
        c.join("a", "addr-a")
        d = c.ready("a", 0, 5.0)
        assert d.status == "plan" and d.plan.site_ids == ("a",)
    finally:
        c.close()
    anonymous = EtcdClient(cluster.endpoints, timeout_s=2.0, tls=EtcdTls(ca_file=str(files.ca)))
    with pytest.raises(EtcdError, match="no member answered"):
        anonymous.get(b"/x")
