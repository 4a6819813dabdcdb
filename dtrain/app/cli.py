"""``dtrain worker | rendezvous | launch | doctor | report``.

Every flag and TOML key comes from a config tree (``dtrain.app.config``: the worker's
:class:`~dtrain.app.config.WorkerConfig` nests the library's component configs), by
``dtrain.options.Tree``: dotted flags follow the tree (``--diloco.rounds.repair`` /
``--no-diloco.rounds.repair``), the earlier flat names stay as aliases
(``--sync-every``), and ``--config FILE.toml`` supplies the same options as TOML
tables (``[diloco.rounds]``) or flat keys (``sync_every = 20``); flags override it. A
bad flag or config file prints one line naming the field and the allowed values and
exits with code 2. Nothing heavy (torch, grpc) is imported until the arguments are
parsed and checked, so ``--help`` and usage errors answer at once. Argument parsing
uses the standard library's argparse and tomllib (tomli on Python 3.10).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import threading
import typing
from pathlib import Path
from typing import Any

from dtrain.app.config import DOCTOR, LAUNCH, RENDEZVOUS, WORKER, check_task
from dtrain.options import Tree, UsageError, load_toml

__all__ = ["main", "UsageError"]

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_QUORUM = 3
EXIT_LEFT_BEHIND = 4  # the site's θ is behind the group's round with no member left to pull from
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def one_line(message: object) -> str:
    """``message`` as a single line (a multi-line exception text joined with ' | ')."""
    return " | ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the flag) and exit code 2; an
    unknown flag gets the nearest of the command's flags (``suggest_from``)."""

    suggest_from: list[str] | None = None  # the command's option strings (set by _parser)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args(switch_values(self, list(args)), namespace)

    def error(self, message: str) -> typing.NoReturn:
        hint = did_you_mean(message, self.suggest_from or list(self._option_string_actions))
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}{hint} (see --help)\n")


#: the words a switch's value may be (``--x false``, ``--x=on``), case-insensitive
SWITCH_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def switch_values(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with each switch given a value (``--x false``, ``--x=yes``: a TOML key's
    spelling) written as the switch itself (``--x``) or its negation (``--no-x``), so a
    boolean field takes ``true``/``false`` on the command line as in TOML. A switch followed
    by anything else is left alone; ``--x=VALUE`` with another word is a usage error naming
    the flag and the allowed values."""
    switches = {
        flag
        for a in parser._actions  # noqa: SLF001 - argparse keeps its actions here only
        if isinstance(a, argparse.BooleanOptionalAction)
        for flag in a.option_strings
        if flag.startswith("--") and not flag.startswith("--no-")
    }
    if not switches:
        return args
    out: list[str] = []
    i = 0
    while i < len(args):
        flag, eq, word = args[i].partition("=")
        if flag in switches and (eq or (i + 1 < len(args) and args[i + 1].lower() in SWITCH_WORDS)):
            if not eq:
                word, i = args[i + 1], i + 1
            value = SWITCH_WORDS.get(word.lower())
            if value is None:
                parser.error(
                    f"argument {flag}: a switch takes true or false (or yes/no, on/off, 1/0), got {word!r}: "
                    f"give {flag} or --no-{flag[2:]}"
                )
            out.append(flag if value else f"--no-{flag[2:]}")
        else:
            out.append(args[i])
        i += 1
    return out


def did_you_mean(message: str, options: list[str]) -> str:
    """For argparse's "unrecognized arguments: ..." message, "; did you mean ..." naming the
    nearest option string (difflib's ratio, over the whole flag and over the last part of a
    dotted one) of each unknown ``--flag``; "" when none is near or the message is another."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    by_leaf = {"--" + o.rsplit(".", 1)[-1].lstrip("-"): o for o in options if o.startswith("--")}
    hints = []
    for token in message.split(": ", 1)[1].split():
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        near = difflib.get_close_matches(flag, options, n=1, cutoff=0.8)
        if not near:
            leaf = difflib.get_close_matches("--" + flag.rsplit(".", 1)[-1].lstrip("-"), list(by_leaf), n=1, cutoff=0.8)
            near = [by_leaf[leaf[0]]] if leaf else []
        if near:
            hints.append(f"{flag}: did you mean {near[0]}?")
    return "; " + "; ".join(hints) if hints else ""


def config_values(tree: Tree, ns: argparse.Namespace) -> dict[str, Any]:
    """The options given (by path): ``--config``'s TOML, then the flags over it."""
    values = tree.from_toml(load_toml(ns.config), ns.config) if getattr(ns, "config", None) else {}
    values.update(tree.values_from(ns))
    return values


def build(tree: Tree, values: dict[str, Any]) -> Any:
    """``tree.build(values)``; a config class's ValueError becomes a UsageError."""
    try:
        return tree.build(values)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _setup_logging(level: str = "INFO") -> None:
    """Log lines to stderr; a rank of a site group (torchrun: ``WORLD_SIZE`` > 1) tags its
    lines ``[rank r/K]``: the K ranks of a site write one worker.log."""
    world = os.environ.get("WORLD_SIZE", "1")  # ranks.in_site_group's test, without importing torch here
    tag = f"[rank {os.environ.get('RANK', '?')}/{world}] " if world.isdigit() and int(world) > 1 else ""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s",
        stream=sys.stderr,
    )


