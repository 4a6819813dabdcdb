"""The config tree (``dtrain.app.config``, ``dtrain.options``): every option a library
user can set is a flag and a TOML key that round-trips, every flag has help with its
default, bad values give one line naming the field (exit 2), and parsing loads no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, get_args

import pytest

from dtrain.app import cli
from dtrain.app.config import LAUNCH, PER_SITE, RENDEZVOUS, WORKER, WORKER_HIDDEN, LaunchConfig, WorkerConfig
from dtrain.codecs.config import NEEDS_ERROR_FEEDBACK, CodecConfig, CodecName
from dtrain.configs import DiLoCoConfig
from dtrain.options import HostPort, Leaf, field_docs, unit_of
from dtrain.tasks.spec import PRESETS, SizeName

REPO = Path(__file__).resolve().parents[2]
TREES = {"worker": WORKER, "rendezvous": RENDEZVOUS, "launch": LAUNCH}

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ values to set
def _special(tmp: Path) -> dict[str, Any]:
    """Non-default values for leaves whose generic one would be invalid."""
    f = tmp / "file.pem"
    f.write_text("x")
    return {
        "data": str(tmp),
        "tokenizer": str(f),  # checked to exist, read only when a task is built
        "config": "tiny-llama",  # task_spec.hf.config, with task 'hf' (see _values)
        "token_file": str(f),
        "tls_cert": str(f),
        "tls_key": str(f),
        "tls_ca": str(f),
        "store": "etcd://127.0.0.1:2379/run",
        "rendezvous": "10.0.0.1:29400,10.0.0.2:29400",
        "etcd_password_file": str(f),
        "etcd_ca": str(f),
        "etcd_cert": str(f),
        "etcd_key": str(f),
        "norm_bound_ratio": 2.5,
        "site_index": 1,  # num_sites is raised with it (see _values)
        "zstd_level": 7,
        "block_size": 64,
        "sparse_chunk": 1024,
        "keepalive_time_ms": 40_000,
        "server_min_ping_interval_ms": 5_000,
        "chunk_bytes": 1 << 18,
        "bucket_bytes": 1 << 21,
        "min_bucket_bytes": 1 << 15,
        "max_bucket_bytes": 1 << 23,
        "initial_sites": 4,
        "heartbeat_interval_s": 0.5,
        "http_refresh_s": 3.0,
        "broadcast_timeout_s": 30.0,
        "suspect_timeout_s": 2.0,
        "heartbeat_timeout_s": 4.0,  # > heartbeat_interval_s
        "margin": 2.0,  # >= 1 (the deadlines' factor on the observed quantile)
        "sites": 5,
        "retry_initial_backoff_s": 0.5,
        "retry_max_backoff_s": 2.0,
        "inner_step_sleep_s": 0.5,
        "num_fragments": 2,  # must divide sync_every
        "overlap_steps": 1,
        "initial_rate_mbit": 100.0,  # within [min_rate_mbit, max_rate_mbit]
        "site_slowdown": "2=0.5",  # I=SHARE, I < sites
    }


def _other(leaf: Leaf, tmp: Path) -> Any:
    """A valid value of ``leaf`` that differs from its default."""
    special = _special(tmp)
    if leaf.name in special:
        return special[leaf.name]
    if leaf.name == "http_bind" and leaf.kind is str:  # launch's: host:port or off
        return "127.0.0.1:8080"
    if leaf.kind is bool:
        return not leaf.default
    if leaf.choices:
        return next(c for c in leaf.choices if c != leaf.default and c != "topk" and not c.startswith("topk"))
    if leaf.kind is HostPort:
        return HostPort("10.1.2.3", 4567)
    if leaf.kind is int:
        return (leaf.default or 1) + 2
    if leaf.kind is float:
        return 0.25 if not leaf.default else leaf.default * 0.5
    return f"value-of-{leaf.name}"


def _values(leaf: Leaf, tmp: Path) -> dict[str, Any]:
    """``leaf`` set to another value, with the sibling values that value needs."""
    values = {leaf.path: _other(leaf, tmp)}
    parent = leaf.path.rpartition(".")[0]
    if leaf.name == "site_index":
        values[f"{parent}.num_sites"] = 3
    if leaf.name in ("stochastic_rounding", "block_size"):  # int8/int4 only
        values[f"{parent}.name"] = "int8"
    if leaf.name == "topk_fraction":  # topk only
        values[f"{parent}.name"] = "topk"
    if leaf.name == "sparse_mean":  # a sparse codec only
        values[f"{parent.rpartition('.')[0]}.codec.name"] = "sparseloco"
    if leaf.name.startswith("sparse_") and parent.endswith("codec"):  # sparseloco only
        values[f"{parent}.name"] = "sparseloco"
    if leaf.path.endswith("hf.config"):  # goes with task 'hf'
        values[f"{leaf.path.split('task_spec.')[0]}task"] = "hf"
    if leaf.name == "reassign_after_rounds":  # needs non-IID shards to re-assign
        values[f"{parent + '.' if parent else ''}task_spec.non_iid"] = True
    return values


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _cases() -> list[tuple[str, Leaf]]:
    return [(name, leaf) for name, tree in TREES.items() for leaf in tree]


# ------------------------------------------------------------------ the tree covers the library
def _all_fields(cls: type, prefix: str = "") -> list[str]:
    """Every field path of a dataclass tree, nodes included."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        out.append(path)
        tp = hints[f.name]
        args = [a for a in get_args(tp) if a is not type(None)] if typing.get_origin(tp) else [tp]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]) and args[0] is not HostPort:
            out += _all_fields(args[0], path + ".")
    return out


