"""``dtrain worker | rendezvous | launch | report``.

Flags mirror the fields of each component's frozen config dataclass
(``--sync-every`` is ``WorkerConfig.sync_every``); ``--config FILE.toml`` supplies
the same fields as TOML keys (``sync_every = 20``) and flags override it. A bad
flag or config file prints one line naming the field and the allowed values and
exits with code 2. Argument parsing uses the standard library's argparse and
tomllib (tomli on Python 3.10); progress uses tqdm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import typing
from pathlib import Path
from typing import Any

__all__ = ["main"]

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_QUORUM = 3


class UsageError(Exception):
    """A bad flag or config value; printed as one line, exit code 2."""


def one_line(message: object) -> str:
    """``message`` as a single line (a multi-line exception text joined with ' | ')."""
    return " | ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())


def parse_host_port(name: str, value: str) -> tuple[str, int]:
    """Split ``host:port`` (port 0..65535).

    Raises:
        UsageError: naming ``name`` when ``value`` is not ``host:port``.
    """
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{name} must be host:port with port in [0, 65535], got {value!r}")
    return host, int(port)


def check_task(ref: str) -> None:
    """Import ``--task module:function`` now, so a bad reference is a usage error."""
    from dtrain.tasks import load_task

    try:
        load_task(ref)
    except ValueError as e:
        raise UsageError(str(e)) from None


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the flag) and exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _toml_load(path: str) -> dict:
    try:
        import tomllib  # type: ignore[import-not-found]
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config: file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config: {path} is not valid TOML: {e}") from None


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a dataclass field annotation."""
    optional = False
    args = typing.get_args(tp)
    if args:
        non_none = [a for a in args if a is not type(None)]
        optional = len(non_none) < len(args)
        tp = non_none[0]
    return tp, optional


def _add_fields(
    parser: argparse.ArgumentParser, cls: type, *, exclude: tuple[str, ...] = (), group_title: str | None = None
) -> list[str]:
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(group_title) if group_title else parser
    names = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        tp, optional = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_ = f"(default: {default!r})"
        if tp is bool:
            target.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_
            )
        else:
            target.add_argument(
                flag,
                dest=f.name,
                type=tp if tp in (int, float) else str,
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=help_,
            )
        names.append(f.name)
    return names


def _check_toml_types(cls: type, values: dict, path: str) -> dict:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in values.items():
        key = k.replace("-", "_")
        if key not in known:
            raise UsageError(f"config: {path}: unknown field {k!r} (allowed: {', '.join(sorted(known))})")
        tp, optional = _base_type(hints[key])
        ok = (
            (v is None and optional)
            or (tp is float and isinstance(v, (int, float)) and not isinstance(v, bool))
            or (tp is int and isinstance(v, int) and not isinstance(v, bool))
            or (tp is bool and isinstance(v, bool))
            or (tp is str and isinstance(v, str))
        )
        if not ok:
            raise UsageError(f"config: {path}: field {key!r} must be {tp.__name__}, got {v!r}")
        out[key] = float(v) if tp is float else v
    return out


def _build(cls: type, ns: argparse.Namespace, names: list[str], extra: dict | None = None):
    values: dict = {}
    if getattr(ns, "config", None):
        values.update(_check_toml_types(cls, _toml_load(ns.config), ns.config))
    values.update({n: getattr(ns, n) for n in names if hasattr(ns, n)})
    values.update(extra or {})
    try:
        return cls(**values)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# ------------------------------------------------------------------ worker
