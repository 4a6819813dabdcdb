"""Chaos soak: N sites over gRPC for R rounds with seeded random faults (issue 13).

Every site is a ``dtrain worker`` process (``dtrain.app.procs.Cluster``) checkpointing every
round. site-0 is never faulted (it paces the run); the others get, at seeded random times: ``kill``
(SIGKILL, restarted with ``--resume`` a few seconds later, in whatever phase it was), ``stop``
(SIGSTOP for a few seconds, then SIGCONT), ``corrupt`` (a client holding the token pushes an
undecodable contribution claiming to be a member, for the round in progress), ``flood`` (a client
holding the token keeps idle Push streams open on the site), ``partition`` (netem only: the site
cut off from every other site and the rendezvous for a few seconds); the rendezvous gets
``rv_kill`` (SIGKILL, restarted on the same address: it forgets everything, the sites re-register)
or ``rv_stop``. Faults come from a shuffled bag of the kinds (each once before any repeats); at
most one process is down, stopped or cut off at a time. With netem (``chaos.netem``) every process
runs in its own emulated LAN site; without, on 127.0.0.1 and without ``partition``.

Checked from the metrics lines after the run, per round: no hang (every site that ran the round
finished its engine part, ``round_s``, by the broadcast deadline + 1 s); θ checksums equal among
the sites that applied it with no stale bucket (a mismatch after an unreachable owner,
``owner_lost``, is reported apart: a known open case); nothing an owner refused was applied
(``dtrain.metrics.rejected_applied``); and each worker's RSS and open fds, sampled every second
(growth of each site's longest-lived process after its warm-up). The table also gives faults by
kind, rounds lost at site-0, the longest stall (``sync_s``) and the final loss against a
fault-free run with the same seed. A failed check is a verdict line saying **NOT met**
(``chaos.json``, beside the logs of ``chaos.logs``, has the figures); the run itself exits 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

from dtrain.app.procs import Cluster
from dtrain.metrics import RoundLine, read_metrics, rejected_applied
from dtrain.protocol import Contribution
from dtrain.transports.grpc import PEER_SERVICE, GrpcTransport, GrpcTransportConfig
from experiments.common import RunResult
from experiments.lab import Point, Spec, met
from experiments.procs import netem_problem, netem_topology, wait_until
from experiments.runspec import knob
from experiments.site_failures import RENDEZVOUS as FAILURE_RENDEZVOUS
from experiments.site_failures import WORKER

log = logging.getLogger("chaos")
TOKEN = "chaos-token"
# the fault experiments' timing (site_failures.py); one site is enough for a round here
RENDEZVOUS = {**FAILURE_RENDEZVOUS, "min_sites": 1}
KINDS = ("kill", "stop", "corrupt", "flood", "partition", "rv_kill", "rv_stop")
#: Kinds that take a process or link out for ``down_s``: one at a time.
EXCLUSIVE = frozenset({"kill", "stop", "partition", "rv_kill", "rv_stop"})


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """One soak: the spec's settings (:data:`FIXED`) by the path a field names; ``inner_step_sleep_s``:
    emulated compute per inner step; faults ``max_gap_s / 4`` to ``max_gap_s`` apart, ``num_faults`` at most."""

    num_sites: int = knob("task_spec.num_sites", 3)
    rounds: int = knob("rounds", 8)
    num_faults: int = knob("chaos.faults", 6)
    seed: int = 0
    sync_every: int = knob("diloco.sync_every", 4)
    inner_step_sleep_s: float = 0.25
    down_s: float = knob("chaos.down_s", 2.5)  # s a killed site stays down, a stopped one stopped, a cut one cut
    max_gap_s: float = knob("chaos.max_gap_s", 4.0)
    timeout_s: float = knob("chaos.timeout_s", 600.0)  # bound on the whole run
    netem: bool = False

    def __post_init__(self) -> None:
        if self.num_sites < 2 or self.rounds < 2 or self.num_faults < 0:
            raise ValueError("num_sites >= 2, rounds >= 2, num_faults >= 0")


@dataclass
class Outcome:
    faults: Counter = field(default_factory=Counter)
    lines: dict[int, list[dict]] = field(default_factory=dict)
    # (site, pid) -> (t: time.time() s, the clock of the metrics lines' "time", rss_kb, fds)
    samples: dict[tuple[int, int], list[tuple[float, int, int]]] = field(default_factory=dict)
    wall_s: float = 0.0


def _address(run: Cluster, i: int) -> str | None:
    """Site ``i``'s Peer address, from its log ("peer service listening on HOST:PORT")."""
    host = run.host(i) + ":"
    found = [w for w in run.log_text(i).split() if w.startswith(host) and w[len(host) :].isdigit()]
    return found[-1] if found else None


