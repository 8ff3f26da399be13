"""Test setup shared by every test: one torch thread (2-core machines), the repo on sys.path."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis profiles: "ci" (the default) runs each property test with the examples its decorator
# asks for; "fast" (HYPOTHESIS_PROFILE=fast, the fast lane) caps them through
# devkit.testkit.hypothesis_budget.examples.
settings.register_profile("ci", deadline=None)
settings.register_profile("fast", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _no_overlay_state_leaks():
    """Each test starts with no finder installed and no switch wrapped."""
    from adapter.core import boot

    boot.uninstall()
    yield
    boot.uninstall()


@pytest.fixture
def records():
    """The overlay's log records (its logger does not propagate, so attach a handler), DEBUG included."""
    import logging

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(level=logging.DEBUG)
    log = logging.getLogger("dsv41")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield seen
    log.removeHandler(handler)
    log.setLevel(old_level)