def test_every_field_of_the_worker_tree_is_an_option_or_hidden_with_a_reason() -> None:
    leaves = {leaf.path for leaf in WORKER}
    nodes = set(WORKER.nodes)
    for path in _all_fields(WorkerConfig):
        hidden = [h for h in WORKER_HIDDEN if path == h or path.startswith(h + ".")]
        assert (path in leaves) or (path in nodes) or hidden, f"{path} is neither an option nor hidden"
    # what a library user sets on DiLoCoConfig is all there, except the optimizer hook and
    # three fields the worker sets from its own options (linger_s, task_spec.num_sites, rounds)
    lib = {p for p in _all_fields(DiLoCoConfig) if p not in ("buckets", "rounds", "group")}
    lib -= {"rounds.codec", "rounds.broadcast_codec", "rounds.aggregation"}
    hidden = {"hook_optimizer", "close_timeout_s", "buckets.num_sites", "group.run_rounds"}
    assert {p for p in lib if f"diloco.{p}" not in leaves} == hidden
    assert "linger_s" in leaves and "task_spec.num_sites" in leaves and "rounds" in leaves
    assert WORKER.build({"rounds": 7}).diloco_config().group.run_rounds == 7
    # the examples
    for path in ("diloco.rounds.repair", "diloco.rounds.error_feedback", "diloco.rounds.broadcast_codec.name"):
        assert path in leaves
    for path in ("diloco.rounds.aggregation.trim_fraction", "diloco.rounds.aggregation.norm_bound_ratio"):
        assert path in leaves


def test_every_field_has_documentation() -> None:
    for tree in TREES.values():
        for leaf in tree:
            assert leaf.doc and len(leaf.doc) > 8, f"{leaf.owner.__name__}.{leaf.name} has no Attributes: entry"


@pytest.mark.parametrize("command,leaf", _cases(), ids=[f"{c}:{lf.key}" for c, lf in _cases()])
def test_every_option_round_trips_through_cli_toml_and_argv(command: str, leaf: Leaf, tmp_path: Path) -> None:
    tree = TREES[command]
    values = _values(leaf, tmp_path)
    expected = values[leaf.path]
    # library: build from the values
    built = tree.build(values)
    assert _get(built, leaf.path) == expected
    # command line: the flags to_argv writes parse back to the same config
    argv = tree.to_argv(values)
    p = argparse.ArgumentParser(allow_abbrev=False)
    tree.add_to(p)
    assert tree.build(tree.values_from(p.parse_args(argv))) == built
    # TOML: nested tables following the dots
    toml_doc: dict[str, Any] = {}
    for path, v in values.items():
        key = tree.leaves[path].key.split(".")
        d = toml_doc
        for part in key[:-1]:
            d = d.setdefault(part, {})
        d[key[-1]] = str(v) if isinstance(v, HostPort) else v
    assert tree.build(tree.from_toml(toml_doc, "t.toml")) == built


