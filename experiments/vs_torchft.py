"""Head to head with torchft 0.2.0's DiLoCo: same task, same machine, one invocation (issue 7).

Both systems train dtrain's built-in task (same GPT, seeded initial weights, data shards and
order, validation batches, inner AdamW), H inner steps per round, outer SGD(lr 0.7, momentum 0.9,
Nesterov), the same number of sites, every site its own process with one torch thread: dtrain as
``dtrain rendezvous`` + a ``dtrain worker`` per site (gRPC on 127.0.0.1, codec int8 unless
``diloco.rounds.codec.name`` says otherwise); torchft as ``torchft_lighthouse`` + an
:mod:`experiments.torchft_site` per site. Scenarios (``vs.scenarios``; the systems one after the
other unless said; :mod:`experiments.vs_torchft_analysis` defines each figure):

1. ``healthy``: wall time per round, final validation loss per site, bytes on the wire per round,
   peak RSS per site process, and the dtrain / torchft ratios against the targets (wall <= 1,
   loss within 1 %, bytes <= 1/4); ``vs.repeats`` times in AB BA order, plus a dtrain run per
   codec of ``vs.extra_codecs``. ``concurrent``: both systems' healthy runs at the same time.
2. ``fault``: site-1 SIGKILLed in round ``vs.kill_round`` once admitted, before it sent anything
   (dtrain: ``DTRAIN_TEST_FAULT=site-1:before_push:K:kill``; torchft: ``--kill-at-round``); a fresh
   site-1 starts when a survivor has finished round K + ``vs.restart_after`` - 1. Reports discarded
   rounds, what site-1 missed, the longest stall a survivor saw, the time to rejoin, final losses.
3. ``netem``: the healthy run with every process behind each link profile of
   ``vs.netem_profiles`` (root; left out with a note otherwise).

With ``vs.profile`` ``always`` (or ``auto`` when the healthy runs missed the wall-time target) one
more healthy dtrain run samples site-0 with py-spy. Every site process starts "pre-warmed"
(imports done, then it waits for a go-file): start-up is out of the measurements and a restarted
site is back in seconds. Everything a run starts is killed on exit, error and Ctrl-C; a run that
left a problem keeps its run directory (the row's ``kept``). torchft is NOT a dependency of dtrain
(:data:`INSTALL_HINT` says how to add it).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.app.procs import Cluster, Proc, child_env, flags, spawn
from dtrain.metrics import read_json_lines
from experiments import torchft_site
from experiments import vs_torchft_analysis as va
from experiments.common import ROOT, RunResult
from experiments.lab import Point, Spec
from experiments.procs import free_port, netem_problem, wait_until

INSTALL_HINT = (
    "pip install torchft==0.2.0 opentelemetry-api opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http   (after torch, into the same environment)"
)
# the lighthouse as torchft's docs / examples/diloco/README.md run it (the Managers' timeouts: torchft_site)
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
#: the plan's settings: what a mode runs, not how one run runs (not copied into the runs' rows)
PLAN = (va.SCENARIOS, va.REPEATS, va.EXTRA_CODECS, va.NETEM_PROFILES, va.NETEM_ROUNDS, va.FAULT_ROUNDS, va.PROFILE)
#: the metrics-line fields the rounds CSV keeps (the analysis reads them; ``t``: seconds since the go)
LINE_FIELDS = ("round", "step", "status", "committed", "members", "val_loss", "train_loss", "inner_s", "sync_s")
LINE_FIELDS += ("encode_s", "decode_s", "network_s", "wait_s", "bytes_sent", "bytes_received", "applied_buckets")
LINE_FIELDS += ("inner_steps", "params")


# ----------------------------------------------------------------------------- processes
def _on_signal(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def _prewarmed_main(argv: list[str]) -> None:
    """``python -m experiments.vs_torchft _child KIND READY GO -- ARGS``: import, signal ready,
    wait for GO, run dtrain's CLI or the torchft site with ARGS."""
    kind, ready, go = argv[0], Path(argv[1]), Path(argv[2])
    args = argv[4:]
    import torch._dynamo  # noqa: F401  (torch, and its _dynamo: every torch optimizer pulls it in)

    import dtrain.tasks.builtin  # noqa: F401

    if kind == "dtrain":
        from dtrain.app.cli import main as run
    else:
        run = torchft_site.main
    ready.write_text(str(os.getpid()))
    if not wait_until(go.exists, 1800):
        os._exit(4)
    sys.argv = [kind, *args]
    spy_out = os.environ.get("VS_TORCHFT_PYSPY_OUT")
    if spy_out:  # sample this process (every thread, idle excluded) until it exits
        spy = [os.environ["VS_TORCHFT_PYSPY"], "record", "--pid", str(os.getpid()), "--format", "raw"]
        spy += ["--rate", "100", "--threads", "--nonblocking", "-o", spy_out]
        subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=open(spy_out + ".log", "w"), start_new_session=True)
        time.sleep(1.0)  # let it attach before the first inner step
    rc = run(args)
    sys.stdout.flush()
    sys.stderr.flush()
    hwm = _vmhwm_kb(os.getpid())  # this process's own peak RSS (since exec, nothing inherited from the harness)
    if hwm is not None:
        Path(str(ready) + ".rss").write_text(str(hwm))
    os._exit(rc if isinstance(rc, int) else 0)  # torchft's Rust runtime and gloo threads can hold up a normal exit


