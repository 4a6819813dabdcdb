"""Emulated slow hardware for ``dtrain launch --site-slowdown I=SHARE[,I=SHARE...]`` (issue 34).

Site I trains at SHARE (in (0, 1]) of its speed, by one of two mechanisms (``--slowdown-by``):

* ``cgroup`` (default): the Linux cgroup v1 ``cpu`` controller caps the site's processes at
  SHARE x ``worker.threads`` x ``ranks_per_site`` CPUs (``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us`` = 100 ms, in ``/sys/fs/cgroup/cpu/dtrain/<run>/site-I``). The worker
  enters its cgroup before it execs (a shell writes its own pid to ``cgroup.procs``), so
  every process and thread it starts is capped too. Root only; an absolute cap: on a
  machine with fewer cores than busy threads a site that gets less than its cap anyway is
  not slowed (the launch says so at start when the sites outnumber the cores).
* ``stretch``: the worker sleeps (1 / SHARE − 1) x each inner step's own time after it
  (``WorkerConfig.slowdown``): relative to what the site would do now, whatever the load.

:func:`parse_slowdown` and :func:`cgroup_unavailable` are pure decisions; :class:`CpuCaps`
creates and removes the cgroups.
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path
from typing import Literal

__all__ = ["CGROUP_CPU", "CpuCaps", "SlowdownBy", "cgroup_unavailable", "parse_slowdown", "quota_us"]

log = logging.getLogger(__name__)

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
SlowdownBy = Literal["cgroup", "stretch"]


def parse_slowdown(text: str | None, num_sites: int) -> dict[int, float]:
    """``"2=0.5,3=0.25"`` -> ``{2: 0.5, 3: 0.25}``.

    Raises:
        ValueError: naming ``site_slowdown`` and the allowed form and values.
    """
    if not text:
        return {}
    out: dict[int, float] = {}
    for part in text.split(","):
        index, sep, share = part.strip().partition("=")
        try:
            i, s = int(index), float(share)
        except ValueError:
            i, s = -1, float("nan")
        if not sep or not 0 <= i < num_sites or not 0.0 < s <= 1.0 or i in out:
            raise ValueError(
                f"site_slowdown: {part.strip()!r} is not I=SHARE with a site index I in [0, {num_sites}) "
                f"(once each) and a compute share SHARE in (0, 1], e.g. 2=0.5"
            )
        out[i] = s
    return out


def quota_us(share: float, cpus: int) -> int:
    """``cpu.cfs_quota_us`` for ``share`` of ``cpus`` CPUs over a 100 ms period (>= 1 ms, the kernel's floor)."""
    return max(1000, round(share * cpus * PERIOD_US))


def cgroup_unavailable(root: Path = CGROUP_CPU, *, euid: int | None = None) -> str | None:
    """Why the cgroup v1 cpu controller cannot cap a site here, or None when it can."""
    euid = os.geteuid() if euid is None else euid
    if not (root / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing)"
    if euid != 0:
        return f"capping a site's CPU in {root} needs root (euid {euid})"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable"
    return None


class CpuCaps:
    """The cgroups of one launch's slowed sites: created, entered by each worker, removed.

    Args:
        run: a name unique to the launch (its run directory's name and pid).
        root: the cpu controller's mount.
    """

    def __init__(self, run: str, root: Path = CGROUP_CPU) -> None:
        self.dir = root / "dtrain" / run
        self._made: list[Path] = []

    def create(self, site: int, share: float, cpus: int) -> Path:
        """Site ``site``'s cgroup, capped at ``share`` x ``cpus`` CPUs; its path.

        Raises:
            OSError: the kernel refused a directory or a value.
        """
        for d in (self.dir.parent, self.dir):
            if not d.exists():
                d.mkdir()
                self._made.append(d)
        path = self.dir / f"site-{site}"
        path.mkdir(exist_ok=True)
        self._made.append(path)
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota_us(share, cpus)))
        log.info("site-%d: capped at %.3g CPUs (%s)", site, share * cpus, path)
        return path

    @staticmethod
    def wrap(path: Path, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into cgroup ``path`` (so everything it
        execs and starts is capped)."""
        procs = shlex.quote(str(path / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "dtrain-capped", *argv]

    def remove(self) -> None:
        """Remove the cgroups made (each must be empty: its processes ended); failures are logged."""
        for d in reversed(self._made):
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                if d.parent != self.dir.parent.parent:  # the shared dtrain/ directory may hold other runs
                    log.warning("cgroup %s not removed: %s", d, e)
        self._made.clear()