def test_aliases_keep_the_flat_names_of_readme_and_the_old_config() -> None:
    old_worker = (
        "site_id site_index num_sites listen advertise rendezvous task data size non_iid seed lr batch_size "
        "context_len rounds sync_every codec zstd_level outer_lr outer_momentum nesterov bucket_bytes chunk_bytes "
        "quorum_wait_s token_file tls_cert tls_key tls_ca out_dir checkpoint_dir checkpoint_every resume "
        "eval_every threads max_norm linger_s inner_step_sleep_s"
    ).split()
    for name in old_worker:
        WORKER.resolve(name)  # KeyError if the old name is gone
    assert WORKER.resolve("codec").path == "diloco.rounds.codec.name"
    assert WORKER.resolve("max_norm").path == "diloco.rounds.aggregation.max_norm"
    assert WORKER.resolve("checkpoint-every").path == "checkpoint.every"
    readme_launch = "sites rounds sync_every size data non_iid codec checkpoint_every resume out netem http_port"
    for name in [*readme_launch.split(), "http_bind", "min_sites", "initial_sites"]:
        LAUNCH.resolve(name)
    for name in ("bind", "min_sites", "initial_sites", "token_file", "http_bind"):
        RENDEZVOUS.resolve(name)
    for path in PER_SITE:  # per-site fields are not launch options
        with pytest.raises(KeyError):
            LAUNCH.resolve(path)


def test_flat_and_nested_toml_keys_mean_the_same() -> None:
    flat = WORKER.from_toml({"sync_every": 500, "codec": "int8+zstd", "resume": True}, "a.toml")
    nested = WORKER.from_toml(
        {"diloco": {"sync_every": 500, "rounds": {"codec": {"name": "int8+zstd"}}}, "checkpoint": {"resume": True}},
        "b.toml",
    )
    assert WORKER.build(flat) == WORKER.build(nested)
    cfg = WORKER.build(flat)
    assert cfg.diloco.sync_every == 500 and cfg.diloco.rounds.codec == CodecConfig(name="int8+zstd", zstd_level=1)


def test_booleans_are_dash_x_and_dash_no_x_in_both_directions() -> None:
    argv = WORKER.to_argv({"resume": True, "diloco.rounds.repair": False, "non_iid": True})
    assert argv == ["--checkpoint.resume", "--no-diloco.rounds.repair", "--task-spec.non-iid"]
    assert "True" not in argv and "False" not in argv


def test_to_argv_resolves_aliases_and_writes_none() -> None:
    assert WORKER.to_argv({"sync_every": 5, "max_norm": None, "listen": HostPort("::1", 80)}) == [
        "--diloco.sync-every",
        "5",
        "--diloco.rounds.aggregation.max-norm",
        "none",
        "--net.listen",
        "[::1]:80",
    ]