# ----------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class Run:
    """One system's run of a point: what its processes are told (``s``: the point's settings by
    config path; ``vs.pyspy`` among them: the path of py-spy, to sample dtrain's site-0)."""

    system: str  # "dtrain" | "torchft"
    s: dict[str, Any]
    seed: int

    @property
    def kill_round(self) -> int:
        """The round site-1 is killed in; -1: no fault."""
        return self.s[va.KILL_ROUND] if self.s[va.SCENARIO] == "fault" else -1


@dataclass
class Record:
    """What a run's harness saw: when the sites were let go, killed and restarted (``time.time``),
    each process's exit code, peak RSS and CPU seconds, and any problem."""

    dir: Path
    t_go: float = 0.0
    t_kill: float | None = None
    t_restart: float | None = None
    timed_out: bool = False
    error: str | None = None
    procs: dict = field(default_factory=dict)  # name -> {"rc", "maxrss_kb", "maxrss_source", "cpu_s", "role"}
    netem_backends: dict | None = None
    loadavg_end: float | None = None  # 1-minute load average when the run ended


def _spawn(cluster: Cluster, name: str, i: int, argv: list[str], log: Path, env: dict | None = None) -> None:
    """Start ``argv`` as ``name`` in netem site ``i`` (or on loopback), one of the cluster's processes as
    :meth:`Cluster.spawn` makes a ``python -m dtrain`` one (its waits, checks and log tails see it)."""
    argv = argv if cluster.topo is None else cluster.topo.exec_argv(i, argv)
    cluster.procs[name] = spawn(name, argv, log, env=child_env(env), cwd=ROOT)
    cluster.logs[name] = log


