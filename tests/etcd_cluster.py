"""A real 3-member etcd cluster on 127.0.0.1 for tests (Debian's ``etcd-server``).

``etcd_cluster`` (a pytest fixture; import it into a test module) starts three
``etcd`` processes with free-picked client and peer ports, each with its own
``--data-dir`` under ``tmp_path``, waits until one of them is leader, and kills
all of them afterwards, also when the test fails. Tests that use it skip, with
the reason, where ``etcd`` is not installed; with ``DTRAIN_ETCD_REQUIRED=1`` (CI)
they fail instead.

:class:`EtcdCluster` can kill and restart members (``kill``, ``restart``) and
names the current leader (``leader``), for the fault tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrain.rendezvous import RendezvousConfig

__all__ = ["FAST_RENDEZVOUS", "EtcdCluster", "TlsFiles", "etcd_cluster", "require_etcd"]

NUM_MEMBERS = 3
#: Rendezvous timing of the etcd tests: a fault costs a second or two, and a lease (whole
#: seconds in etcd) outlives a loaded machine's pauses.
FAST_RENDEZVOUS = RendezvousConfig(
    min_sites=1,
    initial_sites=3,
    quorum_timeout_s=1.0,
    heartbeat_interval_s=0.3,
    heartbeat_timeout_s=2.0,
    reduce_timeout_s=10.0,
    broadcast_timeout_s=20.0,
)
LEADER_WAIT_S = 15.0  # a fresh cluster elects a leader in ~1 s; CI machines are slow and shared


def require_etcd() -> str:
    """The ``etcd`` binary's path; skips (or fails, with DTRAIN_ETCD_REQUIRED=1) without it."""
    path = shutil.which("etcd")
    if path is None:
        why = "etcd is not installed (apt-get install etcd-server)"
        if os.environ.get("DTRAIN_ETCD_REQUIRED") == "1":
            pytest.fail(f"{why}; DTRAIN_ETCD_REQUIRED=1 says the etcd tests must run")
        pytest.skip(why)
    return path


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None

    scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"


class EtcdCluster:
    """Three etcd members on 127.0.0.1 (see the module docstring).

    Attributes:
        endpoints: ``host:port`` of every member's client port, in member order.
        url: ``etcd://h1:p1,h2:p2,h3:p3`` (what ``--store`` / ``--rendezvous`` take).
    """

    def __init__(self, root: Path, binary: str, *, tls: "TlsFiles | None" = None) -> None:
        self.binary = binary
        self.tls = tls
        ports = _free_ports(2 * NUM_MEMBERS)
        self.members = [
            _Member(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=root / f"m{i}.etcd",
                log_path=root / f"m{i}.log",
            )
            for i in range(NUM_MEMBERS)
        ]
        for m in self.members:
            m.scheme = "https" if tls else "http"
        self._initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        self.endpoints = [f"127.0.0.1:{m.client_port}" for m in self.members]
        self.url = "etcd://" + ",".join(self.endpoints)

    def _argv(self, m: _Member) -> list[str]:
        peer = f"http://127.0.0.1:{m.peer_port}"
        return [
            self.binary,
            f"--name={m.name}",
            f"--data-dir={m.data_dir}",
            f"--listen-client-urls={m.client_url}",
            f"--advertise-client-urls={m.client_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self._initial}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=dtrain-test",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
        ] + (
            [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
            if self.tls
            else []
        )

    def start(self) -> None:
        for m in self.members:
            self._spawn(m)
        self.wait_for_leader()

    def _spawn(self, m: _Member) -> None:
        with open(m.log_path, "ab") as logf:
            m.proc = subprocess.Popen(self._argv(m), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)

    def status(self, i: int) -> dict | None:
        """Member ``i``'s ``/v3/maintenance/status`` answer, or None (down, no answer)."""
        m = self.members[i]
        req = urllib.request.Request(f"{m.client_url}/v3/maintenance/status", data=b"{}", method="POST")
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.tls.ca))
            ctx.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with urllib.request.urlopen(req, timeout=1.0, context=ctx) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def leader(self) -> int | None:
        """Index of the member that is leader now, or None."""
        for i in range(NUM_MEMBERS):
            if self.members[i].proc is None:
                continue
            st = self.status(i)
            if st and st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                return i
        return None

    def wait_for_leader(self, timeout_s: float = LEADER_WAIT_S) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            i = self.leader()
            if i is not None:
                return i
            time.sleep(0.05)
        logs = "\n".join(f"--- {m.name}\n{m.log_path.read_text()[-2000:]}" for m in self.members if m.log_path.exists())
        raise RuntimeError(f"etcd cluster elected no leader within {timeout_s}s\n{logs}")

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data directory stays, so it can be restarted)."""
        m = self.members[i]
        if m.proc is not None:
            os.killpg(m.proc.pid, signal.SIGKILL)
            m.proc.wait(10)
            m.proc = None

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its data directory (it rejoins the cluster)."""
        if self.members[i].proc is None:
            self._spawn(self.members[i])

    def stop(self) -> None:
        for i in range(NUM_MEMBERS):
            try:
                self.kill(i)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for m in self.members:
            shutil.rmtree(m.data_dir, ignore_errors=True)


@dataclass
class TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (PEM files)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, root: Path) -> "TlsFiles":
        """Fresh ones under ``root`` (``openssl``; skips, or fails as etcd does, without it)."""
        if shutil.which("openssl") is None:
            pytest.skip("openssl is not installed")
        root.mkdir(parents=True, exist_ok=True)

        def run(*args: str) -> None:
            if args[0] == "req" and "-subj" not in args:
                args = (*args, "-days", "2", "-subj", "/CN=test-ca")
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=root, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem")
        run_args = ("-days", "2", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-extfile", "ext.cnf")
        # the server certificate is a client one too: etcd's JSON gateway dials etcd's gRPC port with it
        exts = {
            "server": "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth",
            "client": "extendedKeyUsage=clientAuth",
        }
        for name, ext in exts.items():
            run(
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                f"{name}.key",
                "-out",
                f"{name}.csr",
                "-subj",
                f"/CN={name}",
            )
            (root / "ext.cnf").write_text(ext + "\n")
            run("x509", "-req", "-in", f"{name}.csr", "-out", f"{name}.pem", *run_args)
        return cls(root / "ca.pem", root / "server.pem", root / "server.key", root / "client.pem", root / "client.key")


@pytest.fixture
def etcd_cluster(tmp_path):
    """A started :class:`EtcdCluster`; every member killed and its data removed after."""
    binary = require_etcd()
    cluster = EtcdCluster(tmp_path, binary)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
