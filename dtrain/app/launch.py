"""``dtrain launch``: a rendezvous and N workers as subprocesses of this machine.

Shows live progress (a tqdm bar on a terminal; one plain line per round when stderr is
not a terminal: a log file, CI, ``nohup``), streams each site's log to
``RUN_DIR/<site>/worker.log``, and ends with a summary table (the ``summary.json``
fields, docs/METRICS.md). Ctrl-C (SIGINT) or SIGTERM stops every child
cleanly (SIGTERM, then SIGKILL after a grace period); a child that crashes is
reported with the last lines of its log while the others go on.
With ``--netem PROFILE`` every site (and the rendezvous) runs in its own network
namespace behind emulated links (``netem/``; root only).
The rendezvous serves its read-only status page (``dtrain.status.http``) on
``--http-bind``/``--http-port`` (default 127.0.0.1, a free port) and launch prints
the URL; ``RUN_DIR/pids.json`` names every child's PID (site id -> pid).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.app.config import LAUNCH, RENDEZVOUS, WORKER, LaunchConfig, check_task
from dtrain.app.procs import Proc, exit_text, spawn, stop_all
from dtrain.app.slowdown import CpuCaps, cgroup_unavailable, parse_slowdown
from dtrain.metrics import MetricsTail, RoundLine, StartLine, read_summary
from dtrain.options import HostPort, UsageError

__all__ = ["run_launch", "rendezvous_argv", "worker_argv"]

log = logging.getLogger(__name__)


def worker_argv(
    options: dict[str, Any], *, index: int, num_sites: int, host: str, rendezvous: str, out_dir: Path
) -> list[str]:
    """``dtrain worker`` flags for site ``index``: the launch's worker ``options`` (by path
    in the worker tree) plus the per-site fields (``dtrain.app.config.PER_SITE``)."""
    return WORKER.to_argv(
        {
            **options,
            "diloco.site_id": f"site-{index}",
            "task_spec.site_index": index,
            "task_spec.num_sites": num_sites,
            "net.listen": HostPort(host, 0),
            "net.rendezvous": str(HostPort.parse(rendezvous, "rendezvous")),
            "out_dir": str(out_dir),
        }
    )


def rendezvous_argv(
    options: dict[str, Any], *, host: str, address_file: Path, http_bind: HostPort | None, http_file: Path
) -> list[str]:
    """``dtrain rendezvous`` flags: RendezvousConfig ``options`` (by field name), the bind
    address and the files it reports its addresses in."""
    values: dict[str, Any] = {"bind": HostPort(host, 0), "address_file": str(address_file)}
    if http_bind is not None:  # the rendezvous writes http_file before address_file
        values.update(http_bind=http_bind, http_address_file=str(http_file))
    values.update({f"rendezvous.{k}": v for k, v in options.items()})
    return RENDEZVOUS.to_argv(values)


def _out(text: str) -> None:
    """The launcher's console output (this module is the ``dtrain launch`` command)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class _SiteView:
    """The lines of one site's metrics.jsonl seen so far (the live view)."""

    def __init__(self, site: str, path: Path) -> None:
        self.site = site
        self.tail = MetricsTail(path)
        self.last: StartLine | RoundLine | None = None
        self.rounds: dict[int, RoundLine] = {}
        self.bytes_sent = 0
        self.starts: list[StartLine] = []  # one per start of its worker (a restart adds one)
        self.starts_told = 1  # the starts already announced (the first is not news)

    def poll(self) -> None:
        for line in self.tail.poll():
            if isinstance(line, RoundLine):
                self.last = line
                self.bytes_sent += line.bytes_sent or 0
                if line.status != "deferred":
                    self.rounds[line.round] = line
            elif isinstance(line, StartLine):
                self.starts.append(line)
                if self.last is None:
                    self.last = line

    def restarts_to_tell(self) -> list[str]:
        """A line for each start of the worker since the last call, after its first (a site
        group restarted by ``--max-restarts``, rejoining at the round it names)."""
        out = [
            f"{self.site} started again (start {k + 1}, at round {st.round}: restarted by --max-restarts)"
            for k, st in enumerate(self.starts)
            if k >= self.starts_told
        ]
        self.starts_told = max(self.starts_told, len(self.starts))
        return out

    @property
    def done_round(self) -> int | None:
        """The last round this site wrote a line for, or None."""
        return self.last.round if isinstance(self.last, RoundLine) else None