def run_one(run: Run, run_dir: Path, start_together: threading.Barrier | None = None) -> Record:
    """Run one system through one scenario; every child is gone when this returns. ``start_together``:
    a barrier shared with runs started at the same time (the sites go once every run's are ready)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rec, gate, topo, cluster = Record(dir=run_dir), run_dir / "gate", None, None
    try:
        if run.s[va.NETEM]:
            from netem import Topology  # noqa: PLC0415

            topo = Topology(num_sites=run.s[va.SITES] + 1, profile=run.s[va.NETEM])
            rec.netem_backends = topo.backends()
        cluster = Cluster(run_dir, num_sites=run.s[va.SITES], topo=topo)  # sites 0..N-1, the coordinator N
        gate.mkdir(exist_ok=True)
        coord = _start_coordinator(run, cluster)
        _start_sites(run, cluster, coord, start_together, rec)
        _supervise(run, rec, cluster)
        rec.loadavg_end = os.getloadavg()[0]
        if run.s[va.PYSPY]:  # py-spy writes its file once the sampled process has exited
            spy = run_dir / "pyspy-site-0.txt"
            cluster.wait(lambda: spy.exists() and spy.stat().st_size > 0, "py-spy's output", 60)
    except (Exception, KeyboardInterrupt) as e:
        rec.error = (rec.error or "") + f"{type(e).__name__}: {e}"
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        _stop_all(rec, cluster.procs if cluster else {}, gate)
        if topo is not None:
            topo.close()
    return rec


def _start_coordinator(run: Run, cluster: Cluster) -> str:
    """Start dtrain's rendezvous or torchft's lighthouse and wait until it answers; returns its
    address as the sites take it."""
    n = run.s[va.SITES]
    if run.system == "dtrain":
        return cluster.start_rendezvous(initial_sites=n)
    port = free_port() if cluster.topo is None else 29510
    lh = str(Path(sys.executable).parent / "torchft_lighthouse")
    argv = [lh, *LIGHTHOUSE_FLAGS, "--bind", f"{cluster.host(n)}:{port}"]
    _spawn(cluster, "lighthouse", n, argv, cluster.root / "lighthouse.log")

    def lighthouse_up() -> bool:
        try:  # under netem: from inside site 0's namespace
            with socket.socket() if cluster.topo is None else cluster.topo.socket(0) as s:
                s.settimeout(0.5 if cluster.topo is None else 2.0)
                s.connect((cluster.host(n), port))
                return True
        except OSError:
            return False

    cluster.wait(lambda: cluster.check_alive(["lighthouse"], ()) or lighthouse_up(), "the lighthouse", 60)
    return f"http://{cluster.host(n)}:{port}"


def _site_argv(run: Run, cluster: Cluster, coord: str, i: int, out_name: str) -> tuple[list[str], dict]:
    """A pre-warmed site process's command line (``_child``: it imports first, then waits for its
    go file) and its environment: a dtrain worker or a torchft site, faulted (the killed site) or not."""
    n, gate, out = run.s[va.SITES], cluster.root / "gate", cluster.root / out_name
    fault = run.kill_round >= 0 and out_name == va.KILLED
    if cluster.topo is not None:
        from netem._rules import SITE_IF  # noqa: PLC0415
    env = {"GLOO_SOCKET_IFNAME": "lo" if cluster.topo is None else SITE_IF}
    # the task and the schedule, the same for both systems (each names its coordinator its own way)
    common = ["--site-index", str(i), "--num-sites", str(n), "--out-dir", str(out), "--size", run.s[va.SIZE]]
    common += ["--data", run.s[va.DATA], "--rounds", str(run.s[va.ROUNDS]), "--sync-every", str(run.s[va.SYNC_EVERY])]
    common += ["--threads", "1", "--seed", str(run.seed)]
    if run.system == "dtrain":
        args = ["worker", "--site-id", f"site-{i}", *common, "--listen", f"{cluster.host(i)}:0", "--rendezvous", coord]
        args += flags({va.CODEC: run.s[va.CODEC], va.BUCKET_BYTES: run.s[va.BUCKET_BYTES]})  # None: the default
        if fault:
            env["DTRAIN_TEST_FAULT"] = f"site-{i}:before_push:{run.kill_round}:kill"
        if run.s[va.PYSPY] and i == 0:
            env["VS_TORCHFT_PYSPY"] = run.s[va.PYSPY]
            env["VS_TORCHFT_PYSPY_OUT"] = str(cluster.root / "pyspy-site-0.txt")
    else:
        args = [*common, "--lighthouse", coord, "--host", cluster.host(i)]
        if fault:
            args += ["--kill-at-round", str(run.kill_round)]
        if out_name != va.RESTART:  # the replacement joins a running quorum: no start barrier
            args += ["--barrier-dir", str(gate)]
    warm, go = str(gate / f"warm-{out_name}"), str(gate / f"go-{out_name}")
    return [sys.executable, "-m", "experiments.vs_torchft", "_child", run.system, warm, go, "--", *args], env


def _start_sites(run: Run, cluster: Cluster, coord: str, start_together, rec: Record) -> None:
    """Start every site pre-warmed (and the killed site's replacement, ``va.RESTART``, which waits for
    its go), then let them go together."""
    n, run_dir, gate = run.s[va.SITES], cluster.root, cluster.root / "gate"
    names = [f"site-{i}" for i in range(n)]
    todo = list(enumerate(names))
    if run.kill_round >= 0:  # pre-warm the replacement now; it starts when told
        todo.append((va.KILLED_SITE, va.RESTART))
    for i, name in todo:
        argv, env = _site_argv(run, cluster, coord, i, name)
        _spawn(cluster, name, i, argv, run_dir / name / "worker.log", env)
    every = [name for _, name in todo]  # a site exiting now is a failure: check_alive with no good exit code
    warm = lambda: all((gate / f"warm-{nm}").exists() for nm in every)  # noqa: E731
    cluster.wait(lambda: cluster.check_alive(every, ()) or warm(), "every site to import torch", 600)
    if start_together is not None:
        start_together.wait(timeout=600)
    rec.t_go = time.time()
    for name in names:
        (gate / f"go-{name}").write_text("")
    if run.system == "torchft":  # every Manager heartbeating before anyone asks for a quorum
        ready = lambda: all((gate / f"ready-{i}").exists() for i in range(n))  # noqa: E731
        cluster.wait(lambda: cluster.check_alive(names, ()) or ready(), "every torchft Manager", 300)
        (gate / "go").write_text("")


def _supervise(run: Run, rec: Record, cluster: Cluster) -> None:
    """Until every site has exited or the run times out: record the kill, and start the replacement once
    a survivor has finished the restart round (killing site-1 first if the fault did not fire)."""
    gate, children = cluster.root / "gate", cluster.procs
    deadline = time.monotonic() + run.s[va.TIMEOUT_S]
    survivor = cluster.root / "site-0" / "metrics.jsonl"
    while True:
        if run.kill_round >= 0:
            killed = children[va.KILLED]
            if rec.t_kill is None and killed.poll() is not None:
                rec.t_kill = time.time()
            if rec.t_restart is None and any(
                d.get("event") == "round" and d["round"] >= run.kill_round + run.s[va.RESTART_AFTER] - 1
                for d in read_json_lines(survivor)
            ):
                if killed.poll() is None:  # the fault did not fire: kill it now, so the scenario still happens
                    killed.kill()
                    rec.error = (rec.error or "") + f"{va.KILLED} was not dead at the restart point; killed. "
                rec.t_restart = time.time()
                (gate / f"go-{va.RESTART}").write_text("")
        workers = [nm for nm in children if nm.startswith("site-") and (nm != va.RESTART or rec.t_restart is not None)]
        if cluster.exited(workers):
            break
        if time.monotonic() > deadline:
            rec.timed_out = True
            rec.error = (rec.error or "") + f"timed out after {run.s[va.TIMEOUT_S]:.0f}s. "
            break
        time.sleep(0.1)


def _stop_all(rec: Record, children: dict[str, Proc], gate: Path) -> None:
    """Stop the sites, then the coordinator; record each process's exit code, CPU and peak RSS (a site's
    own VmHWM at exit, a coordinator's read while it ran, else ``wait4``'s ru_maxrss: a killed site)."""
    for nm in sorted(children, key=lambda nm: not nm.startswith("site-")):
        c = children[nm]
        live = _vmhwm_kb(c.pid) if c.poll() is None else None
        c.stop(grace_s=3.0)
        own = gate / f"warm-{nm}.rss"  # a site's self-reported VmHWM
        kb, source = (int(own.read_text()), "VmHWM") if own.exists() else (live, "VmHWM") if live else (None, "")
        rec.procs[nm] = {
            "rc": c.returncode,
            "maxrss_kb": kb or c.maxrss_kb,
            "maxrss_source": source or "wait4",
            "cpu_s": c.cpu_s,
            "role": "site" if nm.startswith("site-") else "coordinator",
        }


def _vmhwm_kb(pid: int) -> int | None:
    """A live process's own peak RSS (VmHWM: since its exec), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


