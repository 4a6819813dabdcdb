"""Head to head with torchft 0.2.0's DiLoCo: same task, same machine, one invocation (issue 7).

Both systems train dtrain's built-in task (``dtrain.tasks.build_task``: same GPT, same
seeded initial weights, same data shards and order, same validation batches, same inner
AdamW), H inner steps per round, outer SGD(lr 0.7, momentum 0.9, Nesterov), the same
number of sites, every site its own OS process with ``torch.set_num_threads(1)``:

* dtrain: ``python -m dtrain rendezvous`` + one ``python -m dtrain worker`` per site
  (gRPC on 127.0.0.1, the default codec unless ``--codec``);
* torchft: ``torchft_lighthouse`` + one ``experiments/torchft_site.py`` per site
  (Manager + ProcessGroupGloo + ``torchft.local_sgd.DiLoCo``, see that file for the
  configuration and why).

Scenarios (one system after the other unless said otherwise):

1. ``healthy``: wall time per round (median/min/max over every site, round 0 = warm-up
   excluded), final validation loss per site, bytes on the wire per round (dtrain: the
   payload bytes its transport counted, summed over sites; torchft: the ring all-reduce
   of fp32 parameters, ``2 (n-1)/n x params x 4`` per site), peak RSS per site process
   (its own VmHWM), and dtrain / torchft ratios against the targets (wall <= 1, loss
   within 1 %, bytes <= 1/4). Repeated in AB BA order; optional extra dtrain runs with
   other codecs (``--extra-codecs``) for the bytes table.
   ``concurrent``: the same healthy run of both systems started at the same time, so both
   see the same background load on a shared machine (they also share its CPUs).
2. ``fault``: site-1 is SIGKILLed in round 3 after it was admitted and before it sent
   anything (dtrain: ``DTRAIN_TEST_FAULT=site-1:before_push:3:kill``; torchft: the same
   point, see ``torchft_site.py --kill-at-round``), and a fresh process for site-1 starts
   when a survivor has finished round 4 (so it can be back for round 5). Reports the
   rounds each system discarded, what the failed site missed, the longest stall a
   survivor saw, the time to rejoin, final losses.
3. ``netem-<profile>``: the healthy run with every site (and the rendezvous/lighthouse)
   in its own network namespace behind the ``netem`` link profile. Needs root and the
   repository's ``netem`` package; skipped with a note otherwise.

Every site process is started "pre-warmed": it imports torch (and dtrain/torchft) first,
then waits for a go-file before it runs the site's main function, so start-up skew and
interpreter start-up are out of the measurements and a restarted site comes back in
seconds on a loaded machine. Everything this script starts runs in its own session and
is killed on exit, on error and on Ctrl-C. With ``--profile`` (or automatically when the
wall-time target is missed) one more healthy dtrain run samples site-0 with py-spy.

Outputs under ``--out`` (default ``experiments/out/vs_torchft_<mode>``): ``rounds.csv``
(every round line of every site), ``summary.csv``, ``results.json``, ``report.md``,
``loss_vs_wall.png`` and the raw run directories under ``runs/``. ``--quick`` and the
full mode append ``report.md`` to ``experiments/RESULTS.md`` (``--no-append`` to skip).

    python -m experiments.vs_torchft --smoke      # CI: 2 sites, tiny, healthy only (< 60 s)
    python -m experiments.vs_torchft --quick      # 2 sites, small: healthy x2, concurrent, fault, 1 netem profile
    python -m experiments.vs_torchft              # 3 sites, small, more rounds, 2 netem profiles, int8+zstd/int4
    python -m experiments.vs_torchft --out DIR --analyse-only   # recompute the outputs from DIR/runs

Beside this script: ``vs_torchft_specs.py`` (the modes, a run's spec and record),
``vs_torchft_analysis.py`` (the numbers and the report) and ``vs_torchft_outputs.py``
(the files above).

torchft is NOT a dependency of dtrain and this script installs nothing. Install it into
the same environment after torch (it then pulls no torch)::

    pip install torchft==0.2.0 opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from dtrain.app.procs import Proc, child_env, spawn
from experiments.procs import free_port
from experiments.vs_torchft_analysis import _lines, analyse
from experiments.vs_torchft_outputs import write_outputs
from experiments.vs_torchft_specs import MODES, RunRecord, RunSpec, load_record, record_json, run_dir_name

REPO = Path(__file__).resolve().parents[1]

HERE = Path(__file__).resolve().parent
INSTALL_HINT = (
    "pip install torchft==0.2.0 opentelemetry-api opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http   (after torch, into the same environment)"
)
KILLED_SITE = 1
# torchft settings (torchft docs / examples/diloco/README.md: lighthouse --min_replicas 1
# --quorum_tick_ms 100 --join_timeout_ms 10000; Manager(use_async_quorum=False); gloo 5 s).
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
TORCHFT_SITE_FLAGS = ["--timeout-s", "30", "--quorum-timeout-s", "300", "--pg-timeout-s", "5"]


# ----------------------------------------------------------------------------- processes
class Child(Proc):
    """A process from the one harness (:mod:`dtrain.app.procs`): its own session, stdin
    from /dev/null, reaped with ``wait4`` so its peak RSS (``maxrss_kb``) and CPU time
    (``cpu_s``) are known; every child still running is killed at exit."""

    live: set["Child"] = set()

    def __init__(self, name: str, argv: list[str], log: Path, env: dict) -> None:
        p = spawn(name, argv, log, env=env, cwd=REPO)
        super().__init__(name, p.handle, p.log)
        Child.live.add(self)

    @property
    def rc(self) -> int | None:
        return self.returncode

    def poll(self) -> int | None:
        rc = super().poll()
        if rc is not None:
            Child.live.discard(self)
        return rc


@atexit.register
def _kill_all() -> None:
    for c in list(Child.live):
        c.kill()


def _on_signal(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def _wait(pred, timeout_s: float, what: str, procs: list[Child] = ()):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        for c in procs:
            if c.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.rc} while waiting for {what}:\n{c.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


def _prewarmed_main(argv: list[str]) -> None:
    """``vs_torchft.py _child KIND READY GO -- ARGS``: import, signal ready, wait for GO, run."""
    kind, ready, go = argv[0], Path(argv[1]), Path(argv[2])
    args = argv[4:]
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (every torch optimizer pulls it in)

    import dtrain.tasks.builtin  # noqa: F401

    if kind == "dtrain":
        from dtrain.app.cli import main as run
    else:
        from experiments.torchft_site import main as run
    ready.write_text(str(os.getpid()))
    deadline = time.monotonic() + 1800
    while not go.exists():
        if time.monotonic() > deadline:
            os._exit(4)
        time.sleep(0.02)
    sys.argv = [kind, *args]
    spy_out = os.environ.get("VS_TORCHFT_PYSPY_OUT")
    if spy_out:  # sample this process (every thread, idle excluded) until it exits
        subprocess.Popen(
            [
                os.environ["VS_TORCHFT_PYSPY"],
                "record",
                "--pid",
                str(os.getpid()),
                "--format",
                "raw",
                "--rate",
                "100",
                "--threads",
                "--nonblocking",
                "-o",
                spy_out,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(spy_out + ".log", "w"),
            start_new_session=True,
        )
        time.sleep(1.0)  # let it attach before the first inner step
    rc = run(args)
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # this process's own peak RSS (VmHWM: since exec, nothing inherited from the harness)
        hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
        Path(str(ready) + ".rss").write_text(str(hwm))
    except (OSError, StopIteration, ValueError):
        pass
    os._exit(rc if isinstance(rc, int) else 0)


# ----------------------------------------------------------------------------- one run
def _rounds_of(site_dir: Path) -> list[dict]:
    return [d for d in _lines(site_dir.parent, site_dir.name) if d.get("event") == "round"]


class _Net:
    """Where each process runs: loopback, or a netem topology (sites 0..N-1, coordinator N)."""

    def __init__(self, topo=None) -> None:
        self.topo = topo

    def host(self, i: int) -> str:
        return "127.0.0.1" if self.topo is None else self.topo.address(i)

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        return argv if self.topo is None else self.topo.exec_argv(i, argv)

    @property
    def ifname(self) -> str:
        if self.topo is None:
            return "lo"
        from netem import _rules  # noqa: PLC0415

        return _rules.SITE_IF


def run_one(spec: RunSpec, run_dir: Path, command: str = "", start_together=None) -> RunRecord:
    """Run one system through one scenario; every child is gone when this returns.

    ``start_together``: a ``threading.Barrier`` shared with runs started at the same time
    (scenario ``concurrent``); the sites get their go once every run has its sites ready."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rec = RunRecord(spec=spec, dir=run_dir, command=command)
    children: dict[str, Child] = {}
    topo = None
    gate = run_dir / "gate"
    try:
        if spec.netem:
            from netem import Topology  # noqa: PLC0415

            topo = Topology(num_sites=spec.sites + 1, profile=spec.netem)
            rec.netem_backends = topo.backends()
        net = _Net(topo)
        gate.mkdir(exist_ok=True)
        coord = _start_coordinator(spec, run_dir, net, children)
        restart_name = _start_sites(spec, run_dir, net, coord, children, start_together, rec)
        _supervise(spec, rec, run_dir, children, restart_name)
        rec.t_end = time.time()
        rec.loadavg_end = os.getloadavg()[0]
        if spec.pyspy:  # py-spy writes its file once the sampled process has exited
            spy = run_dir / "pyspy-site-0.txt"
            _wait(lambda: spy.exists() and spy.stat().st_size > 0, 60, "py-spy's output")
    except (Exception, KeyboardInterrupt) as e:
        rec.error = (rec.error or "") + f"{type(e).__name__}: {e}"
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        _stop_all(rec, children, gate)
        if topo is not None:
            topo.close()
        try:
            (run_dir / "record.json").write_text(json.dumps(record_json(rec), indent=2, default=str))
        except (TypeError, ValueError, OSError) as e:  # the record is also returned; do not lose the run
            print(f"vs_torchft: could not write {run_dir / 'record.json'}: {e}", file=sys.stderr)
    return rec