def _range(vals: list[float], fmt: str) -> str:
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def progress_line(r: int, total: int, lines: list[RoundLine], sent_so_far: int) -> str:
    """One plain progress line for round ``r`` (numbered from 0, as in the metrics; then
    how many of ``total`` rounds that makes) from the sites' lines of that round:
    members (the most any site saw), the val_loss range, the bytes_sent of this round's
    lines summed over sites (and of every line so far), and the sync_s range."""
    members = max((len(x.members) for x in lines), default=0)
    vl = [x.val_loss for x in lines if isinstance(x.val_loss, (int, float))]
    sync = [x.sync_s for x in lines if isinstance(x.sync_s, (int, float))]
    sent = sum(x.bytes_sent or 0 for x in lines)
    return (
        f"round {r} ({r + 1}/{total}): members {members}, val_loss {_range(vl, '.3f')}, "
        f"bytes_sent {sent / 1e6:.2f} MB ({sent_so_far / 1e6:.2f} MB so far), sync_s {_range(sync, '.2f')}"
    )


class _PlainProgress:
    """Writes one :func:`progress_line` per round once every running site has written
    that round (or gone past it); rounds no running site has a line for are not shown."""

    def __init__(self, total: int, write) -> None:
        self.total = total
        self.write = write
        self.next: int | None = None
        self.sent = 0

    def update(self, views: list[_SiteView]) -> None:
        done = [v.done_round for v in views]
        if not done or any(d is None for d in done):
            return
        if self.next is None:
            self.next = min(min(v.rounds, default=d) for v, d in zip(views, done))  # type: ignore[type-var]
        upto = min(done)  # type: ignore[type-var]
        while self.next <= upto:
            lines = [v.rounds[self.next] for v in views if self.next in v.rounds]
            if lines:
                self.sent += sum(x.bytes_sent or 0 for x in lines)
                self.write(progress_line(self.next, self.total, lines, self.sent))
            self.next += 1