# ----------------------------------------------------------------------------- what this machine can run
@functools.lru_cache(maxsize=1)
def torchft_problem() -> str | None:
    """None when torchft 0.2.x imports in this interpreter, else a one-line reason (checked in a
    subprocess: importing torch here would make every child's inherited peak RSS large)."""
    code = "from torchft import Manager, ProcessGroupGloo; from torchft.local_sgd import DiLoCo"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"torchft is not importable ({last})"
    if not (Path(sys.executable).parent / "torchft_lighthouse").exists():
        return f"torchft_lighthouse not found next to {sys.executable}"
    return None


def pyspy_path() -> str | None:
    """py-spy next to this interpreter, if installed."""
    spy = Path(sys.executable).parent / "py-spy"
    return str(spy) if spy.exists() else None


# ----------------------------------------------------------------------------- the spec
def run_point(point: Point) -> list[RunResult]:
    """One point's runs: one system, or both at once (``vs.system`` ``both``), each in a temporary run
    directory; a row per run. A netem point where netem cannot run here: no row (the report says why)."""
    if why := torchft_problem():
        raise SystemExit(f"vs_torchft: {why}.\nThis experiment needs torchft 0.2.0; install it with:\n  {INSTALL_HINT}")
    if point.settings[va.NETEM] and netem_problem():
        print(f"vs_torchft: {point.config} not run: {netem_problem()}", flush=True)
        return []
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)  # a stopped runner still stops every child
    systems = ("dtrain", "torchft") if point.settings[va.SYSTEM] == "both" else (point.settings[va.SYSTEM],)
    with tempfile.TemporaryDirectory(prefix="dtrain-vs-torchft-") as tmp:
        runs = {sy: (Run(sy, point.settings, point.seed), Path(tmp) / _run_name(point, sy)) for sy in systems}
        if len(systems) == 1:
            recs = {sy: run_one(run, d) for sy, (run, d) in runs.items()}
        else:
            together = threading.Barrier(len(systems))
            with ThreadPoolExecutor(len(systems)) as ex:
                futs = {sy: ex.submit(run_one, run, d, together) for sy, (run, d) in runs.items()}
                recs = {sy: f.result() for sy, f in futs.items()}
        return [_result(point, sy, recs[sy]) for sy in systems]