# ------------------------------------------------------------------ worker
def _worker_fix(e: Exception) -> str:
    """What to change on ``dtrain worker``'s command line after permanent error ``e``,
    by its type (the library's ``fix`` names config fields, this the flags)."""
    from dtrain.errors import AuthenticationError, BindError, PermanentError
    from dtrain.rendezvous import SiteIdTaken

    if isinstance(e, AuthenticationError):
        return "check that --net.token-file (alias --token-file) holds the same token as the rendezvous's --token-file"
    if isinstance(e, SiteIdTaken):
        return "give each worker of the run its own --site-id (alias of --diloco.site-id)"
    if isinstance(e, BindError):
        return "change --net.listen (alias --listen) to a free port on one of this machine's addresses (port 0: any)"
    return e.fix if isinstance(e, PermanentError) else "fix this worker's settings"


def _cmd_worker(ns: argparse.Namespace) -> int:
    cfg = build(WORKER, config_values(WORKER, ns))
    check_task(cfg.task)
    from dtrain.app.worker import install_signal_handlers, run_worker
    from dtrain.errors import CheckpointError, LeftBehind, PermanentError, QuorumTimeout, RendezvousError

    _setup_logging(ns.log_level)
    stop = threading.Event()
    install_signal_handlers(stop)
    try:
        summary = run_worker(cfg, stop_event=stop)  # also one rank of a site group under torchrun
    except CheckpointError as e:
        print(f"dtrain worker: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except QuorumTimeout as e:
        log.error("giving up: %s", e)
        print(f"dtrain worker: error: {one_line(e)}", file=sys.stderr)
        return EXIT_QUORUM
    except LeftBehind as e:  # never "done" on another θ than the group's
        log.error("giving up: %s", e)
        print(f"dtrain worker: error: {one_line(e)}", file=sys.stderr)
        return EXIT_LEFT_BEHIND
    except PermanentError as e:  # a wrong token, a taken site id, --listen not bindable: fix, then restart
        if isinstance(e, RendezvousError):  # in the log too; a bad --listen is a usage error, one line
            log.error("giving up: %s", e)
        print(f"dtrain worker: error: {one_line(e).rstrip('.')}: {_worker_fix(e)}", file=sys.stderr)
        return EXIT_USAGE
    except RendezvousError as e:  # unreachable while joining, for the whole join budget
        log.error("giving up: %s", e)
        print(f"dtrain worker: error: rendezvous {cfg.net.rendezvous} unreachable: {one_line(e)}", file=sys.stderr)
        return EXIT_QUORUM
    from dtrain.app.ranks import in_site_group

    if not in_site_group() or os.environ.get("RANK") == "0":  # a site group's ranks share one worker.log
        print(json.dumps(summary))
    return 0


# ------------------------------------------------------------------ rendezvous
def _rendezvous_core(cfg):
    """The etcd-backed core of ``--store etcd://...`` (a stateless front-end)."""
    from dtrain.rendezvous.etcd_client import EtcdError
    from dtrain.rendezvous.etcd_store import EtcdRendezvous, EtcdStoreConfig
    from dtrain.status import StatusLog

    password = Path(cfg.etcd_password_file).read_text().strip() if cfg.etcd_password_file else None
    try:
        store = EtcdStoreConfig.parse(
            cfg.store,
            username=cfg.etcd_user,
            password=password,
            ca_file=cfg.etcd_ca,
            cert_file=cfg.etcd_cert,
            key_file=cfg.etcd_key,
        )
        return EtcdRendezvous(store, cfg.rendezvous, reports=StatusLog())
    except ValueError as e:
        raise UsageError(f"store: {e}") from None
    except EtcdError as e:
        raise UsageError(f"store: etcd unreachable: {e}") from None


def _cmd_rendezvous(ns: argparse.Namespace) -> int:
    cfg = build(RENDEZVOUS, config_values(RENDEZVOUS, ns))
    import signal

    from dtrain.app.procs import wait_for_signal
    from dtrain.rendezvous import RendezvousCore
    from dtrain.rendezvous.grpc import serve_rendezvous
    from dtrain.status import StatusLog
    from dtrain.transports.grpc_common import GrpcTransportConfig

    token = Path(cfg.token_file).read_text().strip() if cfg.token_file else None
    _setup_logging(ns.log_level)
    host, port = cfg.bind.host, cfg.bind.port
    http_bind = cfg.http_bind
    core = _rendezvous_core(cfg) if cfg.store else RendezvousCore(cfg.rendezvous, reports=StatusLog())
    try:
        server = serve_rendezvous(core, GrpcTransportConfig(bind_host=host, bind_port=port, token=token))
    except OSError as e:
        raise UsageError(f"bind: cannot listen on {str(cfg.bind)!r}: {e}") from None
    status = None
    if http_bind is not None:  # the read-only status page (dtrain/status_http.py), on its own thread
        from dtrain.status.http import serve_status

        try:
            status = serve_status(core, str(http_bind), refresh_s=cfg.http_refresh_s)
        except OSError as e:
            server.stop(0)
            raise UsageError(f"http_bind: cannot listen on {str(http_bind)!r}: {e}") from None
        print(f"dtrain rendezvous: status page {status.url}", flush=True)
        if cfg.http_address_file:  # written before --address-file, so it exists once that one does
            tmp = Path(cfg.http_address_file + ".tmp")
            tmp.write_text(status.url)
            tmp.replace(cfg.http_address_file)
    if cfg.address_file:
        tmp = Path(cfg.address_file + ".tmp")
        tmp.write_text(server.address)
        tmp.replace(cfg.address_file)
    log.info("rendezvous serving on %s with %s", server.address, cfg.rendezvous)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    wait_for_signal(stop)  # not stop.wait(): a signal taken by one of grpc's threads would not wake it
    if status is not None:
        status.stop()
    server.stop(1.0)
    return 0


# ------------------------------------------------------------------ parser
def _common(parser: argparse.ArgumentParser, config_help: str) -> None:
    group = parser.add_argument_group("command line")
    group.add_argument("--config", metavar="FILE.toml", help=config_help + "; flags override it [default: none]")
    group.add_argument(
        "--log-level",
        default="INFO",
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"log messages of this level and above to stderr [one of: {', '.join(LOG_LEVELS)}; default: INFO]",
    )


_USAGE = "%(prog)s [OPTIONS]  (options below; every one also a --config TOML key)"


#: subcommand -> (its tree, one-line help, description, TOML tables to name in --config's help)
_COMMANDS: dict[str, tuple[Tree, str, str, str]] = {
    "worker": (WORKER, "run one site", "Run one site.", "[diloco.rounds]"),
    "rendezvous": (RENDEZVOUS, "run the membership service", "Run the membership service.", "[rendezvous]"),
    "launch": (
        LAUNCH,
        "start a rendezvous and N workers on this machine",
        "Start a rendezvous and N sites on this machine; every site gets the worker options given here.",
        "[diloco.rounds], [rendezvous]",
    ),
    "doctor": (
        DOCTOR,
        "measure the paths to peers and say what to change",
        "Preflight between sites: RTT, throughput (one and several TCP flows), path MTU and loss to each peer's "
        "`dtrain doctor --serve`, this host's TCP settings, and what to change (sysctls, dtrain options).",
        "[probe]",
    ),
}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: each subcommand's flags generated from its config tree, for
    ``command`` only (the others are listed; building all three costs ~20 ms more)."""
    p = _Parser(prog="dtrain", description="Decentralized DiLoCo training over gRPC.", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (tree, help_, description, tables) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=description, allow_abbrev=False, usage=_USAGE)
        _common(sp, f"TOML file with these options: tables follow the dots ({tables}), the short names work as keys")
        if command == name:
            tree.add_to(sp)
            p.suggest_from = list(sp._option_string_actions)
            p.prog = sp.prog  # an unknown flag's error names the command, as its other errors do
    rp = sub.add_parser(
        "report", help="plots and a markdown summary of a run directory", description="Plots and report.md of a run."
    )
    rp.add_argument("run_dir", help="a run directory written by dtrain launch (holds site-*/metrics.jsonl)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``dtrain ARGV``; returns the exit code.

    Called as a script (``argv`` None), ``worker`` and ``launch`` end with
    ``os._exit`` once their output is flushed: a normal interpreter exit spends
    1-5 s of CPU tearing down torch, time every run and every test pays per process.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    ns = _parser(next((a for a in args if not a.startswith("-")), None)).parse_args(args)
    rc = _dispatch(ns)
    if argv is None and ns.command in ("worker", "launch"):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _dispatch(ns: argparse.Namespace) -> int:
    try:
        if ns.command == "worker":
            return _cmd_worker(ns)
        if ns.command == "rendezvous":
            return _cmd_rendezvous(ns)
        if ns.command == "launch":
            values = config_values(LAUNCH, ns)
            from dtrain.app.launch import run_launch

            return run_launch(values, log_level=ns.log_level)
        if ns.command == "doctor":
            cfg = build(DOCTOR, config_values(DOCTOR, ns))
            if not cfg.serve and not cfg.peer_list():
                raise UsageError(
                    "peer: give --peer HOST:PORT[,HOST:PORT...] (a peer's `dtrain doctor --serve`), or --serve"
                )
            from dtrain.app.doctor import run_doctor

            _setup_logging(ns.log_level)
            return run_doctor(cfg, out=lambda text: print(text, flush=True))
        if ns.command == "report":
            from dtrain.app.report import make_report

            try:
                paths = make_report(ns.run_dir)
            except ValueError as e:
                raise UsageError(str(e)) from None
            for pth in paths:
                print(pth)
            return 0
    except UsageError as e:
        print(f"dtrain {ns.command}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE
