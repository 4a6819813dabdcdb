"""The micro-benchmarks' one parser and one output writer.

A micro-benchmark (``experiments/bench_*.py``) stays a script run as ``python -m
experiments.bench_NAME``, with :func:`parser`'s flags and its own. It times with :func:`times`,
:class:`Stopwatch` and :func:`cpu_s`, runs a server process as a :class:`Server`, prints its tables
as it measures (:func:`table`), and ends with :func:`write`: its provenance line and, with ``--json``,
every figure under that same stamp, so two checkouts or two machines can be compared file against file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

_load_at_start: float | None = None  # the 1-min load average when parser() was called: "before the run"


def parser(doc: str | None, *, quick: str | None = None, smoke: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's parser, described by ``doc``'s first paragraph: ``--json PATH``, and ``--quick`` /
    ``--smoke`` when given their help text (the benchmark adds its own flags)."""
    global _load_at_start
    _load_at_start = os.getloadavg()[0]
    ap = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0].strip(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick)
    if smoke:
        ap.add_argument("--smoke", action="store_true", help=smoke)
    ap.add_argument("--json", type=Path, help="also write every figure here, stamped (commit, date, command, load)")
    return ap


def cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    """User + system CPU seconds of this process, every thread (``RUSAGE_CHILDREN``: of its reaped children)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def times(
    fn: Callable[[], object], reps: int, *, warmup: int = 0, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Seconds on ``clock`` of each of ``reps`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


class Stopwatch:
    """Seconds on ``clock`` per name of the ``with watch(name):`` blocks run so far: each block's
    (``watch.laps[name]``) and their sum (``watch.s[name]``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.s: dict[str, float] = {}
        self.laps: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = self.clock()
        yield
        dt = self.clock() - t
        self.s[name] = self.s.get(name, 0.0) + dt
        self.laps.setdefault(name, []).append(dt)


def table(header: str, row: str, rows: Iterable[dict[str, Any]] = ()) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Print a markdown table: ``header`` (``"| a | b |"``), its rule, and ``row.format(**r)`` for each of
    ``rows``; returns the function that prints one more row, ``r`` and more cells, and returns ``r``."""
    print(header, "|" + "---|" * (header.count("|") - 1), sep="\n", flush=True)

    def add(r: dict[str, Any], /, **cells: Any) -> dict[str, Any]:
        print(row.format(**r, **cells), flush=True)
        return r

    for r in rows:
        add(r)
    return add


class Server:
    """A spawned process ``target(conn, *args)`` that sends its address on ``conn`` first, then
    answers :meth:`ask` with :func:`answer` until :meth:`stop`."""

    def __init__(self, target: Callable[..., None], *args: Any, timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"{target.__name__} did not start within {timeout_s:.0f} s")
        self.address = self.conn.recv()

    def ask(self, msg: str = "cpu") -> Any:
        self.conn.send(msg)
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def answer(conn: Any, **answers: Callable[[], Any]) -> None:
    """In a :class:`Server`'s process: answer ``"cpu"`` (its CPU seconds, :func:`cpu_s`) and each of
    ``answers`` on ``conn`` until ``"stop"``."""
    while (msg := conn.recv()) != "stop":
        conn.send(answers[msg]() if msg in answers else cpu_s())


def stamp(load_before: float | None = None, commit: str | None = None) -> dict[str, Any]:
    """Where the figures come from: commit (``+dirty``), UTC date, command, 1-min load average (before
    the run, when given, and now), CPUs, machine, torch and Python versions."""
    import torch  # noqa: PLC0415

    from experiments.common import code_version  # noqa: PLC0415

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name if spec is not None else Path(sys.argv[0]).stem
    return {
        "commit": commit or code_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join([".venv/bin/python", "-m", module, *sys.argv[1:]]),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write(args: argparse.Namespace, name: str, figures: Any) -> None:
    """Print the provenance line (commit, UTC date, command, load when :func:`parser` was called and now,
    CPUs, torch); with ``args.json``, write ``{"bench", "stamp", "args", "figures"}`` there."""
    st = stamp(_load_at_start)
    print(
        f"\n{name}: commit {st['commit']}, {st['date']}, `{st['command']}`; load average "
        f"{'-' if st['load_before'] is None else round(st['load_before'], 1)} before, {st['load_after']:.1f} after, "
        f"on {st['cpus']} CPUs ({st['machine']}); torch {st['torch']}",
        flush=True,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"bench": name, "stamp": st, "args": vars(args), "figures": figures}
        args.json.write_text(json.dumps(doc, indent=1, default=str))  # default=str: paths