def _run_name(point: Point, system: str) -> str:
    s = point.settings
    name = f"{system}_{s[va.SCENARIO]}_r{s[va.REPEAT]}" + (f"_s{point.seed}" if point.seed else "")
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", name)


def _result(point: Point, system: str, rec: Record) -> RunResult:
    """A run's row (settings, what the harness saw, headline figures) and its lines: every start and round
    line of every site (``t``: seconds since the go), an ``exit`` line per process, the py-spy shares."""
    name = _run_name(point, system)
    lines, finals = [], {}  # finals: each finished site's last θ checksum
    for proc, facts in rec.procs.items():
        metrics = read_json_lines(rec.dir / proc / "metrics.jsonl") if facts["role"] == "site" else []
        for d in metrics:
            if d.get("event") in ("start", "round"):
                kept = {k: d.get(k) for k in LINE_FIELDS}
                kept["members"] = len(d["members"]) if isinstance(d.get("members"), list) else d.get("members")
                lines.append({"run": name, "site": proc, "event": d["event"], "t": d["time"] - rec.t_go, **kept})
        finished = (rec.dir / proc / "summary.json").exists()
        lines.append({"run": name, "site": proc, "event": "exit", **facts, "finished": finished})
        rounds = [d for d in metrics if d.get("event") == "round"]
        if rounds and finished:
            finals[proc] = rounds[-1].get("checksum")
    spy = rec.dir / "pyspy-site-0.txt"
    if spy.exists():
        prof = va.pyspy_summary(spy)
        base = {"run": name, "site": "site-0", "event": "pyspy"}
        lines.append({**base, "kind": "total", "samples": prof["samples"]})
        lines += [{**base, "kind": "category", "name": k, "share": v} for k, v in prof["categories"].items()]
        lines += [{**base, "kind": "leaf", "name": k, "share": v} for k, v in prof["top_leaves"]]
    row = point.row(
        **{va.SYSTEM: system},
        run=name,
        error=rec.error or "",
        timed_out=rec.timed_out,
        t_kill_s=rec.t_kill - rec.t_go if rec.t_kill else None,
        t_restart_s=rec.t_restart - rec.t_go if rec.t_restart else None,
        loadavg_end=rec.loadavg_end,
        netem_backends=str(rec.netem_backends) if rec.netem_backends else None,
        checksums_agree=len(finals) > 0 and len(set(finals.values())) == 1,
    )
    st = va.run_stats([row], va.lines_by_run(lines))
    row.update(
        round_wall_median_s=st["round_wall_s"]["median"],
        final_val_loss=st["final_val_loss_mean"],
        bytes_per_round=st["bytes_per_round_total"],
        peak_rss_mb_max=st["peak_rss_mb_max"],
        wall_total_s=st["wall_total_s"],
    )
    if rec.error:  # keep what the run left, for its logs
        row["kept"] = str(Path(tempfile.gettempdir()) / f"vs_torchft-failed-{name}-{os.getpid()}")
        shutil.copytree(rec.dir, row["kept"], dirs_exist_ok=True)
    print(f"  {system:7s} {point.settings[va.SCENARIO]:22s} {name}: {rec.error or 'ok'}", flush=True)
    return RunResult(row=row, rounds=lines)


