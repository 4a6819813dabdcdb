"""Shared by every test tier."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _restore_dtrain_logger_level():
    """Experiments run in-process by the smoke tests quiet the ``dtrain`` logger
    (``experiments.common`` sets it to ERROR); a later test's ``caplog`` would then see
    no warning from any dtrain module. Put the level back after every test."""
    logger = logging.getLogger("dtrain")
    level = logger.level
    yield
    logger.setLevel(level)