def _start_coordinator(spec: RunSpec, run_dir: Path, net: _Net, children: dict[str, Child]) -> str:
    """Start dtrain's rendezvous or torchft's lighthouse (in ``children``) and wait until it
    answers; returns its address as the sites take it."""
    n, py = spec.sites, sys.executable
    if spec.system == "dtrain":
        addr_file = run_dir / "rendezvous.addr"
        argv = [
            py,
            "-m",
            "dtrain",
            "rendezvous",
            "--bind",
            f"{net.host(n)}:0",
            "--address-file",
            str(addr_file),
            "--initial-sites",
            str(n),
        ]
        children["rendezvous"] = Child("rendezvous", net.wrap(n, argv), run_dir / "rendezvous.log", child_env())
        coord = _wait(
            lambda: addr_file.exists() and addr_file.read_text().strip(),
            120,
            "the rendezvous address",
            [children["rendezvous"]],
        )
    else:
        port = free_port() if net.topo is None else 29510
        lh = str(Path(py).parent / "torchft_lighthouse")
        argv = [lh, *LIGHTHOUSE_FLAGS, "--bind", f"{net.host(n)}:{port}"]
        children["lighthouse"] = Child("lighthouse", net.wrap(n, argv), run_dir / "lighthouse.log", child_env())
        coord = f"http://{net.host(n)}:{port}"

        def lighthouse_up() -> bool:
            try:
                if net.topo is None:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        return True
                with net.topo.socket(0) as s:  # from inside site 0's namespace
                    s.settimeout(2.0)
                    s.connect((net.host(n), port))
                    return True
            except OSError:
                return False

        _wait(lighthouse_up, 60, "the lighthouse", [children["lighthouse"]])

    return coord


