"""What ``experiments/vs_torchft.py`` runs and what a run leaves: the modes (``--smoke``,
``--quick``, full), the spec of one run (system x scenario) and its record, which
``record.json`` keeps so that ``--analyse-only`` can recompute the outputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Mode", "MODES", "RunSpec", "RunRecord", "run_dir_name", "load_record", "record_json"]


@dataclass(frozen=True, kw_only=True)
class Mode:
    sites: int
    size: str
    rounds: int
    sync_every: int
    fault_rounds: int  # 0: no fault scenario
    netem: tuple[str, ...]
    netem_rounds: int
    kill_round: int = 3
    restart_after: int = 2
    run_timeout_s: float = 900.0
    repeats: int = 1  # healthy runs per system, in the order AB BA AB ...
    extra_codecs: tuple[str, ...] = ()  # more healthy dtrain runs, one per codec


MODES = {
    "smoke": Mode(
        sites=2, size="tiny", rounds=4, sync_every=5, fault_rounds=0, netem=(), netem_rounds=0, run_timeout_s=120.0
    ),
    "quick": Mode(
        sites=2,
        size="small",
        rounds=8,
        sync_every=20,
        fault_rounds=10,
        netem=("transatlantic",),
        netem_rounds=5,
        repeats=2,
        extra_codecs=("int8+zstd",),
    ),
    "full": Mode(
        sites=3,
        size="small",
        rounds=16,
        sync_every=50,
        fault_rounds=14,
        netem=("transatlantic", "lossy"),
        netem_rounds=8,
        run_timeout_s=1800.0,
        repeats=2,
        extra_codecs=("int8+zstd", "int4"),
    ),
}


@dataclass(kw_only=True)
class RunSpec:
    system: str  # "dtrain" | "torchft"
    scenario: str  # "healthy" | "fault" | "netem-<profile>"
    sites: int
    size: str
    data: str
    rounds: int
    sync_every: int
    codec: str
    bucket_bytes: int | None
    kill_round: int = -1
    restart_after: int = 2
    netem: str | None = None
    timeout_s: float = 900.0
    repeat: int = 0
    pyspy: str | None = None  # path of py-spy: sample dtrain's site-0 (scenario "profile")


@dataclass(kw_only=True)
class RunRecord:
    spec: RunSpec
    dir: Path
    t_go: float = 0.0
    t_kill: float | None = None
    t_restart: float | None = None
    t_end: float = 0.0
    timed_out: bool = False
    error: str | None = None
    procs: dict = field(default_factory=dict)  # name -> {"rc", "maxrss_kb", "role"}
    netem_backends: dict | None = None
    command: str = ""
    loadavg_end: float | None = None  # 1-minute load average when the run ended


def run_dir_name(spec: RunSpec) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", f"{spec.system}_{spec.scenario}_r{spec.repeat}")


def load_record(path: Path) -> RunRecord:
    """A RunRecord back from its ``record.json`` (for ``--analyse-only``)."""
    d = json.loads(Path(path).read_text())
    d["spec"] = RunSpec(**d["spec"])
    d["dir"] = Path(path).parent
    return RunRecord(**d)


def record_json(rec: RunRecord) -> dict:
    d = asdict(rec)
    d["dir"] = str(rec.dir)
    return d