def _corrupt(address: str, metrics: Path, num_buckets: int = 8, num_tries: int = 8) -> None:
    """Chunk 0 of the first ``num_buckets`` buckets, undecodable, as site-0's, for the round in progress at the
    target (after the last one in its ``metrics``; retried ~0.5 s apart while not open): each owner must refuse it."""
    t = GrpcTransport(GrpcTransportConfig(token=TOKEN, num_attempts=1))
    chunk = dict(chunk=0, offset=0, numel=4096, codec="fp32", sender="site-0", payload=b"\x00" * 64)
    try:
        for _ in range(num_tries):
            rnd = max([ln.round for ln in read_metrics(metrics) if isinstance(ln, RoundLine)] or [0]) + 1
            opened = True
            for b in range(num_buckets):
                try:
                    t.push(address, [Contribution(round=rnd, bucket=b, **chunk)], timeout_s=2.0)
                except Exception as e:  # noqa: BLE001 - refused, as it must be
                    log.info("chaos: corrupt chunk b%d of round %d to %s refused: %s", b, rnd, address, e)
                    opened = "not open" not in str(e) and "is over" not in str(e)
                    if not opened or "out of range" in str(e):
                        break
            if opened:
                return
            time.sleep(0.5)
    finally:
        t.stop(0.1)


def _flood(address: str, num_streams: int, hold_s: float) -> None:
    """``num_streams`` idle Push streams held for ``hold_s`` (each sends nothing)."""
    ch = grpc.insecure_channel(address)
    push = ch.stream_unary(f"/{PEER_SERVICE}/Push")
    done = threading.Event()

    def idle():
        done.wait(hold_s)
        return
        yield b""

    calls = [push.future(idle(), timeout=hold_s + 5, metadata=(("dtrain-token", TOKEN),)) for _ in range(num_streams)]
    done.wait(hold_s)
    done.set()
    for call in calls:
        call.cancel()
    ch.close()


def _rogue(kind: str, address: str, metrics: Path) -> None:
    """One rogue action (``corrupt`` or ``flood``) against ``address`` (whose site writes ``metrics``)."""
    if kind == "corrupt":
        _corrupt(address, metrics)
    else:
        _flood(address, 50, 2.0)