def _site_argv(
    spec: RunSpec, run_dir: Path, net: _Net, coord: str, i: int, out_name: str, *, fault: bool, barrier: bool
) -> tuple[list[str], dict]:
    """A pre-warmed site process's command line (``_child``: it imports first, then waits for its
    go file) and its environment: a dtrain worker or a torchft site, faulted or not."""
    n, py, gate = spec.sites, sys.executable, run_dir / "gate"
    out = run_dir / out_name
    env = {"GLOO_SOCKET_IFNAME": net.ifname}
    # the task and the schedule, the same for both systems (each names its coordinator its own way)
    common = ["--site-index", str(i), "--num-sites", str(n), "--out-dir", str(out), "--size", spec.size]
    common += ["--data", spec.data, "--rounds", str(spec.rounds), "--sync-every", str(spec.sync_every)]
    common += ["--threads", "1", "--seed", "0"]
    if spec.system == "dtrain":
        args = ["worker", "--site-id", f"site-{i}", *common, "--listen", f"{net.host(i)}:0", "--rendezvous", coord]
        args += ["--codec", spec.codec]
        if spec.bucket_bytes:
            args += ["--bucket-bytes", str(spec.bucket_bytes)]
        if fault:
            env["DTRAIN_TEST_FAULT"] = f"site-{i}:before_push:{spec.kill_round}:kill"
        if spec.pyspy and i == 0:
            env["VS_TORCHFT_PYSPY"] = spec.pyspy
            env["VS_TORCHFT_PYSPY_OUT"] = str(run_dir / "pyspy-site-0.txt")
    else:
        args = [*common, "--lighthouse", coord, "--host", net.host(i), *TORCHFT_SITE_FLAGS]
        if fault:
            args += ["--kill-at-round", str(spec.kill_round)]
        if barrier:
            args += ["--barrier-dir", str(gate)]
    argv = [
        py,
        "-m",
        "experiments.vs_torchft",
        "_child",
        spec.system,
        str(gate / f"warm-{out_name}"),
        str(gate / f"go-{out_name}"),
        "--",
        *args,
    ]
    return net.wrap(i, argv), env


