"""dtrain doctor's pure parts (issue 37): the advice for a measured path and this host's TCP
settings, the kernel settings reader, the probe's config checks, and the TensorBoard
scalars of a metrics line (and the error when tensorboard is missing)."""

from __future__ import annotations

import importlib.util
import math

import pytest

from dtrain.app.config import DoctorConfig, WorkerConfig
from dtrain.app.doctor import Advice, KernelSettings, advise, format_report, read_kernel_settings
from dtrain.app.tensorboard_sink import round_scalars
from dtrain.probe import PathReport, ProbeConfig

MIB = 1 << 20
# a well-tuned Linux host: BBR, 64 MiB buffers, no slow start after idle
TUNED = KernelSettings(
    congestion_control="bbr",
    available_congestion_control=("reno", "cubic", "bbr"),
    rmem_max_bytes=64 * MIB,
    wmem_max_bytes=64 * MIB,
    tcp_rmem_bytes=(4096, 131072, 64 * MIB),
    tcp_wmem_bytes=(4096, 16384, 64 * MIB),
    slow_start_after_idle=False,
)
# a distribution's defaults
DEFAULTS = KernelSettings(
    congestion_control="cubic",
    available_congestion_control=("reno", "cubic"),
    rmem_max_bytes=212992,
    wmem_max_bytes=212992,
    tcp_rmem_bytes=(4096, 131072, 6291456),
    tcp_wmem_bytes=(4096, 16384, 4194304),
    slow_start_after_idle=True,
)


def _path(**kw) -> PathReport:
    base = dict(
        peer="10.0.0.2:29401",
        rtt_median_s=0.08,
        rtt_p90_s=0.082,
        rtt_min_s=0.079,
        throughput_one_flow_bytes_per_s=100e6 / 8,
        throughput_flows_bytes_per_s=100e6 / 8,
        num_flows=4,
        mtu_bytes=1500,
        loss_fraction=0.0,
        num_loss_probes=1000,
    )
    base.update(kw)
    return PathReport(**base)


def _by_setting(advice: list[Advice]) -> dict[str, Advice]:
    settings = [a.setting for a in advice]
    assert len(settings) == len(set(settings)), settings
    return {a.setting: a for a in advice}


def test_a_clean_path_on_a_tuned_host_keeps_grpc_and_changes_nothing_else():
    adv = _by_setting(advise(_path(), TUNED))
    assert list(adv) == ["--data-path"]
    assert adv["--data-path"].value == "grpc" and "0.00%" in adv["--data-path"].reason


def test_default_kernel_on_a_long_fat_path_gets_buffers_slow_start_and_bbr():
    # 1 Gbit/s x 80 ms = 10 MB in flight: two BDPs round up to 32 MiB
    adv = _by_setting(advise(_path(throughput_flows_bytes_per_s=1e9 / 8), DEFAULTS))
    assert adv["net.ipv4.tcp_rmem"].value == f"4096 131072 {32 * MIB}"
    assert adv["net.ipv4.tcp_wmem"].value == f"4096 16384 {32 * MIB}"
    assert "9.54 MiB (1000 Mbit/s x 80 ms)" in adv["net.ipv4.tcp_rmem"].reason
    # the datagram path asks rate x max(2 RTT, recv_stall_s 1 s) = 125 MB, capped at 64 MiB
    assert adv["net.core.rmem_max"].value == str(64 * MIB) and adv["net.core.wmem_max"].value == str(64 * MIB)
    assert adv["net.ipv4.tcp_slow_start_after_idle"].value == "0"
    assert "~10 RTTs (0.80 s)" in adv["net.ipv4.tcp_slow_start_after_idle"].reason  # log2(10 MB / 14,600 B)
    cc = adv["net.ipv4.tcp_congestion_control"]
    assert cc.value == "bbr" and "RTT 80 ms" in cc.reason and "modprobe tcp_bbr" in cc.reason
    assert [a.kind for a in advise(_path(), DEFAULTS)][:3] == ["kernel"] * 3  # kernel first