class _Soak(Cluster):
    def __init__(self, cfg: ChaosConfig, root: Path, *, faults: bool, topo=None) -> None:
        super().__init__(root, num_sites=cfg.num_sites, timeout_s=cfg.timeout_s, topo=topo)
        self.cfg, self.with_faults = cfg, faults
        root.mkdir(parents=True, exist_ok=True)
        self.token_file = root / "token"
        self.token_file.write_text(TOKEN)
        self.rng = random.Random(cfg.seed)
        self.kinds = [k for k in KINDS if topo is not None or k != "partition"]
        self.bag: list[str] = []
        self.out = Outcome()
        self.down: dict[int, float] = {}  # site (num_sites: the rendezvous) -> when to restart / resume / heal
        self.stopped: set[int] = set()
        self.cut: set[int] = set()
        self.rogues: list = []  # rogue client processes (netem)

    def opts(self) -> dict:
        c, token_file = self.cfg, str(self.token_file)
        opts = dict(size="tiny", seed=c.seed, rounds=c.rounds, sync_every=c.sync_every, token_file=token_file)
        return opts | dict(inner_step_sleep_s=c.inner_step_sleep_s, **WORKER)

    def rv_opts(self) -> dict:
        return {"initial_sites": self.cfg.num_sites, **RENDEZVOUS, "token_file": str(self.token_file)}

    def sample(self) -> None:
        """Each live worker's RSS (kB) and open fds, from /proc (a process gone meanwhile: no sample)."""
        for name, p in self.procs.items():
            if not name.startswith("site-") or p.poll() is not None:
                continue
            try:
                rss = next(int(ln.split()[1]) for ln in open(f"/proc/{p.pid}/status") if ln.startswith("VmRSS:"))
                fds = len(os.listdir(f"/proc/{p.pid}/fd"))
            except (OSError, StopIteration, ValueError):
                continue
            self.out.samples.setdefault((int(name[5:]), p.pid), []).append((time.time(), rss, fds))

    def draw(self) -> str | None:
        """The next kind from the (refilled, shuffled) bag; None while it is exclusive and something is out."""
        if not self.bag:
            self.bag = self.rng.sample(self.kinds, len(self.kinds))
        if self.bag[-1] in EXCLUSIVE and self.down:
            return None
        return self.bag.pop()

    def inject(self) -> bool:
        """Inject the next fault; False when none could be now (try again shortly)."""
        kind = self.draw()
        if kind is None:
            return False
        i = self.rng.randrange(1, self.cfg.num_sites)
        if kind in EXCLUSIVE:
            self._take_out(kind, self.cfg.num_sites if kind.startswith("rv_") else i)
        elif not self._rogue_action(kind, i):
            return False
        log.info("chaos: %s on %s", kind, "rendezvous" if kind.startswith("rv_") else f"site-{i}")
        self.out.faults[kind] += 1
        return True

    def _take_out(self, kind: str, i: int) -> None:
        """SIGKILL, SIGSTOP or cut off site ``i`` (``num_sites``: the rendezvous) for ``down_s``."""
        name = "rendezvous" if i == self.cfg.num_sites else f"site-{i}"
        if kind.endswith("kill"):
            self.procs[name].kill()
        elif kind.endswith("stop"):
            self.procs[name].send(signal.SIGSTOP)
            self.stopped.add(i)
        else:
            self.topo.partition(i, True)
            self.cut.add(i)
        self.down[i] = time.monotonic() + self.cfg.down_s

    def _rogue_action(self, kind: str, i: int) -> bool:
        addr = _address(self, i)
        if addr is None:
            return False
        metrics = self.root / f"site-{i}" / "metrics.jsonl"  # the round in progress there
        if self.topo is None:
            threading.Thread(target=_rogue, args=(kind, addr, metrics), daemon=True).start()
        else:  # from the rendezvous's site (the root namespace has no route to the sites); the
            # process reads the round once started (a second or more later)
            argv = [sys.executable, "-m", "experiments.chaos", "--rogue", kind, addr, str(metrics)]
            self.rogues.append(self.topo.popen(self.cfg.num_sites, argv, env=self.env, stdout=subprocess.DEVNULL))
        return True

    def recover(self) -> None:
        now = time.monotonic()
        n = self.cfg.num_sites
        for i, at in list(self.down.items()):
            if now < at:
                continue
            del self.down[i]
            name = "rendezvous" if i == n else f"site-{i}"
            if i in self.stopped:
                self.stopped.discard(i)
                self.procs[name].send(signal.SIGCONT)
            elif i in self.cut:
                self.cut.discard(i)
                self.topo.partition(i, False)
            elif i == n:
                self.start_rendezvous(bind=self.rv_address, **self.rv_opts())
            elif self.procs[name].poll() is not None:
                self.start_site(i, resume=True, **self.opts())
        self.rogues = [p for p in self.rogues if p.poll() is None]

    def run(self) -> Outcome:
        c = self.cfg
        t0 = time.monotonic()
        self.start_rendezvous(**self.rv_opts())
        for i in range(c.num_sites):
            self.start_site(i, **self.opts())
        self.wait(lambda: self.done_round(0, 0), "round 0 at site-0")
        next_fault = time.monotonic() + self.rng.uniform(0.5, 2.0)
        last_sample = 0.0
        while not self.done_round(0, c.rounds - 1):
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"site-0 did not finish {c.rounds} rounds in {c.timeout_s} s")
            self.check_alive(["site-0"] + ([] if c.num_sites in self.down else ["rendezvous"]))
            now = time.monotonic()
            if now - last_sample >= 1.0:
                self.sample()
                last_sample = now
            self.recover()
            if self.with_faults and sum(self.out.faults.values()) < c.num_faults and now >= next_fault:
                if self.inject():
                    next_fault = now + self.rng.uniform(c.max_gap_s / 4, c.max_gap_s)
            time.sleep(0.05)
        self.down = dict.fromkeys(self.down, 0.0)  # let the last ones back for the end
        self.recover()
        self.out.wall_s = time.monotonic() - t0
        wait_until(lambda: self.exited([f"site-{i}" for i in range(c.num_sites)]), 30, poll_s=0.2)
        self.out.lines = {i: self.rounds(i) for i in range(c.num_sites)}
        return self.out

    def close(self) -> None:
        for p in self.rogues:
            p.kill()
        super().close()


