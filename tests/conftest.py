"""Shared by every test tier."""

from __future__ import annotations

import logging

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist (``-n 2``, the CI command), every test outside tests/unit runs on one
    worker, one at a time and in their usual order, as without xdist: those start processes,
    emulated links and etcd clusters, with deadlines sized for one such test at a time on 2
    cores. The unit tests (in process, ~80 s of the suite) run on the other worker beside
    them: the suite's CPU was half idle while its multi-process tests waited on deadlines,
    heartbeats and emulated links. (xdist's own ``--dist loadgroup`` groups nothing under
    pytest 9: its group suffix on the node id is not kept.)"""
    from xdist.scheduler import LoadScopeScheduling

    class OneProcessesScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if nodeid.startswith("tests/unit/") else "processes"

    return OneProcessesScope(config, log)


@pytest.fixture(autouse=True)
def _restore_dtrain_logger_level():
    """Experiments run in-process by the smoke tests quiet the ``dtrain`` logger
    (``experiments.common`` sets it to ERROR); a later test's ``caplog`` would then see
    no warning from any dtrain module. Put the level back after every test."""
    logger = logging.getLogger("dtrain")
    level = logger.level
    yield
    logger.setLevel(level)
