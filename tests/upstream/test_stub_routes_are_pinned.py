"""The sgl_kernel stand-in's routes patch only pinned upstream code, and refuse drifted code by name."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from overlay_tools.simulate.host_route import RouteRefused

STUB = Path(__file__).resolve().parents[2] / "devkit" / "engine_kit" / "stub"


@pytest.fixture()
def route():
    spec = importlib.util.spec_from_file_location("dsv41_stub_route", STUB / "sgl_kernel" / "_route.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_pin_of_the_stand_in_routes_matches_the_installed_sglang(route):
    from adapter.core import pins

    assert [c.describe() for c in (pins.check(t, route.PINS) for t in route.PINS) if not c.ok] == []
    for name in route.ROUTES:  # each routed module's checks pass as installed
        route.check_pins(name)


def test_a_drifted_route_target_refuses_with_its_name(route, monkeypatch):
    target = f"{route.DEVICE_TIMER}:_TimingInterval.create"
    monkeypatch.setitem(route.PINS, target, "0" * 64)
    with pytest.raises(RouteRefused, match=r"_TimingInterval.create drifted from the pin"):
        route.check_pins(route.DEVICE_TIMER)
    timer = importlib.import_module(route.DEVICE_TIMER)
    before = timer._TimingInterval.create
    with pytest.raises(RouteRefused):
        route.ROUTES[route.DEVICE_TIMER](timer)
    assert timer._TimingInterval.create is before  # nothing patched