def test_buffers_already_large_enough_are_left_alone():
    rate = 10e6 / 8  # x 2 ms: 2.5 kB in flight
    small_path = _path(rtt_median_s=0.002, throughput_one_flow_bytes_per_s=rate, throughput_flows_bytes_per_s=rate)
    adv = _by_setting(advise(small_path, DEFAULTS))
    assert not {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"} & set(adv)
    # but 208 KiB cannot hold the datagram path's 1 s of traffic (1.25 MB): 4 MiB, the smallest advised
    assert adv["net.core.rmem_max"].value == str(4 * MIB) and "asks 1.2 MiB" in adv["net.core.rmem_max"].reason
    assert "net.ipv4.tcp_congestion_control" not in adv  # 2 ms, no loss: cubic is fine


def test_loss_picks_the_datagram_path_with_rate_rtt_and_datagram_size():
    adv = _by_setting(advise(_path(loss_fraction=0.05, throughput_one_flow_bytes_per_s=20e6 / 8), TUNED))
    assert adv["--data-path"].value == "datagram" and "5.0%" in adv["--data-path"].reason
    assert adv["--max-rate-mbit"].value == "100"  # the larger of the two measurements
    assert adv["--net.datagram.rtt-s"].value == "0.080"
    assert adv["--max-datagram-bytes"].value == "1400"
    # on cubic, loss above 0.1% also asks for BBR, here without modprobe (available)
    lossy_cubic = _by_setting(advise(_path(rtt_median_s=0.005, loss_fraction=0.002), DEFAULTS))
    assert lossy_cubic["--data-path"].value == "grpc"
    cc = lossy_cubic["net.ipv4.tcp_congestion_control"]
    assert "loss 0.20%" in cc.reason and "modprobe" in cc.reason  # DEFAULTS has no bbr


def test_datagram_size_follows_the_path_mtu():
    assert _by_setting(advise(_path(mtu_bytes=9000), TUNED))["--max-datagram-bytes"].value == "8900"
    tunnel = _by_setting(advise(_path(mtu_bytes=1400), TUNED))["--max-datagram-bytes"]
    assert tunnel.value == "1300" and "path MTU 1400 bytes (below the usual 1,500): " in tunnel.reason
    assert "--max-datagram-bytes" not in _by_setting(advise(_path(mtu_bytes=1500), TUNED))


def test_codec_is_the_least_lossy_that_fits_the_budget():
    # 100 M params at 100 Mbit/s: fp32 64 s, bf16 32 s, int8 16.7 s, int4 9.3 s
    adv = _by_setting(advise(_path(), TUNED, model_params=100_000_000, sync_budget_s=20))
    assert (
        adv["--codec"].value == "int8" and "fp32 64.0 s, bf16 32.0 s, int8 16.7 s, int4 9.3 s" in adv["--codec"].reason
    )
    assert _by_setting(advise(_path(), TUNED, model_params=100_000_000, sync_budget_s=100))["--codec"].value == "fp32"
    tight = _by_setting(advise(_path(), TUNED, model_params=100_000_000, sync_budget_s=1))["--codec"]
    assert tight.value == "int4" and "--sync-every" in tight.reason
    assert "--codec" not in _by_setting(advise(_path(), TUNED))  # no model size, no codec advice


def test_unmeasured_fields_skip_their_rules():
    blank = PathReport(peer="x:1", notes=("rtt: no echo",))
    assert advise(blank, DEFAULTS) == []
    assert advise(_path(), KernelSettings()) == [a for a in advise(_path(), TUNED)]
    text = format_report(blank, KernelSettings(), [])
    assert "note: rtt: no echo" in text and "nothing to change" in text


def test_read_kernel_settings_from_a_proc_tree(tmp_path):
    files = {
        "net/ipv4/tcp_congestion_control": "cubic\n",
        "net/ipv4/tcp_available_congestion_control": "reno cubic bbr\n",
        "net/core/rmem_max": "212992\n",
        "net/core/wmem_max": "4194304\n",
        "net/ipv4/tcp_rmem": "4096\t131072\t6291456\n",
        "net/ipv4/tcp_wmem": "4096 16384\n",  # malformed: two numbers
        "net/ipv4/tcp_slow_start_after_idle": "1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    k = read_kernel_settings(tmp_path)
    assert k == KernelSettings(
        congestion_control="cubic",
        available_congestion_control=("reno", "cubic", "bbr"),
        rmem_max_bytes=212992,
        wmem_max_bytes=4194304,
        tcp_rmem_bytes=(4096, 131072, 6291456),
        tcp_wmem_bytes=None,
        slow_start_after_idle=True,
    )
    assert read_kernel_settings(tmp_path / "missing") == KernelSettings()


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(num_rtt_probes=0), r"num_rtt_probes must be an int in \[1, 10000\]"),
        (dict(flow_s=2.0, warmup_s=2.0), r"warmup_s must be in \[0, flow_s = 2.0\)"),
        (dict(num_flows=65), r"num_flows must be an int in \[1, 64\]"),
        (dict(max_mtu_bytes=500), r"max_mtu_bytes must be an int in \[min_mtu_bytes = 576, 65535\]"),
        (dict(timeout_s=math.inf), r"timeout_s must be > 0"),
    ],
)
def test_probe_config_names_the_bad_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ProbeConfig(**kw)


