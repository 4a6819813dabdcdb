"""Bad flags and bad TOML config files: exit code 2 and ONE line on stderr naming the
field, for ``dtrain worker``, ``rendezvous`` and ``launch`` (issue 4).

Most cases call ``dtrain.app.cli.main(argv)`` in-process (nothing starts: validation
fails first); a few run ``python -m dtrain`` to check the real entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.app.cli import main

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """TOML files, each wrong in one way, plus a valid token file."""
    texts = {
        "unknown_worker": "sync_every = 5\nbogus_key = 1\n",
        "wrong_type_worker": 'sync_every = "five"\n',
        "bool_for_int": "rounds = true\n",
        "syntax": "sync_every = \n",
        "bad_value_worker": "sync_every = 0\n",
        "per_site": 'site_id = "dc-east"\n',
        "unknown_rdv": "min_sites = 1\nbogus_key = 2\n",
        "wrong_type_rdv": 'min_sites = "two"\n',
        "bad_value_rdv": "quorum_timeout_s = -1.0\n",
        "table": "[worker]\nrounds = 2\n",
    }
    out = {}
    for name, text in texts.items():
        f = tmp_path / f"{name}.toml"
        f.write_text(text)
        out[name] = str(f)
    out["missing"] = str(tmp_path / "does-not-exist.toml")
    out["missing_file"] = str(tmp_path / "no-token.txt")
    out["out"] = str(tmp_path / "run")
    return out


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    return rc, capsys.readouterr().err


# (argv with {placeholders} from `files`, words that must be in the one error line)
CASES = [
    # ---- worker
    ("worker --sync-every 0", ["sync_every", ">= 1"]),
    ("worker --sync-every -3", ["sync_every", ">= 1"]),
    ("worker --codec bogus", ["codec", "'bogus'", "int8", "+zstd"]),
    ("worker --rounds x", ["--rounds", "invalid int value"]),
    ("worker --rounds 0", ["rounds", ">= 1"]),
    ("worker --outer-momentum 1.0", ["outer_momentum", "[0, 1)"]),
    ("worker --outer-lr nan", ["outer_lr", "finite"]),
    ("worker --size huge", ["size", "tiny", "small", "base"]),
    ("worker --listen 127.0.0.1", ["listen", "host:port"]),
    ("worker --listen 127.0.0.1:70000", ["listen", "[0, 65535]"]),
    ("worker --rendezvous :29400", ["rendezvous", "host:port"]),
    ("worker --token-file {missing_file}", ["token_file", "existing file"]),
    ("worker --tls-ca {missing_file}", ["tls_ca", "existing file"]),
    ("worker --task no_such_module_xyz:make", ["task", "no_such_module_xyz"]),
    ("worker --task os:no_such_function", ["task", "no_such_function"]),
    ("worker --site-index 3 --num-sites 3", ["site_index", "[0, 2]"]),
    ("worker --no-such-flag 1", ["--no-such-flag"]),
    ("worker --net.datagram.gro=maybe", ["--net.datagram.gro", "true or false", "'maybe'", "--no-net.datagram.gro"]),
    ("worker --config {unknown_worker}", ["bogus_key", "sync_every", "allowed"]),
    ("worker --config {wrong_type_worker}", ["sync_every", "must be int", "'five'"]),
    ("worker --config {bool_for_int}", ["rounds", "must be int", "True"]),
    ("worker --config {syntax}", ["config", "not valid TOML", "line 1"]),
    ("worker --config {bad_value_worker}", ["sync_every", ">= 1"]),
    ("worker --config {table}", ["'worker'", "unknown field"]),
    ("worker --config {missing}", ["config", "does not exist"]),
    # ---- rendezvous
    ("rendezvous --min-sites 0", ["min_sites", ">= 1"]),
    ("rendezvous --min-sites x", ["--min-sites", "invalid int value"]),
    ("rendezvous --quorum-timeout-s 0", ["quorum_timeout_s", "> 0"]),
    ("rendezvous --bind 127.0.0.1", ["bind", "host:port"]),
    ("rendezvous --bind 127.0.0.1:99999", ["bind", "[0, 65535]"]),
    ("rendezvous --token-file {missing_file}", ["token_file", "existing file"]),
    ("rendezvous --config {unknown_rdv}", ["bogus_key", "min_sites", "allowed"]),
    ("rendezvous --config {wrong_type_rdv}", ["min_sites", "must be int", "'two'"]),
    ("rendezvous --config {bad_value_rdv}", ["quorum_timeout_s", "> 0"]),
    ("rendezvous --config {syntax}", ["config", "not valid TOML"]),
    # ---- launch (nothing is started and no run directory is created)
    ("launch --out {out} --sites 0", ["sites", "[1, 64]"]),
    ("launch --out {out} --sites 65", ["sites", "[1, 64]"]),
    ("launch --out {out} --sites x", ["--sites", "invalid int value"]),
    ("launch --out {out} --sync-every 0", ["sync_every", ">= 1"]),
    ("launch --out {out} --codec bogus", ["codec", "'bogus'"]),
    ("launch --out {out} --rounds x", ["--rounds", "invalid int value"]),
    ("launch --out {out} --token-file {missing_file}", ["token_file", "existing file"]),
    ("launch --out {out} --min-sites 0", ["min_sites", ">= 1"]),
    ("launch --out {out} --min-sites 4 --sites 3", ["initial_sites", ">= min_sites (4)"]),
    ("launch --out {out} --task no_such_module_xyz:make", ["task", "no_such_module_xyz"]),
    ("launch --out {out} --listen 127.0.0.1:0", ["--listen"]),  # per-site: not a launch flag
    ("launch --out {out} --net.datagram.gro=maybe", ["--net.datagram.gro", "true or false"]),
    ("launch --out {out} --config {unknown_worker}", ["bogus_key", "allowed"]),
    ("launch --out {out} --config {wrong_type_worker}", ["sync_every", "must be int"]),
    ("launch --out {out} --config {syntax}", ["config", "not valid TOML"]),
    ("launch --out {out} --config {bad_value_worker}", ["sync_every", ">= 1"]),
    ("launch --out {out} --config {per_site}", ["site_id", "set per site"]),
    ("launch --out {out} --config {missing}", ["config", "does not exist"]),
]


@pytest.mark.parametrize(
    "argv,words", CASES, ids=[c[0].split(" {")[0].replace(" ", "_") + f"-{i}" for i, c in enumerate(CASES)]
)
def test_bad_flag_or_config_exits_2_with_one_line_naming_the_field(argv: str, words: list[str], files, capsys) -> None:
    args = [a.format(**files) for a in argv.split()]
    rc, err = _run(args, capsys)
    assert rc == 2, f"exit code {rc}, stderr: {err!r}"
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line: {err!r}"
    assert lines[0].startswith("dtrain"), lines[0]
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    if args[0] == "launch":
        assert not Path(files["out"]).exists(), "launch created the run directory although its settings are bad"


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("--net.datagram.gro", True),
        ("--no-net.datagram.gro", False),
        ("--net.datagram.gro false", False),
        ("--net.datagram.gro=FALSE", False),
        ("--net.datagram.gro off", False),
        ("--net.datagram.gro=yes", True),
        ("--net.datagram.gro 1", True),
    ],
)
def test_a_switch_takes_true_or_false_as_its_toml_key_does(given: str, want: bool) -> None:
    """A boolean field is ``--x`` / ``--no-x``, and also ``--x false`` or ``--x=true`` (the words
    its TOML key takes), for ``dtrain worker`` and ``dtrain launch`` alike."""
    from dtrain.app import cli
    from dtrain.app.config import LAUNCH, WORKER

    ns = cli._parser("worker").parse_args(["worker", *given.split(), "--sync-every", "3"])
    cfg = WORKER.build(WORKER.values_from(ns))
    assert cfg.net.datagram.gro is want and cfg.diloco.sync_every == 3
    ns = cli._parser("launch").parse_args(["launch", *given.split()])
    assert LAUNCH.build(LAUNCH.values_from(ns)).worker.net.datagram.gro is want


@pytest.mark.timeout(30)
def test_launch_refuses_an_existing_run_without_resume(tmp_path: Path, capsys) -> None:
    site = tmp_path / "run" / "site-0"
    site.mkdir(parents=True)
    (site / "metrics.jsonl").write_text('{"event": "start", "round": 0}\n')
    rc, err = _run(["launch", "--out", str(tmp_path / "run"), "--size", "tiny"], capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "out" in err and "--resume" in err and "site-0" in err
    assert (site / "metrics.jsonl").read_text() == '{"event": "start", "round": 0}\n'  # untouched


@pytest.mark.timeout(30)
def test_report_of_a_missing_run_dir_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    rc, err = _run(["report", str(tmp_path / "nope")], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "nope" in err, err


def test_help_lists_worker_flags_from_the_config_fields(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["worker", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--sync-every", "--codec", "--checkpoint-every", "--resume", "--token-file", "--config"):
        assert flag in out


# The real entry point: `python -m dtrain ...` in a fresh process.
ENTRY_CASES = [
    ("worker --sync-every 0", "sync_every"),
    ("rendezvous --token-file {missing_file}", "token_file"),
    ("rendezvous --bind 192.0.2.1:0", "bind"),  # TEST-NET-1: never an address of this machine
    ("worker --size tiny --log-level WARNING --out-dir {out} --listen 192.0.2.1:0 --rendezvous 127.0.0.1:9", "listen"),
    ("launch --out {out} --config {unknown_worker}", "bogus_key"),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv,field", ENTRY_CASES, ids=[f"{c[0].split()[0]}-{c[1]}" for c in ENTRY_CASES])
def test_entry_point_exits_2_with_one_line(argv: str, field: str, files) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        GRPC_VERBOSITY="NONE",
    )  # gRPC's C core logs a failed bind on its own line
    p = subprocess.run(
        [sys.executable, "-m", "dtrain", *[a.format(**files) for a in argv.split()]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.splitlines()) == 1 and field in p.stderr, p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["launch", "--sync-evry", "3"], "--sync-evry: did you mean --sync-every?"),
        (["launch", "--tokenweighted"], "--tokenweighted: did you mean --token-weighted?"),
        (["launch", "--rendezvous.reduce-timeout", "3"], "did you mean --rendezvous.reduce-timeout-s?"),
        (["worker", "--diloco.syncevery=3"], "--diloco.syncevery: did you mean --diloco.sync-every?"),
    ],
)
def test_an_unknown_flag_names_the_nearest_flag_of_its_command(argv: list[str], hint: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unrecognized arguments: {argv[1]}" in err and hint in err, err
    assert err.count("\n") == 1  # still one line


def test_an_unknown_flag_with_nothing_near_gets_no_guess(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--xyz", "1"])
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize("world,tag", [("2", "[rank 1/2] "), ("1", "")])
def test_a_site_groups_ranks_tag_their_log_lines(world: str, tag: str) -> None:
    """The K ranks of a site write one worker.log: each line says which rank wrote it."""
    code = "from dtrain.app.cli import _setup_logging; import logging; _setup_logging(); logging.getLogger('dtrain.x').warning('hi')"
    env = dict(os.environ, WORLD_SIZE=world, RANK="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr.rstrip().endswith(f"WARNING {tag}dtrain.x: hi"), p.stderr
