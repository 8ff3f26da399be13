"""Fixtures shared by the upstream tests of more than one file."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture
def thin(monkeypatch):
    """SWA thin (and the fast tree core it turns on) installed through the boot, on the Python tree core."""
    from adapter.core import boot
    from adapter.switches import swa_thin

    monkeypatch.delenv(swa_thin.BACKEND_ENV, raising=False)  # restored (unset) after the test
    state = boot.install({"DSV41_SWA_THIN": "1"})
    importlib.import_module(swa_thin.SWITCH.module_of("checkpoint_into_tree"))  # installs now, or already did if it was imported
    assert state.outcomes["swa_thin"].status == "installed", state.outcomes["swa_thin"].reason
    assert state.outcomes["fast_tree_core"].status == "installed"
    return state


@pytest.fixture
def debug_lines():
    """The overlay's log lines (DEBUG included) as text."""
    import logging

    from adapter.core import receipts

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = receipts.logger()
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