def warm_up_end_s(samples: list[tuple[float, int, int]], round_lines: list[dict]) -> float:
    """When a worker process's warm-up ends (``time.time()`` s): 30 % into its sampled life, never before
    its first round line (a restarted worker imports torch, builds its task and pulls θ first)."""
    t_first, t_last = samples[0][0], samples[-1][0]
    first_round = min(
        (ln["time"] for ln in round_lines if "time" in ln and t_first <= ln["time"] <= t_last), default=t_last
    )
    return max(t_first + 0.3 * (t_last - t_first), first_round)


def analyse(cfg: ChaosConfig, out: Outcome, ref: Outcome | None) -> dict:
    """The table's figures (see the module docstring)."""
    limit_s = RENDEZVOUS["broadcast_timeout_s"] + 1.0
    by_round: dict[int, dict[int, dict]] = {}
    for i, lines in out.lines.items():
        for ln in lines:
            by_round.setdefault(ln["round"], {})[i] = ln  # the last attempt of a round
    hangs = [(i, r) for r, d in by_round.items() for i, ln in d.items() if (ln.get("round_s") or 0.0) > limit_s]
    mismatches, owner_cut = [], []
    for r, d in sorted(by_round.items()):
        applied = [ln for ln in d.values() if ln["status"] == "applied" and not ln.get("stale_buckets")]
        if len({ln["checksum"] for ln in applied}) > 1:
            # an owner some site could not reach (owner_lost there) applied its own mean: the
            # known open case of an owner cut off during the reduce (RESULTS.md, chaos soak)
            cut = any((ln.get("bucket_outcomes") or {}).get("owner_lost") for ln in applied)
            (owner_cut if cut else mismatches).append(r)
    ref0 = {ln["round"] for ln in out.lines.get(0, []) if ln["status"] == "applied"}
    lost = sorted(set(range(cfg.rounds)) - ref0)
    stall = max((ln.get("sync_s") or 0.0 for lines in out.lines.values() for ln in lines), default=0.0)
    growth = {}  # per site, its longest-lived process: last sample minus the first after its warm-up
    for (i, _pid), s in sorted(out.samples.items(), key=lambda kv: len(kv[1])):
        t_warm = warm_up_end_s(s, out.lines.get(i, []))
        warm = [x for x in s if x[0] >= t_warm]
        if len(warm) >= 2:
            (t0, rss0, fds0), (t1, rss1, fds1) = warm[0], warm[-1]
            growth[i] = {"rss_kb": rss1 - rss0, "fds": fds1 - fds0, "over_s": round(t1 - t0)}
    final = out.lines.get(0, [{}])[-1].get("val_loss") if out.lines.get(0) else None
    ref_final = ref.lines.get(0, [{}])[-1].get("val_loss") if ref and ref.lines.get(0) else None
    rejected = sum(sum((ln.get("rejected") or {}).values()) for lines in out.lines.values() for ln in lines)
    named = sum(len(ln.get("rejected_senders") or []) for lines in out.lines.values() for ln in lines)
    refused_applied = rejected_applied([ln for lines in out.lines.values() for ln in lines])
    return {
        "faults": dict(out.faults),
        "num_faults": sum(out.faults.values()),
        "rounds": cfg.rounds,
        "hangs": hangs,
        "checksum_mismatch_rounds": mismatches,
        "unequal_after_unreachable_owner_rounds": owner_cut,
        "rounds_lost_at_site0": lost,
        "longest_stall_s": round(stall, 2),
        "rejected_contributions": rejected,
        "rejected_named": named,
        "refused_but_applied": refused_applied,
        "netem": cfg.netem,
        "growth_after_warmup": growth,
        "final_val_loss": final,
        "fault_free_final_val_loss": ref_final,
        "wall_s": round(out.wall_s, 1),
    }


