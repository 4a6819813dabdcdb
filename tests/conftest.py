"""Shared by every test tier."""

from __future__ import annotations

import logging

import pytest

# Modules outside tests/unit that start no process of their own (etcd members aside) and use
# a fraction of a core: CPU seconds / wall seconds measured alone on the 2-core machine
# (`/usr/bin/time pytest -p no:xdist FILE`, 2026-12-04): they ran ~115 s of the ~1030 s the
# multi-process worker took, and take their share of a core beside it instead.
BESIDE = (
    "tests/etcd/test_store_contract.py",  # 6.4 of 30 s
    "tests/etcd/test_etcd_client.py",  # 3.8 of 14 s
    "tests/fault/test_inproc_faults.py",  # 12.6 of 45 s
    "tests/fault/test_streaming_faults.py",  # 5.7 of 19 s
    "tests/integration/test_grpc_transport.py",  # 3.2 of 15 s
    "tests/integration/test_grpc_limits.py",  # 2.1 of 10 s
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist (``-n 2``, the CI command), every test outside tests/unit runs on one
    worker, one at a time and in their usual order, as without xdist: those start processes,
    emulated links and etcd clusters, with deadlines sized for one such test at a time on 2
    cores. The unit tests (in process, ~80 s of the suite) run on the other worker beside
    them: the suite's CPU was half idle while its multi-process tests waited on deadlines,
    heartbeats and emulated links. (xdist's own ``--dist loadgroup`` groups nothing under
    pytest 9: its group suffix on the node id is not kept.) The in-process modules of
    ``BESIDE`` go with the unit tests: each mostly waits on its own deadlines and threads."""
    from xdist.scheduler import LoadScopeScheduling

    class OneProcessesScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if nodeid.startswith(("tests/unit/", *BESIDE)) else "processes"

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


@pytest.fixture(params=["compiled", "torch"])
def kernel_path(request, monkeypatch) -> str:
    """A test run on the compiled kernels (``dtrain.codecs.native``: the blockwise codecs and
    error feedback) and again on the torch path. Without a compiler the compiled run is
    skipped, or fails under ``DTRAIN_NATIVE_REQUIRED`` (``.ci/run`` installs gcc)."""
    import os

    from dtrain.codecs import base, blockwise, native
    from dtrain.rounds import error_feedback

    if request.param == "torch":
        monkeypatch.setattr(base, "kernels", lambda: None)
        monkeypatch.setattr(blockwise, "kernels", lambda: None)
        monkeypatch.setattr(error_feedback, "kernels", lambda: None)
    elif native.kernels() is None:
        if os.environ.get("DTRAIN_NATIVE_REQUIRED"):
            pytest.fail("the compiled kernels did not build")
        pytest.skip("no compiler: the compiled kernels are unavailable")
    return request.param
