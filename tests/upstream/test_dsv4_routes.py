"""The DeepSeek-V4 kit's routes: every patched SGLang 0.5.23 function is pinned and matches the
installed source, and a drifted pin refuses loudly, naming the function, before anything is patched."""

from __future__ import annotations

import importlib

import pytest

from adapter.core.pins import check
from devkit.engine_kit.dsv4 import pins, routes


def test_every_route_target_is_pinned_and_the_installed_source_matches_its_pin():
    targets = routes.targets()
    assert sorted(targets) == sorted(pins.PINS)
    drifted = [check(t, pins.PINS).describe() for t in targets if not check(t, pins.PINS).ok]
    assert drifted == []


def test_a_route_whose_target_drifted_raises_naming_the_function_and_patches_nothing(monkeypatch):
    name = "sglang.kernels.ops.activation.silu_and_mul_clamp"
    module = importlib.import_module(name)
    before = module.silu_and_mul_clamp
    monkeypatch.setitem(routes.PINS, f"{name}:silu_and_mul_clamp", "0" * 64)
    with pytest.raises(routes.RouteRefused, match=r"silu_and_mul_clamp drifted from the pin"):
        routes.apply(module)
    assert module.silu_and_mul_clamp is before
