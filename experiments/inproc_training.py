"""The kill-and-restart training loop of an in-process run (:func:`experiments.common.run_inproc`).

:func:`train_with_restart` drives every site of an :class:`dtrain.sim.InprocCluster` to the
run's last inner step, killing the last site after ``RunSpec.restart_after_round`` rounds and
restarting it (join and state pull) once site 0 applied ``RunSpec.down_rounds`` more.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from dtrain.sim import InprocCluster, Site

if TYPE_CHECKING:
    from experiments.runspec import RunSpec

__all__ = ["train_with_restart"]


def train_with_restart(
    cluster: InprocCluster,
    step: Callable[[Site, int], None],
    spec: RunSpec,
    hook: Callable[[Site], Callable[[Any], None]],
) -> None:
    """Every site trains until its training position (``DiLoCo.inner_steps``) reaches H·rounds
    (``step(site, k)`` at position k); with ``spec.restart_after_round`` the last site dies
    after that round and comes back (``InprocCluster.restart``) once site 0 applied
    ``spec.down_rounds`` more rounds, at the inner step of the training position it pulled;
    ``hook(site)`` is appended to the restarted site's ``on_round`` callbacks.

    The loop follows the site's own position, not a count of its own: a site that was cut
    from a round resyncs and takes a member's position (``DiLoCo._heal``), which can move it
    a round back or forth; counting steps here instead left such a site a round short (or
    long) at the end, with θ unequal to the others' (issue 18, restart seed 8 under load).

    Raises:
        TimeoutError / RuntimeError: as ``InprocCluster.run``; also a restarted site's failure.
    """
    total = spec.sync_every * spec.rounds
    victim = spec.num_sites - 1 if spec.restart_after_round >= 0 else -1
    restart_step = spec.restart_after_round * spec.sync_every
    deadline = time.monotonic() + spec.timeout_s
    errors: list[BaseException] = []

    def come_back() -> Site:
        cluster.kill(victim)
        while cluster.sites[0].diloco.round < spec.restart_after_round + spec.down_rounds:
            if time.monotonic() > deadline or cluster.sites[0].thread is None or not cluster.sites[0].thread.is_alive():
                raise TimeoutError(f"site 0 did not reach round {spec.restart_after_round + spec.down_rounds}")
            time.sleep(0.01)
        site = cluster.restart(victim)
        site.diloco.on_round.append(hook(site))
        return site

    def loop(site: Site) -> None:
        offset, restarting = 0, False  # offset: a restarted site that pulled no position starts at its round
        try:
            while not site.killed.is_set() and site.diloco.inner_steps + offset < total:
                k = site.diloco.inner_steps + offset
                if site.index == victim and not restarting and k >= restart_step:
                    restarting = True  # from here on the killed site's errors are raised below, not by run()
                    site = come_back()
                    offset = 0 if site.diloco.inner_steps else site.diloco.round * spec.sync_every
                    continue
                step(site, k)
        except BaseException as e:  # noqa: BLE001 - the dead site's thread: raised below
            if not restarting:
                raise
            errors.append(e)

    cluster.run(loop, timeout_s=spec.timeout_s)
    if errors:
        raise RuntimeError(f"restarted site {victim} failed: {errors[0]!r}") from errors[0]