def _point(m: dict[str, Any], seed: int, system: str, scenario: str, repeat: int = 0, **more: Any) -> Point:
    """A run of ``system`` (or ``both``) through ``scenario``: the mode's fixed settings but the plan's."""
    base = {k: v for k, v in m["fixed"].items() if k not in PLAN}
    settings = {**base, va.SYSTEM: system, va.SCENARIO: scenario, va.REPEAT: repeat, **more}
    return Point("vs_torchft", f"{system} {scenario} #{repeat}", seed, settings)


def plan(rows: list[dict[str, Any]], m: dict[str, Any]) -> list[Point]:
    """The runs in phases: every scenario of ``vs.scenarios`` (healthy in AB BA order and per extra codec,
    concurrent, fault, each netem profile); then a profiled dtrain run if ``va.profile_wanted``."""
    f = {**m["fixed"], **{k: _names(m["fixed"][k]) for k in (va.SCENARIOS, va.EXTRA_CODECS, va.NETEM_PROFILES)}}
    if rows:
        if any(r[va.SCENARIO] == "profile" for r in rows) or not va.profile_wanted(rows, m) or not pyspy_path():
            return []
        return [_point(m, m["seeds"][0], "dtrain", "profile", **{va.PYSPY: pyspy_path()})]
    out = []
    for seed in m["seeds"]:
        if "healthy" in f[va.SCENARIOS]:
            for rep in range(max(1, f[va.REPEATS])):
                order = ("dtrain", "torchft") if rep % 2 == 0 else ("torchft", "dtrain")
                out += [_point(m, seed, sy, "healthy", rep) for sy in order]
            codecs = [c for c in f[va.EXTRA_CODECS] if c and c != f[va.CODEC]]
            out += [_point(m, seed, "dtrain", f"healthy codec={c}", **{va.CODEC: c}) for c in codecs]
        if "concurrent" in f[va.SCENARIOS]:  # both systems at the same time: they see the same background load
            out += [_point(m, seed, "both", "concurrent", rep) for rep in range(max(1, f[va.REPEATS]))]
        if "fault" in f[va.SCENARIOS] and f[va.FAULT_ROUNDS] and f[va.SITES] >= 2:
            out += [_point(m, seed, sy, "fault", **{va.ROUNDS: f[va.FAULT_ROUNDS]}) for sy in ("dtrain", "torchft")]
        if "netem" in f[va.SCENARIOS]:
            rounds = f[va.NETEM_ROUNDS] or f[va.ROUNDS]
            for prof in f[va.NETEM_PROFILES]:
                more = {va.NETEM: prof, va.ROUNDS: rounds}
                out += [_point(m, seed, sy, f"netem-{prof}", **more) for sy in ("dtrain", "torchft")]
    return out