def _start_sites(
    spec: RunSpec, run_dir: Path, net: _Net, coord: str, children: dict[str, Child], start_together, rec: RunRecord
) -> str:
    """Start every site pre-warmed (and the killed site's replacement, which waits for its go),
    then let them go together; returns the replacement's name."""
    n, gate = spec.sites, run_dir / "gate"
    names = [f"site-{i}" for i in range(n)]
    for i, name in enumerate(names):
        fault = spec.kill_round >= 0 and i == KILLED_SITE
        argv, env = _site_argv(spec, run_dir, net, coord, i, name, fault=fault, barrier=True)
        children[name] = Child(name, argv, run_dir / name / "worker.log", child_env(env))
    restart_name = f"site-{KILLED_SITE}-restart"
    if spec.kill_round >= 0:  # pre-warm the replacement now; it starts when told
        argv, env = _site_argv(spec, run_dir, net, coord, KILLED_SITE, restart_name, fault=False, barrier=False)
        children[restart_name] = Child(restart_name, argv, run_dir / restart_name / "worker.log", child_env(env))
    _wait(
        lambda: all((gate / f"warm-{nm}").exists() for nm in children if nm.startswith("site-")),
        600,
        "every site to import torch",
        [c for nm, c in children.items() if nm.startswith("site-")],
    )
    if start_together is not None:
        start_together.wait(timeout=600)
    rec.t_go = time.time()
    for name in names:
        (gate / f"go-{name}").write_text("")
    if spec.system == "torchft":  # every Manager heartbeating before anyone asks for a quorum
        _wait(
            lambda: all((gate / f"ready-{i}").exists() for i in range(n)),
            300,
            "every torchft Manager",
            [children[nm] for nm in names],
        )
        (gate / "go").write_text("")
    return restart_name