def _format_table(rows: list[dict]) -> str:
    # Headers are the summary.json fields (docs/METRICS.md), so the table reads like the summary.
    cols = [
        ("site", "site", "{}"),
        ("final_val_loss", "final_val_loss", "{:.4f}"),
        ("θ checksum", "checksum", "{}"),
        ("rounds_joined", "rounds_joined", "{}"),
        ("owned_buckets", "owned", "{}"),  # owned_buckets/num_buckets (the last round it ran)
        ("bytes_sent", "bytes_sent", "{:,}"),
        ("bytes_received", "bytes_received", "{:,}"),
        ("compression_ratio", "compression_ratio", "{:.1f}x"),
        ("sync_share", "sync_share", "{:.1%}"),
    ]
    cells = [[h for h, _, _ in cols]]
    for r in rows:
        if r.get("owned_buckets") is not None and r.get("num_buckets") is not None:
            r = {**r, "owned": f"{r['owned_buckets']}/{r['num_buckets']}"}
        row = []
        for _, k, fmt in cols:
            v = r.get(k)
            row.append("-" if v is None else (fmt.format(v) if not isinstance(v, str) or fmt == "{}" else v))
        cells.append(row)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    out = []
    for i, row in enumerate(cells):
        out.append("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _open_topology(num_sites: int, profile: str):
    """Build ``num_sites`` emulated sites with the repository's ``netem`` package.

    ``netem/`` is repository tooling, not part of the wheel: it is imported from the
    current directory or from the checkout this package lives in. Needs root.
    Raises UsageError naming ``netem`` when it cannot be used here.
    """
    try:
        import netem  # noqa: PLC0415
    except ImportError:
        root = Path(__file__).resolve().parent.parent
        if (root / "netem" / "__init__.py").exists():
            sys.path.insert(0, str(root))
        try:
            import netem  # noqa: PLC0415
        except ImportError as e:
            raise UsageError(
                f"netem: the repository's netem/ package is not importable ({e}); run from a dtrain checkout"
            ) from None
    if profile not in netem.PROFILES:
        raise UsageError(f"netem: unknown profile {profile!r}; allowed: {', '.join(sorted(netem.PROFILES))}")
    missing = netem.missing_requirements()
    if missing:
        raise UsageError(f"netem: cannot emulate links here: missing {', '.join(missing)}")
    topo = netem.Topology(num_sites=num_sites, profile=profile, name="launch")
    log.info("netem: %d sites, profile %s, backends %s", num_sites, profile, topo.backends())
    return topo


def _check(values: dict[str, Any]) -> tuple[LaunchConfig, Path, dict[str, Any], dict[str, Any]]:
    """Every setting checked up front (the worker's and rendezvous's own rules, with site-0's
    per-site values), before anything is created or started.

    Returns the config, the run directory, and the worker and rendezvous options given.
    """
    n = values.get("sites", LaunchConfig().sites)
    if not isinstance(n, int) or not 1 <= n <= 64:
        raise UsageError(f"sites must be an int in [1, 64], got {n!r}")
    run_dir = Path(values.get("out") or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    # round 0 waits for every site by default; the rendezvous is never restarted under running
    # sites, so a resumed run's first round needs no restart grace (it waits for every site too)
    values = {"rendezvous.initial_sites": n, "rendezvous.restart_grace_s": 0.0, **values}
    site0 = {"worker.task_spec.num_sites": n, "worker.out_dir": str(run_dir / "site-0")}
    try:
        cfg = LAUNCH.build({**values, **site0})
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_task(cfg.worker.task)
    worker = {p.removeprefix("worker."): v for p, v in values.items() if p.startswith("worker.")}
    rendezvous = {p.removeprefix("rendezvous."): v for p, v in values.items() if p.startswith("rendezvous.")}
    return cfg, run_dir, worker, rendezvous


def _redacted(store: str | None) -> str | None:
    """The store url without its query (it may name credential files)."""
    return store.partition("?")[0] if store else store


def _site_group_argv(cfg: LaunchConfig, argv: list[str]) -> list[str]:
    """With ``ranks_per_site`` K > 1: the worker command as one torchrun group of K ranks
    (torchrun's own standalone rendezvous on a port its agent binds); else unchanged."""
    if cfg.ranks_per_site <= 1:
        return argv
    from dtrain.app.ranks import torchrun_argv

    return torchrun_argv(argv, num_ranks=cfg.ranks_per_site, max_restarts=cfg.max_restarts)


@dataclass
class _Run:
    """One launch: its checked plan and the children it started (filled in by the steps)."""

    cfg: LaunchConfig
    run_dir: Path
    wvals: dict[str, Any]
    rvals: dict[str, Any]
    log_level: str
    topo: Any = None  # a netem.Topology with sites + 1 sites (the rendezvous in the last), or None
    slow: dict[int, float] = field(default_factory=dict)  # --site-slowdown: site index -> compute share
    caps: Any = None  # the slowed sites' cgroups (dtrain.app.slowdown.CpuCaps; --slowdown-by cgroup)
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    stopping: dict[str, Any] = field(default_factory=lambda: {"flag": False, "count": 0})

    @property
    def append(self) -> bool:
        """A resumed run appends to the earlier logs."""
        return self.cfg.worker.checkpoint.resume

    def host(self, i: int) -> str:
        """The address of site i (i == sites: the rendezvous)."""
        return self.topo.address(i) if self.topo is not None else "127.0.0.1"

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside site i's network namespace with ``--netem``; else unchanged."""
        return self.topo.exec_argv(i, argv) if self.topo is not None else argv


class _Abort(Exception):
    """A launch step ended the launch before the sites were watched, with this exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


_PY = [sys.executable, "-m", "dtrain"]


def run_launch(values: dict[str, Any], *, log_level: str = "INFO") -> int:
    """Run ``dtrain launch`` with ``values``: launch options by path in
    ``dtrain.app.config.LAUNCH`` (from the flags and ``--config``). Returns the exit code.

    Raises:
        UsageError: a bad setting (nothing has been started or created then).
    """
    run = _plan(values, log_level)
    rv_argv = _rendezvous_command(run)
    old = _trap_signals(run)
    try:
        rv_addr = _start_rendezvous(run, rv_argv)
        views = _start_sites(run, rv_addr)
        exit_code = _watch(
            run.procs, views, run.cfg.worker.rounds, no_progress=not run.cfg.progress, stopping=run.stopping
        )
    except _Abort as e:
        return e.code
    finally:
        _stop(run, old)
    return _finish(run.run_dir, run.cfg.sites, run.procs, exit_code)


def _plan(values: dict[str, Any], log_level: str) -> _Run:
    """Check every setting, refuse a run dir that holds a run unless resuming, create it, open netem."""
    cfg, run_dir, wvals, rvals = _check(values)
    if not cfg.worker.checkpoint.resume:
        old_runs = sorted(str(m.parent.name) for m in run_dir.glob("*/metrics.jsonl"))
        if old_runs:
            raise UsageError(
                f"out: {str(run_dir)!r} already holds a run ({', '.join(old_runs)} have metrics); "
                "pass --resume to continue it or choose another --out"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    slow = parse_slowdown(cfg.site_slowdown, cfg.sites)
    why = cgroup_unavailable() if slow and cfg.slowdown_by == "cgroup" else None
    if why is not None:
        raise UsageError(f"site_slowdown: {why}; use --slowdown-by stretch (each step stretched by 1/SHARE instead)")
    topo = _open_topology(cfg.sites + 1, cfg.netem) if cfg.netem else None
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = _Run(cfg=cfg, run_dir=run_dir, wvals=wvals, rvals=rvals, log_level=log_level, topo=topo, env=env, slow=slow)
    if slow and cfg.slowdown_by == "cgroup":
        run.caps = CpuCaps(f"{run_dir.resolve().name}-{os.getpid()}")
        busy = cfg.sites * cfg.ranks_per_site * cfg.worker.threads
        if busy > (os.cpu_count() or 1):
            _err(
                f"dtrain launch: {busy} worker threads on {os.cpu_count()} CPUs: a site that gets less than its "
                "cgroup cap anyway is not slowed by it (--slowdown-by stretch slows relative to the load)"
            )
    return run


def _rendezvous_command(run: _Run) -> list[str]:
    """The rendezvous's command line; clears its address and status-page files, writes launch.json."""
    cfg, run_dir = run.cfg, run.run_dir
    addr_file = run_dir / "rendezvous.addr"
    addr_file.unlink(missing_ok=True)
    http_file = run_dir / "status.url"
    http_file.unlink(missing_ok=True)
    argv = _PY + ["rendezvous", "--log-level", run.log_level]
    argv += rendezvous_argv(
        run.rvals,
        host=run.host(cfg.sites),
        address_file=addr_file,
        http_bind=cfg.status_page_bind(),
        http_file=http_file,
    )
    if cfg.store:  # the rendezvous is a stateless front-end on etcd
        argv += ["--store", cfg.store]
    (run_dir / "launch.json").write_text(
        json.dumps(
            {
                "sites": cfg.sites,
                # every launch-level setting (a slowed site, a site group's ranks) is part of the record
                "ranks_per_site": cfg.ranks_per_site,
                "max_restarts": cfg.max_restarts,
                "site_slowdown": cfg.site_slowdown,
                "slowdown_by": cfg.slowdown_by if cfg.site_slowdown else None,
                "worker": run.wvals,
                "rendezvous": run.rvals,
                "netem": cfg.netem,
                "store": _redacted(cfg.store),
            },
            indent=2,
            default=str,
        )
    )
    return argv


def _trap_signals(run: _Run) -> dict[int, Any]:
    """SIGINT/SIGTERM set ``run.stopping``; a second one SIGKILLs every child. Returns the old handlers."""

    def on_signal(signum, frame):  # noqa: ARG001
        run.stopping["flag"] = True
        run.stopping["count"] += 1
        if run.stopping["count"] > 1:  # a second Ctrl-C: kill every child now
            for p in run.procs.values():
                p.send(signal.SIGKILL)

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def _start_rendezvous(run: _Run, argv: list[str]) -> str:
    """Spawn the rendezvous and wait (<= 30 s) for its address; print the status page's URL.

    Raises:
        _Abort: 130 when interrupted first, 1 when the rendezvous exited or did not start in time.
    """
    addr_file = run.run_dir / "rendezvous.addr"
    rv = run.procs["rendezvous"] = spawn(
        "rendezvous", run.wrap(run.cfg.sites, argv), run.run_dir / "rendezvous.log", env=run.env, append=run.append
    )
    t0 = time.monotonic()
    while not addr_file.exists():
        if run.stopping["flag"]:
            _err("dtrain launch: interrupted before the rendezvous started")
            raise _Abort(130)
        if rv.poll() is not None or time.monotonic() - t0 > 30:
            _err(f"rendezvous failed to start:\n{rv.tail()}")
            raise _Abort(1)
        time.sleep(0.05)
    if run.cfg.status_page_bind() is not None:
        _out(f"dtrain launch: status page {(run.run_dir / 'status.url').read_text().strip()}")
    return addr_file.read_text().strip()


def _start_sites(run: _Run, rv_addr: str) -> dict[str, _SiteView]:
    """Spawn one worker per site (stopping early on a signal), write pids.json; the sites' metrics views."""
    n, log_level = run.cfg.sites, run.log_level
    views: dict[str, _SiteView] = {}
    for i in range(n):
        if run.stopping["flag"]:
            break
        site = f"site-{i}"
        sdir = run.run_dir / site
        sdir.mkdir(parents=True, exist_ok=True)
        (sdir / "summary.json").unlink(missing_ok=True)  # a previous run's (with --resume) must not count
        argv = _PY + ["worker", "--log-level", log_level]
        wvals = run.wvals
        if i in run.slow and run.caps is None:  # --slowdown-by stretch
            wvals = {**wvals, "slowdown": run.slow[i]}
        argv += worker_argv(wvals, index=i, num_sites=n, host=run.host(i), rendezvous=rv_addr, out_dir=sdir)
        argv = _site_group_argv(run.cfg, argv)
        if i in run.slow and run.caps is not None:
            cpus = run.cfg.worker.threads * run.cfg.ranks_per_site
            argv = CpuCaps.wrap(run.caps.create(i, run.slow[i], cpus), argv)
        run.procs[site] = spawn(site, run.wrap(i, argv), sdir / "worker.log", env=run.env, append=run.append)
        views[site] = _SiteView(site, sdir / "metrics.jsonl")
    (run.run_dir / "pids.json").write_text(json.dumps({s: p.pid for s, p in run.procs.items()}, indent=2))
    _out(
        f"dtrain launch: {n} sites, data path {run.cfg.worker.net.data_path}, rendezvous {rv_addr}, run dir {run.run_dir}"
    )
    return views


def _stop(run: _Run, old_handlers: dict[int, Any]) -> None:
    """Stop the workers (they leave through the rendezvous), then the rendezvous; close netem; restore signals."""
    stop_all([p for s, p in run.procs.items() if s != "rendezvous"])
    if "rendezvous" in run.procs:
        stop_all([run.procs["rendezvous"]])
    if run.topo is not None:
        run.topo.close()
    if run.caps is not None:
        run.caps.remove()
    for s, h in old_handlers.items():
        signal.signal(s, h)


def _show_bar(bar, views: list[_SiteView], rounds: int) -> None:
    lasts = [v.last for v in views if isinstance(v.last, RoundLine)]
    if not lasts:
        return
    bar.n = min(rounds, min(x.round + 1 for x in lasts))
    vl = [x.val_loss for x in lasts if isinstance(x.val_loss, (int, float))]
    sent = sum(v.bytes_sent for v in views)
    bar.set_postfix_str(
        f"val_loss {_range(vl, '.3f')} | bytes_sent {sent / 1e6:.1f} MB | sync_s {max(x.sync_s or 0.0 for x in lasts):.2f}"
        f" | members {max(len(x.members) for x in lasts)}",
        refresh=False,
    )
    bar.refresh()


def _watch(procs: dict[str, Proc], views: dict[str, _SiteView], rounds: int, *, no_progress: bool, stopping) -> int:
    """Follow the sites until every worker exited or a signal came (0, or 130 when
    interrupted). Progress: a tqdm bar when stderr is a terminal, else one plain
    :func:`progress_line` per round on stderr; neither with ``--no-progress``. A worker
    that exits with an error is reported with its log tail while the others go on."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    plain = _PlainProgress(rounds, lambda text: _err("dtrain launch: " + text)) if not (tty or no_progress) else None
    bar = tqdm(total=rounds, desc="rounds", unit="round", disable=no_progress or not tty, dynamic_ncols=True)
    crashed: dict[str, int] = {}
    while True:
        finished = all(p.poll() is not None for s, p in procs.items() if s != "rendezvous")
        for v in views.values():
            v.poll()
            for text in v.restarts_to_tell():
                tqdm.write("dtrain launch: " + text, file=sys.stderr)
        live = [v for s, v in views.items() if s not in crashed]
        _show_bar(bar, live, rounds)
        if plain is not None:
            plain.update(live)
        for site, p in procs.items():
            rc = p.poll()
            if site != "rendezvous" and site not in crashed and rc not in (None, 0):
                crashed[site] = rc
                tqdm.write(f"!! {site} exited with code {exit_text(rc)}; last log lines:\n{p.tail()}")
        if finished or stopping["flag"]:
            break
        time.sleep(0.5)
    bar.close()
    if stopping["flag"]:
        _err("dtrain launch: interrupted; stopping every site")
        return 130
    return 0


def _starts(metrics_path: Path) -> list[dict]:
    """The ``start`` lines of a site's metrics.jsonl, in order (one per start of its worker:
    more than one after a restart, ``--max-restarts``)."""
    out = []
    try:
        text = metrics_path.read_text()
    except OSError:
        return out
    for raw in text.splitlines():
        try:
            d = json.loads(raw)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("event") == "start":
            out.append(d)
    return out


def _finish(run_dir: Path, n: int, procs: dict[str, Proc], exit_code: int) -> int:
    """Print the summary table and the θ verdict; the launch's exit code."""
    rows = []
    for i in range(n):
        summ = read_summary(run_dir / f"site-{i}" / "summary.json")
        rows.append(summ.as_dict() if summ is not None else {"site": f"site-{i}"})
        starts = _starts(run_dir / f"site-{i}" / "metrics.jsonl")
        if len(starts) > 1:  # a restarted site's summary starts at its last start: the run's first loss is its first
            _out(
                f"site-{i} started {len(starts)} times (restarted by --max-restarts, or resumed);"
                f" its last start joined at round {starts[-1].get('round')}"
            )
            if "checksum" in rows[-1] and isinstance(starts[0].get("val_loss"), (int, float)):
                rows[-1]["first_val_loss"] = float(starts[0]["val_loss"])
    _out("\n" + _format_table(rows))
    sums = {r["checksum"] for r in rows if "checksum" in r}
    finished = [r for r in rows if "checksum" in r]
    if finished:
        first = [r["first_val_loss"] for r in finished]
        last = [r["final_val_loss"] for r in finished]
        _out(
            f"\nvalidation loss: {sum(first) / len(first):.4f} -> {sum(last) / len(last):.4f} (mean over {len(finished)} sites)"
        )
    agree = len(sums) == 1 and len(finished) == n
    unfinished = [r["site"] for r in rows if "checksum" not in r]
    if agree:
        verdict = "θ checksums agree across sites"
    elif not finished:
        verdict = "no site finished"
    elif any(r.get("interrupted") for r in finished):  # stopped mid-run: each at its own round
        at = ", ".join(f"{r['site']} after round {int(r['rounds']) - 1}" for r in finished if "rounds" in r)
        verdict = f"interrupted: the sites stopped at their own rounds ({at}), so their θ may differ"
    elif len(sums) == 1:
        n = len(finished)
        verdict = f"θ checksums agree across the {n} finished site{'s' if n > 1 else ''}; {', '.join(unfinished)} did not finish"
    else:
        verdict = f"θ checksums DIFFER across sites ({len(sums)} distinct)" + (
            f"; {', '.join(unfinished)} did not finish" if unfinished else ""
        )
    _out(f"{verdict}; run dir: {run_dir}")
    bad = {s: p for s, p in procs.items() if s != "rendezvous" and p.returncode not in (0, None)}
    if bad and exit_code == 0:
        for s, p in bad.items():
            _err(f"{s} exited with code {exit_text(p.returncode)}; last log lines:\n{p.tail()}")
        exit_code = 1
    if exit_code == 0 and not agree:
        exit_code = 1
    return exit_code