def _names(v: Any) -> list[str]:
    """A list setting as given (``--set 'vs.scenarios=["fault"]'``) or comma-separated text
    (``--set vs.scenarios=healthy,fault``)."""
    return [x for x in v.split(",") if x] if isinstance(v, str) else list(v or [])


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    """The comparison's section (:func:`experiments.vs_torchft_analysis.report`) with notes on
    what the mode asked for that did not run here, and on the runs that left a problem."""
    f = {**m["fixed"], **{k: _names(m["fixed"][k]) for k in (va.SCENARIOS, va.NETEM_PROFILES)}}
    scens, notes = {r[va.SCENARIO] for r in rows}, []
    if "netem" in f[va.SCENARIOS] and f[va.NETEM_PROFILES] and not any(s.startswith("netem-") for s in scens):
        notes.append(f"netem scenarios ({', '.join(f[va.NETEM_PROFILES])}) not run: {netem_problem() or 'see the log'}")
    if "fault" in f[va.SCENARIOS] and f[va.FAULT_ROUNDS] and f[va.SITES] < 2:
        notes.append("fault scenario not run: it needs >= 2 sites")
    if "profile" not in scens and va.profile_wanted(rows, m) and not pyspy_path():
        notes.append("profile: not run, py-spy is not installed (pip install py-spy)")
    notes += [f"{r['run']}: {r['error']} (its run directory: `{r['kept']}`)" for r in rows if r.get("kept")]
    return va.report(rows, rounds, m, prefix, notes)


#: per mode: the task, the schedule, and what runs (``vs.*``; ``--set`` overrides any of them)
MODES: dict[str, dict[str, Any]] = {
    "smoke": {va.SITES: 2, va.SIZE: "tiny", va.ROUNDS: 4, va.SYNC_EVERY: 5, va.FAULT_ROUNDS: 0, va.NETEM_PROFILES: []},
    "quick": {va.SITES: 2, va.SIZE: "small", va.ROUNDS: 8, va.SYNC_EVERY: 20, va.FAULT_ROUNDS: 10, va.REPEATS: 2},
    "full": {va.SITES: 3, va.SIZE: "small", va.ROUNDS: 16, va.SYNC_EVERY: 50, va.FAULT_ROUNDS: 14, va.REPEATS: 2},
}
MODES["smoke"] |= {va.NETEM_ROUNDS: 0, va.TIMEOUT_S: 120.0, va.SCENARIOS: ["healthy"], va.PROFILE: "never"}
MODES["quick"] |= {va.NETEM_PROFILES: ["transatlantic"], va.NETEM_ROUNDS: 5, va.EXTRA_CODECS: ["int8+zstd"]}
MODES["full"] |= {va.NETEM_PROFILES: ["transatlantic", "lossy"], va.NETEM_ROUNDS: 8, va.TIMEOUT_S: 1800.0}
MODES["full"] |= {va.EXTRA_CODECS: ["int8+zstd", "int4"]}

SPEC = Spec(
    name="vs_torchft",
    title="dtrain vs torchft 0.2.0 DiLoCo",
    modes={mode: {"seeds": [0], "fixed": fixed} for mode, fixed in MODES.items()},
    fixed={va.DATA: "stdlib", va.CODEC: "int8", va.BUCKET_BYTES: None}  # bucket bytes: dtrain's default
    | {va.SCENARIOS: ["healthy", "concurrent", "fault", "netem"], va.REPEATS: 1, va.PROFILE: "auto"}
    | {va.EXTRA_CODECS: [], va.KILL_ROUND: 3, va.RESTART_AFTER: 2}
    | {va.TIMEOUT_S: 900.0, va.NETEM: None, va.PYSPY: None},
    metrics=(("final_val_loss", 0.0, 10.0), ("round_wall_median_s", 0.0, 600.0), ("bytes_per_round", 1.0, 1e12))
    + (("peak_rss_mb_max", 10.0, 1e5),),
    report=report,
    verdict=va.verdict,
    execute=run_point,
    paths=(va.SYSTEM, va.SCENARIO, va.REPEAT, va.NETEM, va.KILL_ROUND, va.RESTART_AFTER, va.TIMEOUT_S, va.PYSPY, *PLAN),
    jobs_fn=lambda point: False,  # one run at a time: each measures the machine
    phases=plan,
)

if __name__ == "__main__":  # a pre-warmed site process (``_site_argv``); the experiment: python -m experiments run
    if sys.argv[1:2] != ["_child"]:
        raise SystemExit("run it as: python -m experiments run vs_torchft [--mode smoke|quick|full]")
    _prewarmed_main(sys.argv[2:])