def _supervise(spec: RunSpec, rec: RunRecord, run_dir: Path, children: dict[str, Child], restart_name: str) -> None:
    """Until every site has exited or the run times out: record the kill, and start the
    replacement once a survivor has finished the restart round (killing the site first
    if the fault did not fire)."""
    gate = run_dir / "gate"
    deadline = time.monotonic() + spec.timeout_s
    survivor = run_dir / "site-0"
    while True:
        if spec.kill_round >= 0:
            killed = children[f"site-{KILLED_SITE}"]
            if rec.t_kill is None and killed.poll() is not None:
                rec.t_kill = time.time()
            if rec.t_restart is None and any(
                d["round"] >= spec.kill_round + spec.restart_after - 1 for d in _rounds_of(survivor)
            ):
                if killed.poll() is None:  # the fault did not fire: kill it now, so the scenario still happens
                    killed.kill()
                    rec.error = (rec.error or "") + f"site-{KILLED_SITE} was not dead at the restart point; killed. "
                rec.t_restart = time.time()
                (gate / f"go-{restart_name}").write_text("")
        workers = [
            c
            for nm, c in children.items()
            if nm.startswith("site-") and not (nm == restart_name and rec.t_restart is None)
        ]
        if all(c.poll() is not None for c in workers):
            break
        if time.monotonic() > deadline:
            rec.timed_out = True
            rec.error = (rec.error or "") + f"timed out after {spec.timeout_s:.0f}s. "
            break
        time.sleep(0.1)


def _stop_all(rec: RunRecord, children: dict[str, Child], gate: Path) -> None:
    """Stop the sites, then the coordinator; record each process's exit code, peak RSS and CPU."""
    for nm, c in children.items():
        if nm.startswith("site-"):
            c.stop(grace_s=3.0)
    for nm, c in children.items():
        c.stop(grace_s=3.0)
        own = gate / f"warm-{nm}.rss"  # a site's self-reported VmHWM; wait4's ru_maxrss otherwise
        rss = int(own.read_text()) if own.exists() else c.maxrss_kb
        rec.procs[nm] = {
            "rc": c.rc,
            "maxrss_kb": rss,
            "maxrss_source": "VmHWM" if own.exists() else "wait4",
            "cpu_s": c.cpu_s,
            "role": "site" if nm.startswith("site-") else "coordinator",
        }


# ----------------------------------------------------------------------------- main
def torchft_problem() -> str | None:
    """None when torchft 0.2.x imports in this interpreter, else a one-line reason.

    Checked in a subprocess: importing torchft (and so torch) here would make this
    process large, and every child forked from it would inherit that as its peak RSS."""
    code = "from torchft import Manager, ProcessGroupGloo; from torchft.local_sgd import DiLoCo"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"torchft is not importable ({last})"
    lh = Path(sys.executable).parent / "torchft_lighthouse"
    if not lh.exists():
        return f"torchft_lighthouse not found next to {sys.executable}"
    return None


def netem_problem() -> str | None:
    """None when the repository's netem package can build topologies here."""
    if os.geteuid() != 0:
        return "netem needs root (network namespaces)"
    try:
        from netem import missing_requirements  # noqa: PLC0415
    except Exception as e:
        return f"the netem package is not importable ({type(e).__name__}: {e})"
    try:
        missing = missing_requirements()
    except Exception as e:
        return f"netem probe failed ({type(e).__name__}: {e})"
    return f"netem requirements missing: {', '.join(missing)}" if missing else None