def _row(res: dict) -> dict:
    """The CSV row of one soak's figures (:func:`analyse`): lists as counts, the faults as text."""
    growth = res["growth_after_warmup"].values()
    return {
        "faults": ", ".join(f"{k} {v}" for k, v in sorted(res["faults"].items())),
        **{k: res[k] for k in ("num_faults", "longest_stall_s", "rejected_contributions", "rejected_named", "netem")},
        **{k: len(res[k]) for k in ("hangs", "checksum_mismatch_rounds", "refused_but_applied")},
        "owner_cut_rounds": len(res["unequal_after_unreachable_owner_rounds"]),
        "rounds_lost_at_site0": len(res["rounds_lost_at_site0"]),
        "max_rss_growth_kb": max((g["rss_kb"] for g in growth), default=0),
        "max_fd_growth": max((g["fds"] for g in growth), default=0),
        **{k: res[k] for k in ("final_val_loss", "fault_free_final_val_loss", "wall_s")},
    }


def table(rows: list[dict], rounds: list, m: dict, prefix: Path) -> str:
    """One column per soak (seed): faults, hangs, unequal θ, rounds lost, stalls, refusals, growth, loss."""
    items = {  # label -> the cell, from the row's columns
        "faults injected": "{num_faults} ({faults})",
        "rounds (site-0)": "{rounds}",
        "hangs (round_s > broadcast deadline + 1 s)": "{hangs}",
        "rounds with unequal θ among applying sites, unexplained": "{checksum_mismatch_rounds}",
        "rounds with unequal θ after an owner some site could not reach (known, open)": "{owner_cut_rounds}",
        "rounds lost at site-0": "{rounds_lost_at_site0}",
        "longest stall (sync_s, s)": "{longest_stall_s}",
        "contributions refused (named per chunk)": "{rejected_contributions} ({rejected_named})",
        "refused contributions found in an applied mean": "{refused_but_applied}",
        "largest RSS (kB) / fd growth after warm-up of a site": "{max_rss_growth_kb} / {max_fd_growth}",
        "final val loss, this run (fault-free run, same seed; None: not run)": "{final_val_loss} "
        "({fault_free_final_val_loss})",
        "netem": "{netem}",
        "wall (s)": "{wall_s}",
    }
    head = ["| | " + " | ".join(f"seed {r['seed']}" for r in rows) + " |", "|---|" + "---|" * len(rows)]
    return "\n".join([*head, *(f"| {k} | " + " | ".join(f.format(**r) for r in rows) + " |" for k, f in items.items())])