def test_doctor_config_checks_peers_and_serve():
    assert DoctorConfig(peer="10.0.0.2:29401, [::1]:5").peer_list() == ["10.0.0.2:29401", "[::1]:5"]
    with pytest.raises(ValueError, match="peer"):
        DoctorConfig(peer="no-port")
    with pytest.raises(ValueError, match="give peers or serve, not both"):
        DoctorConfig(serve=True, peer="a:1")


def test_round_scalars_are_the_status_reports_numbers():
    line = {
        "event": "round",
        "site": "site-0",
        "round": 4,
        "status": "applied",
        "members": ["site-0", "site-1"],
        "val_loss": None,  # not evaluated this round: not written
        "train_loss": 2.5,
        "sync_s": 0.25,
        "bytes_sent": 1000,
        "contributed": False,
        "rejected": {"BAD_TOKEN": 2, "WRONG_ROUND": 1},
        "errors": ["x"],
        "encode_s": 0.1,  # not on the status page
        "time": 1.7e9,
        "reduce_s": 0.5,
        "deadline_reason": "budget 5s: quorum 5.00s (start bound: 1 of 3 rounds seen)",  # text: not a scalar
    }
    assert round_scalars(line) == {
        "round/reduce_s": 0.5,
        "round/train_loss": 2.5,
        "round/sync_s": 0.25,
        "round/bytes_sent": 1000.0,
        "round/contributed": 0.0,
        "round/num_errors": 1.0,
        "round/num_members": 2.0,
        "round/rejected": 3.0,
    }


def test_tensorboard_without_the_package_is_refused_naming_the_field(monkeypatch):
    assert WorkerConfig(tensorboard="tb").tensorboard == "tb"  # installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"tensorboard: .* needs the tensorboard package.*dtrain\[tensorboard\]"):
        WorkerConfig(tensorboard="tb")


def test_doctor_command_line_needs_a_peer_or_serve(capsys):
    from dtrain.app.cli import main

    assert main(["doctor"]) == 2
    assert "peer: give --peer HOST:PORT" in capsys.readouterr().err
    assert main(["doctor", "--peer", "a:1", "--serve"]) == 2
    assert "give peers or serve, not both" in capsys.readouterr().err
    assert main(["doctor", "--peer", "a:1", "--probe.num-flows", "0"]) == 2
    assert "num_flows must be an int in [1, 64]" in capsys.readouterr().err
