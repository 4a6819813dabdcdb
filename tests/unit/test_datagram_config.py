"""The datagram path's config is one node of the worker's tree (``net.datagram``): every
field of :class:`DatagramTransportConfig` is a flag and a TOML key (the worker's own gRPC
half excepted), bad values are refused naming the field and the allowed values, and the
worker hands the whole node to its transport."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.app import cli
from dtrain.app.config import LAUNCH, WORKER
from dtrain.transports.datagram_config import NATIVE_MODES, DatagramTransportConfig

REPO = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(DatagramTransportConfig) if f.name != "grpc"]

pytestmark = pytest.mark.timeout(60)

# a valid non-default value of every field
OTHER = {
    "run_id": 7,
    "max_datagram_bytes": 8900,
    "max_rate_mbit": 95.0,
    "initial_rate_mbit": 50.0,
    "min_rate_mbit": 2.0,
    "rtt_s": 0.02,
    "recv_stall_s": 0.5,
    "recv_coalesce_s": 0.001,
    "burst_bytes": 32 << 10,
    "max_nack_rounds": 3,
    "nack_copies": 3,
    "nack_idle_s": 0.1,
    "fallback_reserve_s": 2.0,
    "report_wait_s": 0.25,
    "reorder_grace_s": 0.01,
    "max_reorder_grace_s": 0.5,
    "max_round_buffer_bytes": 64 << 20,
    "max_pending_datagrams": 100,
    "test_drop": 0.1,
    "test_drop_seed": 3,
    "native": "off",
    "gso": False,
    "gro": False,
    "switch_interval_s": None,
}

# a bad value of every field, and words its error must contain
BAD = {
    "run_id": (1 << 32, ["run_id", "[0, 2**32)"]),
    "max_datagram_bytes": (100, ["max_datagram_bytes", "[256, 65507]"]),
    "max_rate_mbit": (0.0, ["max_rate_mbit", "> 0"]),
    "initial_rate_mbit": (0.5, ["initial_rate_mbit", "[1.0, 1000.0]"]),
    "min_rate_mbit": (2000.0, ["min_rate_mbit", "(0, max_rate_mbit = 1000.0]"]),
    "rtt_s": (0.0, ["rtt_s", "> 0"]),
    "recv_stall_s": (-1.0, ["recv_stall_s", ">= 0"]),
    "recv_coalesce_s": (0.5, ["recv_coalesce_s", "[0, 0.1]"]),
    "burst_bytes": (1000, ["burst_bytes", ">= max_datagram_bytes (1400)"]),
    "max_nack_rounds": (-1, ["max_nack_rounds", ">= 0"]),
    "nack_copies": (5, ["nack_copies", "[1, 4]"]),
    "nack_idle_s": (0.0, ["nack_idle_s", "> 0"]),
    "fallback_reserve_s": (-1.0, ["fallback_reserve_s", "> 0"]),
    "report_wait_s": (0.0, ["report_wait_s", "> 0"]),
    "reorder_grace_s": (-0.1, ["reorder_grace_s", ">= 0"]),
    "max_reorder_grace_s": (0.001, ["max_reorder_grace_s", ">= reorder_grace_s (0.005)"]),
    "max_round_buffer_bytes": (1000, ["max_round_buffer_bytes", ">= max_datagram_bytes"]),
    "max_pending_datagrams": (-1, ["max_pending_datagrams", ">= 0"]),
    "test_drop": (1.0, ["test_drop", "[0, 1)"]),
    "test_drop_seed": (-1, ["test_drop_seed", ">= 0"]),
    "native": ("maybe", ["native", "auto, on, off"]),
    "gso": ("yes", ["gso", "a bool"]),
    "gro": ("yes", ["gro", "a bool"]),
    "switch_interval_s": (0.0, ["switch_interval_s", "> 0"]),
}


def test_the_tables_cover_every_field() -> None:
    assert sorted(OTHER) == sorted(FIELDS) == sorted(BAD)
    assert len(FIELDS) == 24
    assert all(OTHER[n] != getattr(DatagramTransportConfig(), n) for n in FIELDS)
    assert NATIVE_MODES == ("auto", "on", "off")


def test_every_field_is_a_worker_and_launch_flag_and_toml_key(tmp_path: Path) -> None:
    argv = WORKER.to_argv({f"net.datagram.{n}": v for n, v in OTHER.items()})
    for n in FIELDS:
        flag = "--net.datagram." + n.replace("_", "-")
        assert flag in argv or "--no-" + flag[2:] in argv, flag
    cfg = WORKER.build(WORKER.values_from(cli._parser("worker").parse_args(["worker", *argv])))
    assert {n: getattr(cfg.net.datagram, n) for n in FIELDS} == OTHER
    # the same as TOML, [net.datagram]
    toml = tmp_path / "w.toml"
    toml_value = {True: "true", False: "false"}
    lines = ["[net.datagram]"] + [
        f"{n} = {toml_value[v] if isinstance(v, bool) else repr(v)}" for n, v in OTHER.items() if v is not None
    ]
    toml.write_text("\n".join(lines).replace("'", '"') + "\n")
    from dtrain.options import load_toml

    from_toml = WORKER.build(WORKER.from_toml(load_toml(str(toml)), str(toml)))
    assert {n: getattr(from_toml.net.datagram, n) for n in FIELDS if n != "switch_interval_s"} == {
        n: v for n, v in OTHER.items() if n != "switch_interval_s"
    }
    # launch passes every one to its workers
    launch = LAUNCH.build({f"worker.net.datagram.{n}": v for n, v in OTHER.items()})
    assert launch.worker.net.datagram == cfg.net.datagram


def test_the_flat_names_of_the_readme_still_work_and_are_declared_once() -> None:
    assert WORKER.resolve("max_rate_mbit").path == "net.datagram.max_rate_mbit"
    assert WORKER.resolve("max-datagram-bytes").path == "net.datagram.max_datagram_bytes"
    assert LAUNCH.resolve("max_rate_mbit").path == "worker.net.datagram.max_rate_mbit"
    assert {leaf.path for leaf in WORKER if leaf.name in ("max_rate_mbit", "max_datagram_bytes")} == {
        "net.datagram.max_rate_mbit",
        "net.datagram.max_datagram_bytes",
    }
    cfg = WORKER.build({"max_rate_mbit": 95.0, "max_datagram_bytes": 8900})
    assert cfg.net.datagram.max_rate_mbit == 95.0 and cfg.net.datagram.max_datagram_bytes == 8900


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_naming_the_field_and_the_allowed_values(name: str) -> None:
    value, words = BAD[name]
    with pytest.raises(ValueError) as e:
        DatagramTransportConfig(**{name: value})
    for w in words:
        assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"
    assert repr(value) in str(e.value)


@pytest.mark.parametrize("name", ["run_id", "max_datagram_bytes", "nack_copies", "burst_bytes"])
def test_a_bool_or_float_is_not_an_int(name: str) -> None:
    for v in (True, 1400.5):
        with pytest.raises(ValueError, match=name):
            DatagramTransportConfig(**{name: v})


def test_a_bad_flag_is_one_line_naming_the_field(capsys) -> None:
    for argv, words in (
        (["worker", "--net.datagram.nack-copies", "9"], ["nack_copies", "[1, 4]"]),
        (["worker", "--net.datagram.native", "maybe"], ["native", "auto, on, off"]),
        (["worker", "--max-rate-mbit", "0"], ["max_rate_mbit", "> 0"]),
    ):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and len(err.splitlines()) == 1, err
        for w in words:
            assert w in err, f"{w!r} not in {err!r}"


def test_the_worker_hands_the_whole_node_to_its_transport() -> None:
    from dtrain.app.worker import _transport_and_rendezvous

    values = {f"net.datagram.{n}": v for n, v in OTHER.items() if n != "native"}
    cfg = WORKER.build({"data_path": "datagram", "codec": "int8", "net.grpc.num_attempts": 2, **values})
    transport, rendezvous = _transport_and_rendezvous(cfg)  # nothing bound or dialled until started
    try:
        got = transport.config
        assert {n: getattr(got, n) for n in FIELDS if n != "native"} == {
            n: v for n, v in OTHER.items() if n != "native"
        }
        assert got.grpc == cfg.net.transport_config() and got.grpc.num_attempts == 2
    finally:
        rendezvous.close()


def test_the_datagram_config_imports_no_torch_numpy_or_grpc() -> None:
    code = (
        "import sys, dtrain.transports.datagram_config, dtrain.app.config;"
        "print(sorted(m for m in ('torch', 'numpy', 'grpc') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