def verdict(rows: list[dict], rounds: list, m: dict) -> list[str]:
    """No hang, no unexplained unequal θ, nothing refused in an applied mean, in every soak."""
    ok = all(not r["hangs"] and not r["checksum_mismatch_rounds"] and not r["refused_but_applied"] for r in rows)
    return [f"- no hang, equal θ, nothing refused applied: {met(ok)}"]


def _netem_wanted(mode: str) -> bool:
    if mode == "off":
        return False
    why = netem_problem()
    if why and mode == "on":
        raise SystemExit(f"chaos.netem=on: netem cannot emulate links here: {why}")
    return not why


def _soak(cfg: ChaosConfig, root: Path, *, faults: bool) -> Outcome:
    """One run, under netem (sites + 1 for the rendezvous) when ``cfg.netem``."""
    ctx = netem_topology(cfg.num_sites + 1, "chaos", "run chaos") if cfg.netem else contextlib.nullcontext()
    with ctx as topo, contextlib.closing(_Soak(cfg, root, faults=faults, topo=topo)) as soak:
        return soak.run()


def run_point(point: Point) -> RunResult:
    """One soak (and first the fault-free run of the same seed, with ``chaos.reference``); its
    figures go to ``chaos.json`` beside the logs (``chaos.logs``, default a temporary directory)."""
    s = point.settings
    kw = {f.name: s[f.metadata["path"]] for f in fields(ChaosConfig) if "path" in f.metadata}
    seed = point.seed if s["chaos.seed"] is None else s["chaos.seed"]
    cfg = ChaosConfig(**kw, seed=seed, netem=_netem_wanted(s["chaos.netem"]))
    root = Path(s["chaos.logs"] or tempfile.mkdtemp(prefix="dtrain-chaos-"))
    ref = _soak(cfg, root / "fault_free", faults=False) if s["chaos.reference"] else None
    res = analyse(cfg, _soak(cfg, root / "chaos", faults=True), ref)
    (root / "chaos.json").write_text(json.dumps(res, indent=2))
    print(f"chaos: logs and chaos.json under {root}", flush=True)
    return RunResult(row=point.row(**_row(res)), rounds=[])


# every soak's settings: ChaosConfig's defaults (a mode sets rounds, faults and timing), and how it runs
FIXED = {f.metadata["path"]: f.default for f in fields(ChaosConfig) if "path" in f.metadata} | {
    "chaos.reference": True,  # the fault-free run of the same seed, for the final loss
    "chaos.netem": "auto",  # on / off / auto: netem sites when root and ip netns allow (partitions need them)
    "chaos.logs": None,
    "chaos.seed": None,  # the soak's seed instead of the lab's seeds 0..n-1
}

SMOKE = {"rounds": 12, "chaos.faults": 7, "chaos.max_gap_s": 2.0, "chaos.down_s": 1.5, "chaos.reference": False}
SPEC = Spec(
    name="chaos",
    title="Chaos soak (issue 13)",
    modes={
        "smoke": dict(seeds=[0], fixed=SMOKE),
        "quick": dict(seeds=[0], fixed={"rounds": 60, "chaos.faults": 20, "chaos.timeout_s": 7200.0}),
        "full": dict(seeds=[0], fixed={"rounds": 200, "chaos.faults": 50, "chaos.timeout_s": 7200.0}),
    },
    fixed=FIXED,
    paths=tuple(p for p in FIXED if p.startswith("chaos.")),
    label=lambda point: "soak",
    metrics=(("num_faults", 0, 10_000), ("wall_s", 0.0, 1e6)),
    report=table,
    verdict=verdict,
    execute=run_point,
)


if __name__ == "__main__" and sys.argv[1:2] == ["--rogue"]:  # a rogue client process (netem runs)
    _rogue(sys.argv[2], sys.argv[3], Path(sys.argv[4]))  # --rogue KIND ADDRESS METRICS_JSONL