def _append_results(report: str, mode_name: str, no_append: bool) -> int:
    """Put ``report`` (a ``## title`` line, then the body) into experiments/RESULTS.md as the
    ``vs_torchft-MODE`` section, replacing an earlier one of the same mode (never in --smoke,
    nor with --no-append)."""
    if mode_name != "smoke" and not no_append:
        from experiments.common import update_results  # noqa: PLC0415

        title, _, body = report.partition("\n")
        update_results(HERE / "RESULTS.md", f"vs_torchft-{mode_name}", title.removeprefix("## ").strip(), body)
        print(f"updated {HERE / 'RESULTS.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    mode_name = "smoke" if a.smoke else "quick" if a.quick else "full"
    mode = MODES[mode_name]
    mode = replace(
        mode,
        **{
            k: v
            for k, v in (("sites", a.sites), ("size", a.size), ("rounds", a.rounds), ("sync_every", a.sync_every))
            if v is not None
        },
    )
    out = Path(a.out) if a.out else HERE / "out" / f"vs_torchft_{mode_name}"
    cmd = "python -m experiments.vs_torchft " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.analyse_only:
        return _analyse_only(a, out, mode, mode_name, cmd)
    problem = torchft_problem()
    if problem:
        print(
            f"vs_torchft: {problem}.\nThis experiment needs torchft 0.2.0 in this environment; install it with:\n"
            f"    {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    notes: list[str] = []
    scenarios, base, plan = _plan(a, mode, mode_name, notes)
    print(f"vs_torchft ({mode_name}): {len(plan)} runs -> {out}", flush=True)
    records = _run_plan(plan, out, cmd)
    results = analyse(records, mode=asdict(mode), mode_name=mode_name, command=cmd, notes=notes)
    missed = (
        results["comparisons"].get("healthy", {}).get("targets", {}).get("round wall time dtrain <= torchft") is False
    )
    if a.profile == "always" or (a.profile == "auto" and missed and "healthy" in scenarios and mode_name != "smoke"):
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            notes.append("profile: not run, py-spy is not installed (pip install py-spy)")
        else:
            spec = RunSpec(system="dtrain", scenario="profile", rounds=mode.rounds, pyspy=str(spy), **base)
            t0 = time.monotonic()
            rec = run_one(spec, out / "runs" / run_dir_name(spec), cmd)
            records.append(rec)
            print(
                f"  dtrain  profile (py-spy on site-0)   {time.monotonic() - t0:6.1f}s  {rec.error or 'ok'}", flush=True
            )
            results = analyse(records, mode=asdict(mode), mode_name=mode_name, command=cmd, notes=notes)
    report = write_outputs(results, records, out)
    print(report)
    _append_results(report, mode_name, a.no_append)
    bad = [r for r in records if r.error and r.spec.scenario == "healthy"]
    return 1 if bad else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="CI mode: 2 sites, tiny, healthy only")
    g.add_argument("--quick", action="store_true", help="a few minutes: 2 sites, small")
    p.add_argument("--sites", type=int)
    p.add_argument("--size", choices=["tiny", "small", "base"])
    p.add_argument("--rounds", type=int)
    p.add_argument("--sync-every", type=int)
    p.add_argument("--data", default="stdlib")
    p.add_argument("--codec", default="int8", help="dtrain's codec (torchft all-reduces fp32)")
    p.add_argument("--bucket-bytes", type=int, default=None, help="dtrain bucket size (default: dtrain's)")
    p.add_argument(
        "--extra-codecs",
        default=None,
        help="comma list: one more healthy dtrain run per codec, for the bytes table (default: the mode's)",
    )
    p.add_argument(
        "--profile",
        choices=["auto", "always", "never"],
        default="auto",
        help="sample dtrain's site-0 with py-spy in one more healthy run: always, never, or auto = when "
        "the wall-time target was missed, except in --smoke (default)",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma list of healthy,concurrent,fault,netem (default: the mode's; concurrent = the healthy run "
        "of both systems at the same time, so both see the same background load)",
    )
    p.add_argument("--netem-profiles", default=None, help="comma list of netem profiles (default: the mode's)")
    p.add_argument(
        "--repeats", type=int, default=None, help="healthy runs per system (AB BA order; default: the mode's)"
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "--analyse-only",
        action="store_true",
        help="run nothing: recompute the outputs from the record.json files under OUT/runs",
    )
    p.add_argument("--no-append", action="store_true", help="do not append the report to experiments/RESULTS.md")
    return p


def _analyse_only(a: argparse.Namespace, out: Path, mode, mode_name: str, cmd: str) -> int:
    """Recompute the outputs from OUT/runs/*/record.json, keeping the command and notes of the
    run that made the records."""
    records = [load_record(f) for f in sorted((out / "runs").glob("*/record.json"))]
    records.sort(key=lambda r: r.t_go)
    prev = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    report = write_outputs(
        analyse(
            records,
            mode=prev.get("mode", asdict(mode)),
            mode_name=prev.get("mode_name", mode_name),
            command=prev.get("command", cmd),
            notes=prev.get("notes", []),
        ),
        records,
        out,
    )
    print(report)
    return _append_results(report, mode_name, a.no_append)


def _plan(a: argparse.Namespace, mode, mode_name: str, notes: list[str]) -> tuple[list[str], dict, list[RunSpec]]:
    """(the scenarios, the settings every run shares, the runs in order); a scenario this machine
    cannot run is noted in ``notes`` and left out."""
    scenarios = (
        a.scenarios.split(",")
        if a.scenarios
        else ["healthy"]
        + (["concurrent"] if mode_name != "smoke" else [])
        + (["fault"] if mode.fault_rounds else [])
        + (["netem"] if mode.netem else [])
    )
    profiles = a.netem_profiles.split(",") if a.netem_profiles else list(mode.netem)
    notes: list[str] = []
    base = dict(
        sites=mode.sites,
        size=mode.size,
        data=a.data,
        sync_every=mode.sync_every,
        codec=a.codec,
        bucket_bytes=a.bucket_bytes,
        timeout_s=mode.run_timeout_s,
    )
    plan: list[RunSpec] = []
    if "healthy" in scenarios:
        for rep in range(max(1, a.repeats or mode.repeats)):
            order = ("dtrain", "torchft") if rep % 2 == 0 else ("torchft", "dtrain")
            plan += [RunSpec(system=sy, scenario="healthy", rounds=mode.rounds, repeat=rep, **base) for sy in order]
        codecs = a.extra_codecs.split(",") if a.extra_codecs is not None else list(mode.extra_codecs)
        plan += [
            RunSpec(system="dtrain", scenario=f"healthy codec={c}", rounds=mode.rounds, **{**base, "codec": c})
            for c in codecs
            if c and c != a.codec
        ]
    if "concurrent" in scenarios:  # both systems at the same time: they see the same background load
        for rep in range(max(1, a.repeats or mode.repeats)):
            plan += [
                RunSpec(system=sy, scenario="concurrent", rounds=mode.rounds, repeat=rep, **base)
                for sy in ("dtrain", "torchft")
            ]
    if "fault" in scenarios and mode.fault_rounds:
        if mode.sites < 2:
            notes.append("fault scenario skipped: it needs >= 2 sites")
        else:
            plan += [
                RunSpec(
                    system=s,
                    scenario="fault",
                    rounds=mode.fault_rounds,
                    kill_round=mode.kill_round,
                    restart_after=mode.restart_after,
                    **base,
                )
                for s in ("dtrain", "torchft")
            ]
    if "netem" in scenarios and profiles:
        why = netem_problem()
        if why:
            notes.append(f"netem scenarios ({', '.join(profiles)}) skipped: {why}")
        else:
            for prof in profiles:
                plan += [
                    RunSpec(
                        system=s, scenario=f"netem-{prof}", rounds=mode.netem_rounds or mode.rounds, netem=prof, **base
                    )
                    for s in ("dtrain", "torchft")
                ]
    return scenarios, base, plan


def _run_plan(plan: list[RunSpec], out: Path, cmd: str) -> list[RunRecord]:
    """Every run of ``plan``: "concurrent" pairs at the same time, everything else one after the other."""
    records: list[RunRecord] = []
    batches: list[list[RunSpec]] = []
    for spec in plan:  # "concurrent" pairs run at the same time; everything else one after the other
        if (
            spec.scenario == "concurrent"
            and batches
            and batches[-1][0].scenario == "concurrent"
            and batches[-1][0].repeat == spec.repeat
            and len(batches[-1]) < 2
        ):
            batches[-1].append(spec)
        else:
            batches.append([spec])
    for batch in batches:
        t0 = time.monotonic()
        if len(batch) == 1:
            recs = [run_one(batch[0], out / "runs" / run_dir_name(batch[0]), cmd)]
        else:
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

            together = threading.Barrier(len(batch))
            with ThreadPoolExecutor(len(batch)) as ex:
                recs = list(ex.map(lambda sp: run_one(sp, out / "runs" / run_dir_name(sp), cmd, together), batch))
        for rec in recs:
            records.append(rec)
            status = "ok" if not rec.error else f"PROBLEM: {rec.error}"
            print(
                f"  {rec.spec.system:7s} {rec.spec.scenario:22s} #{rec.spec.repeat} {time.monotonic() - t0:6.1f}s  {status}",
                flush=True,
            )
    return records


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        _prewarmed_main(sys.argv[2:])
    sys.exit(main())