def _cmd_worker(ns: argparse.Namespace, names: list[str]) -> int:
    from dtrain.app.worker import WorkerConfig, install_signal_handlers, run_worker
    from dtrain.errors import CheckpointError, QuorumTimeout, RendezvousError

    cfg = _build(WorkerConfig, ns, names)
    check_task(cfg.task)
    _setup_logging(ns.log_level)
    stop = threading.Event()
    install_signal_handlers(stop)
    try:
        summary = run_worker(cfg, stop_event=stop)
    except CheckpointError as e:
        print(f"dtrain worker: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except QuorumTimeout as e:
        log.error("giving up: %s", e)
        print(f"dtrain worker: error: {one_line(e)}", file=sys.stderr)
        return EXIT_QUORUM
    except RendezvousError as e:  # unreachable while joining, for the whole join budget
        log.error("giving up: %s", e)
        print(f"dtrain worker: error: rendezvous {cfg.rendezvous} unreachable: {one_line(e)}", file=sys.stderr)
        return EXIT_QUORUM
    except OSError as e:
        if "cannot bind" not in str(e):  # grpc_common.start_server: --listen is taken or not local
            raise
        print(f"dtrain worker: error: listen: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(summary))
    return 0


# ------------------------------------------------------------------ rendezvous
def _cmd_rendezvous(ns: argparse.Namespace, names: list[str]) -> int:
    import signal

    from dtrain.rendezvous import RendezvousConfig, RendezvousCore
    from dtrain.rendezvous.grpc import serve_rendezvous
    from dtrain.status import StatusLog
    from dtrain.transports.grpc_common import GrpcTransportConfig

    cfg = _build(RendezvousConfig, ns, names)
    host, port = parse_host_port("bind", ns.bind)
    http_bind = None if ns.http_bind in (None, "off") else ns.http_bind
    if http_bind is not None:
        parse_host_port("http_bind", http_bind)
    if not 0.5 <= ns.http_refresh_s <= 600:
        raise UsageError(f"http_refresh_s must be in [0.5, 600] seconds, got {ns.http_refresh_s!r}")
    if ns.token_file and not Path(ns.token_file).is_file():
        raise UsageError(f"token_file must be an existing file, got {ns.token_file!r}")
    token = Path(ns.token_file).read_text().strip() if ns.token_file else None
    _setup_logging(ns.log_level)
    core = RendezvousCore(cfg, reports=StatusLog())
    try:
        server = serve_rendezvous(
            core, GrpcTransportConfig(bind_host=host, bind_port=port, token=token, num_server_threads=64)
        )
    except OSError as e:
        raise UsageError(f"bind: cannot listen on {ns.bind!r}: {e}") from None
    status = None
    if http_bind is not None:  # the read-only status page (dtrain/status_http.py), on its own thread
        from dtrain.status.http import serve_status

        try:
            status = serve_status(core, http_bind, refresh_s=ns.http_refresh_s)
        except OSError as e:
            server.stop(0)
            raise UsageError(f"http_bind: cannot listen on {http_bind!r}: {e}") from None
        print(f"dtrain rendezvous: status page {status.url}", flush=True)
        if ns.http_address_file:  # written before --address-file, so it exists once that one does
            tmp = Path(ns.http_address_file + ".tmp")
            tmp.write_text(status.url)
            tmp.replace(ns.http_address_file)
    if ns.address_file:
        tmp = Path(ns.address_file + ".tmp")
        tmp.write_text(server.address)
        tmp.replace(ns.address_file)
    log.info("rendezvous serving on %s with %s", server.address, cfg)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    if status is not None:
        status.stop()
    server.stop(1.0)
    return 0


# ------------------------------------------------------------------ parser
def _parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, list[str]]]:
    """The argument parser. The WorkerConfig flags (whose import loads torch, seconds on
    a busy machine) are added only for ``command`` ``worker`` or ``launch``, so
    ``dtrain rendezvous`` and ``dtrain report`` start fast."""
    from dtrain.app.launch import PER_SITE_FIELDS
    from dtrain.rendezvous import RendezvousConfig

    if command in ("worker", "launch"):
        from dtrain.app.worker import WorkerConfig

    def add_worker_fields(parser: argparse.ArgumentParser, **kw) -> list[str]:
        return _add_fields(parser, WorkerConfig, **kw) if command in ("worker", "launch") else []

    p = _Parser(prog="dtrain", description="Decentralized DiLoCo training over gRPC.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    names: dict[str, list[str]] = {}

    w = sub.add_parser("worker", help="run one site")
    w.add_argument("--config", help="TOML file with WorkerConfig fields; flags override it")
    w.add_argument("--log-level", default="INFO")
    names["worker"] = add_worker_fields(w)

    r = sub.add_parser("rendezvous", help="run the membership service")
    r.add_argument("--config", help="TOML file with RendezvousConfig fields; flags override it")
    r.add_argument("--bind", default="127.0.0.1:29400", help="host:port to listen on (port 0: any)")
    r.add_argument("--address-file", help="write the bound host:port here once listening")
    r.add_argument("--token-file", help="file holding the shared token")
    r.add_argument(
        "--http-bind",
        default=None,
        metavar="HOST:PORT",
        help="serve the read-only status page (/, /api/status, /metrics) here (port 0: any free port; "
        "no authentication: keep it on 127.0.0.1 or a private address); default: off",
    )
    r.add_argument("--http-address-file", help="write the status page's URL here once listening")
    r.add_argument(
        "--http-refresh-s", type=float, default=2.0, help="status page refresh interval, seconds (default: 2)"
    )
    r.add_argument("--log-level", default="INFO")
    names["rendezvous"] = _add_fields(r, RendezvousConfig)

    la = sub.add_parser("launch", help="start a rendezvous and N workers on this machine")
    la.add_argument("--sites", type=int, default=3, help="number of sites (workers)")
    la.add_argument(
        "--ranks-per-site",
        type=int,
        default=1,
        help="K > 1: each site is one torchrun group of K ranks (DDP or FSDP2 by --parallel; default 1)",
    )
    la.add_argument(
        "--max-restarts", type=int, default=0, help="with --ranks-per-site > 1: torchrun restarts of a site's group"
    )
    la.add_argument("--out", default=None, help="run directory (default runs/<timestamp>)")
    la.add_argument("--netem", default=None, help="run each site in its own network namespace with this link profile")
    la.add_argument("--no-progress", action="store_true", help="no live progress bar")
    la.add_argument(
        "--http-bind",
        default=None,
        metavar="HOST:PORT",
        help="the rendezvous's status page address, or 'off' (default: 127.0.0.1 on a free port; "
        "off with --netem); the URL is printed at start",
    )
    la.add_argument(
        "--http-port", type=int, default=None, help="status page on 127.0.0.1:PORT (shorthand for --http-bind)"
    )
    la.add_argument("--config", help="TOML file with WorkerConfig fields for every site")
    la.add_argument("--log-level", default="INFO")
    names["launch_worker"] = add_worker_fields(la, exclude=PER_SITE_FIELDS, group_title="worker settings (every site)")
    names["launch_rendezvous"] = _add_fields(la, RendezvousConfig, group_title="rendezvous settings")

    rp = sub.add_parser("report", help="plots and a markdown summary of a run directory")
    rp.add_argument("run_dir")
    return p, names


def main(argv: list[str] | None = None) -> int:
    """Run ``dtrain ARGV``; returns the exit code.

    Called as a script (``argv`` None), ``worker`` and ``launch`` end with
    ``os._exit`` once their output is flushed: a normal interpreter exit spends
    1-5 s of CPU tearing down torch, time every run and every test pays per process.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    parser, names = _parser(next((a for a in args if not a.startswith("-")), None))
    ns = parser.parse_args(args)
    rc = _dispatch(ns, names)
    if argv is None and ns.command in ("worker", "launch"):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _dispatch(ns: argparse.Namespace, names: dict[str, list[str]]) -> int:
    try:
        if ns.command == "worker":
            return _cmd_worker(ns, names["worker"])
        if ns.command == "rendezvous":
            return _cmd_rendezvous(ns, names["rendezvous"])
        if ns.command == "launch":
            from dtrain.app.launch import run_launch

            return run_launch(ns, names["launch_worker"], names["launch_rendezvous"])
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