# ------------------------------------------------------------------ bad values: one line, exit 2
BAD = [
    ("worker --diloco.rounds.aggregation.trim-fraction 0.7", ["trim_fraction", "[0, 0.5)"]),
    ("worker --diloco.rounds.aggregation.norm-bound-ratio 0.5", ["norm_bound_ratio", ">= 1"]),
    ("worker --diloco.buffers sum", ["buffers", "'sum'", "average", "local"]),
    ("worker --broadcast-codec int3", ["broadcast_codec", "'int3'", "int8+zstd"]),
    ("worker --diloco.rounds.num-pull-threads 0", ["num_pull_threads", ">= 1"]),
    ("worker --net.grpc.num-attempts 0", ["num_attempts", "[1, 100]"]),
    ("worker --diloco.group.ready-poll-s 0", ["ready_poll_s", "> 0"]),
    ("worker --codec topk --no-diloco.rounds.error-feedback", ["'topk'", "error_feedback=True"]),
    ("worker --advertise nowhere", ["advertise", "host:port"]),
    ("worker --outer.momentum 1.5", ["momentum", "[0, 1)"]),
    ("worker --checkpoint.every -1", ["every", ">= 0"]),
    ("worker --diloco.rounds.repair maybe", ["unrecognized", "maybe"]),  # yes/no: its value (test_cli)
    ("rendezvous --http-refresh-s 0.1", ["http_refresh_s", "[0.5, 600]"]),
    ("rendezvous --http-bind nowhere", ["http_bind", "host:port"]),
    ("launch --http-bind nowhere", ["http_bind", "host:port"]),
    ("launch --http-bind 127.0.0.1:0 --http-port 8080", ["http_port", "http_bind"]),
    ("launch --diloco.site-id x", ["unrecognized", "--diloco.site-id"]),
    # a nested class's own check, prefixed with its path: which of two codecs' sparse_k is bad
    ("worker --diloco.rounds.broadcast-codec.sparse-k -3", ["diloco.rounds.broadcast_codec.sparse_k must be", "-3"]),
    ("launch --net.datagram.rtt-s -1", ["net.datagram.rtt_s must be", "-1"]),
]
BAD_TOML = [
    ("worker", "[diloco.rounds]\nrepair = 'yes'\n", ["repair", "must be bool", "'yes'"]),
    ("worker", "[diloco.rounds]\nbogus = 1\n", ["bogus", "[diloco.rounds]", "allowed", "repair"]),
    ("worker", "[diloco]\nbuffers = 'sum'\n", ["buffers", "average", "local"]),
    ("worker", "listen = 'x'\n", ["listen", "host:port"]),
    ("worker", "diloco = 3\n", ["diloco", "is a table", "sync_every"]),
    ("launch", '[diloco.rounds]\ncodec = "bf16"\n', ["codec", "is a table ([diloco.rounds.codec])", "name"]),
    ("launch", "[rendezvous]\nmin_sites = 0\n", ["min_sites", ">= 1"]),
    ("launch", "[net]\nlisten = '127.0.0.1:0'\n", ["listen", "set per site"]),
    ("launch", "[diloco]\nhook_optimizer = false\n", ["hook_optimizer", "fixed by the worker"]),
]


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_nested_flag_is_one_line_naming_the_field(argv: str, words: list[str], tmp_path: Path, capsys) -> None:
    args = argv.split() + (["--out", str(tmp_path / "run")] if argv.startswith("launch") else [])
    rc, err = _run(args, capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


@pytest.mark.parametrize("command,text,words", BAD_TOML, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(BAD_TOML)])
def test_a_bad_toml_key_is_one_line_naming_the_field(command, text, words, tmp_path: Path, capsys) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    args = [command, "--config", str(f)] + (["--out", str(tmp_path / "run")] if command == "launch" else [])
    rc, err = _run(args, capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ help
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    out = {}
    for name in ("worker", "rendezvous", "launch", "report"):
        p = cli._parser(name)
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        out[name] = sub.choices[name]
    return out


def test_every_flag_of_every_subcommand_has_help_and_its_default() -> None:
    for name, parser in _subparsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"dtrain {name} {action.option_strings or action.dest} has no help"
            if action.option_strings:
                assert "default: " in action.help, f"dtrain {name} {action.option_strings} shows no default"


def test_help_shows_units_allowed_values_and_groups(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help lines are wrapped
    assert "--sites INT" in out and "[default: 3]" in out
    assert "--log-level LEVEL" in out and "DEBUG, INFO, WARNING, ERROR; default: INFO" in out
    assert "one of: tiny, small, base; default: small" in out
    assert "int8+zstd" in out and "default: int8]" in out
    assert "unit: seconds; default: 300.0" in out  # quorum_wait_s
    for group in ("diloco.rounds.aggregation (AggregationConfig)", "net.grpc (GrpcTransportConfig)", "rendezvous ("):
        assert group in out
    for leaf in LAUNCH:
        assert leaf.flag in out
        if unit_of(leaf.name):
            assert f"unit: {unit_of(leaf.name)}" in leaf_help(leaf)


def leaf_help(leaf: Leaf) -> str:
    from dtrain.options import help_line

    return help_line(leaf)


# ------------------------------------------------------------------ types and pieces
def test_fixed_choices_are_literals_that_match_their_registries() -> None:
    from dtrain.codecs import codec_class

    assert set(get_args(SizeName)) == set(PRESETS)
    names = get_args(CodecName)
    bases = {n.removesuffix("+zstd") for n in names}
    assert len(names) == 2 * len(bases)
    for base in bases:  # the torch-free name list and the codec classes agree
        assert codec_class(base).needs_error_feedback == (base in NEEDS_ERROR_FEEDBACK)
    assert WORKER.resolve("size").choices == get_args(SizeName)
    assert WORKER.resolve("diloco.buffers").choices == ("average", "local")


@pytest.mark.parametrize(
    "text,host,port",
    [("127.0.0.1:0", "127.0.0.1", 0), ("example.org:29400", "example.org", 29400), ("[::1]:80", "::1", 80)],
)
def test_hostport_parses_and_prints_back(text: str, host: str, port: int) -> None:
    hp = HostPort.parse(text, "listen")
    assert (hp.host, hp.port) == (host, port) and str(hp) == text


@pytest.mark.parametrize("text", ["127.0.0.1", ":80", "h:65536", "h:-1", "h:x", ""])
def test_hostport_refuses_naming_the_field(text: str) -> None:
    with pytest.raises(ValueError, match=r"^listen must be host:port with port in \[0, 65535\]"):
        HostPort.parse(text, "listen")


def test_field_docs_reads_google_attributes_sections() -> None:
    class Example:
        """Title.

        Attributes:
            a_s: first line
                continued.
            b, c: shared text with ``code`` and :class:`x.Y`.

        Raises:
            ValueError: not a field.
        """

    assert field_docs(Example) == {
        "a_s": "first line continued.",
        "b": "shared text with code and x.Y.",
        "c": "shared text with code and x.Y.",
    }
    assert unit_of("a_s") == "seconds" and unit_of("chunk_bytes") == "bytes" and unit_of("rate_mbit") == "Mbit/s"
    assert unit_of("sites") is None


def test_launch_defaults_initial_sites_to_the_number_of_sites_and_needs_no_restart_grace() -> None:
    from dtrain.app.launch import _check

    cfg, _, _, rvals = _check({"sites": 4, "out": "/nonexistent/run"})
    assert cfg.rendezvous.initial_sites == 4 and rvals == {"initial_sites": 4, "restart_grace_s": 0.0}
    assert cfg.rendezvous.restart_grace == 0.0
    assert isinstance(cfg, LaunchConfig)
    _, _, _, rvals = _check({"sites": 4, "out": "/nonexistent/run", "rendezvous.restart_grace_s": 3.0})
    assert rvals["restart_grace_s"] == 3.0  # a user's setting wins


def test_launch_writes_worker_argv_that_the_worker_parses_back(tmp_path: Path) -> None:
    from dtrain.app.launch import worker_argv

    opts = {"diloco.rounds.repair": False, "diloco.sync_every": 7, "checkpoint.resume": True}
    argv = worker_argv(opts, index=2, num_sites=3, host="127.0.0.1", rendezvous="127.0.0.1:29400", out_dir=tmp_path)
    ns = cli._parser("worker").parse_args(["worker", *argv])
    cfg = WORKER.build(cli.config_values(WORKER, ns))
    assert (cfg.site_id, cfg.task_spec.site_index, cfg.task_spec.num_sites) == ("site-2", 2, 3)
    assert not cfg.diloco.rounds.repair and cfg.diloco.sync_every == 7 and cfg.checkpoint.resume
    assert cfg.net.rendezvous == "127.0.0.1:29400" and cfg.out_dir == str(tmp_path)


# ------------------------------------------------------------------ nothing heavy before parsing
PROBE = """
import sys
from dtrain.app import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "grpc", "numpy", "matplotlib") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "argv",
    [
        "--help",
        "launch --help",
        "worker --help",
        "rendezvous --help",
        "report --help",
        "worker --sync-every 0",
        "worker --no-such-flag",
        "launch --sites 0",
        "launch --codec bogus",
        "rendezvous --min-sites 0",
        "report /no/such/run",
    ],
)
def test_help_and_usage_errors_import_no_torch_grpc_numpy_or_matplotlib(argv: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *argv.split()], cwd=REPO, env=env, capture_output=True, text=True, timeout=100
    )
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("HEAVY=")]
    assert line == ["HEAVY="], (p.stdout[-500:], p.stderr[-500:])


def test_cli_and_launch_do_not_import_each_other() -> None:
    import ast

    for mod, other in (("cli", "launch"), ("launch", "cli")):
        tree = ast.parse((REPO / "dtrain" / "app" / f"{mod}.py").read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert f"dtrain.app.{other}" not in names or mod == "cli", f"dtrain.app.{mod} imports dtrain.app.{other}"
    tree = ast.parse((REPO / "dtrain" / "app" / "launch.py").read_text())
    assert "dtrain.app.cli" not in {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


@pytest.mark.parametrize(
    "flags,want",
    [
        ([], "127.0.0.1:0"),
        (["--http-bind", "off"], None),  # before: off parsed as None, which meant the default page
        (["--http-bind", "OFF"], None),
        (["--http-bind", "0.0.0.0:8080"], "0.0.0.0:8080"),
        (["--http-port", "8081"], "127.0.0.1:8081"),
        (["--netem", "lossy"], None),  # 127.0.0.1 in the rendezvous's namespace: off unless asked
    ],
)
def test_launch_status_page_is_off_when_asked_auto_by_default(flags: list[str], want: str | None) -> None:
    ns = cli._parser("launch").parse_args(["launch", *flags])
    cfg = LAUNCH.build(cli.config_values(LAUNCH, ns))
    got = cfg.status_page_bind()
    assert (str(got) if got is not None else None) == want
