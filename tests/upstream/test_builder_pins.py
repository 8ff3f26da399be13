"""The test scheduler builder stands in for ``Scheduler.__init__`` only as pinned."""

from __future__ import annotations

import pytest

from devkit.testkit import pins
from devkit.testkit.scheduler import build_scheduler


def test_the_builders_pins_match_the_installed_sglang():
    pins.check_builder_pins()


def test_a_drifted_scheduler_init_refuses_the_builder_naming_it(monkeypatch):
    monkeypatch.setitem(pins.PINS, "sglang.srt.managers.scheduler:Scheduler.__init__", "0" * 64)
    with pytest.raises(pins.BuilderDrifted, match=r"Scheduler.__init__ drifted from the pin"):
        build_scheduler(page_size=16, pool_tokens=1024, max_reqs=4)
