"""SWA thin on a tree without an SWA component refuses at cache build instead of doing nothing silently.

DeepSeek-V4.1 under ``--enable-encoder-swa-bounded-replay`` builds its ``UnifiedRadixCache`` without
an SWA component (the windows live in per-request rings; ``--swa-prefix-tails`` is ignored), so SWA
thin has no SWA LRU to reorder although it forced the Python tree core.
"""

from __future__ import annotations

import importlib

import pytest

from adapter.core import boot
from adapter.switches import swa_thin
from overlay_tools.simulate import cache_kit


def _install(strict: bool = False) -> boot.State:
    state = boot.install({"DSV41_SWA_THIN": "1", **({"DSV41_STRICT": "1"} if strict else {})})
    importlib.import_module(swa_thin.SWITCH.module_of("checkpoint_into_tree"))
    assert state.outcomes["swa_thin"].status == "installed"
    return state


def _tree_without_swa(monkeypatch):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    # What the engine builds under encoder bounded replay: the tree's components are FULL alone.
    init = CacheInitParams.__init__

    def full_only(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.tree_components = (ComponentType.FULL,)

    monkeypatch.setattr(CacheInitParams, "__init__", full_only)


def test_a_tree_without_an_swa_component_refuses_the_switch_at_cache_build(
        monkeypatch, capfd):
    state = _install()
    _tree_without_swa(monkeypatch)
    kit = cache_kit.build(cache_kit.SMALL, backend="python")
    assert state.outcomes["swa_thin"].status == "refused"
    assert "the prefix tree has no SWA component" in state.outcomes["swa_thin"].reason
    err = capfd.readouterr().err
    assert err.count("[dsv41] swa_thin refused: the prefix tree has no SWA component") == 1
    calls = []
    assert swa_thin._checkpoint_into_tree(lambda *a, **k: calls.append(a) or "stock", kit.cache, ("req", 0), {}) == "stock"
    assert calls == [("req", 0)]


def test_under_strict_a_tree_without_an_swa_component_fails_the_boot(monkeypatch):
    _install(strict=True)
    _tree_without_swa(monkeypatch)
    with pytest.raises(boot.BootError, match="swa_thin refused under DSV41_STRICT=1: the prefix tree has no SWA"):
        cache_kit.build(cache_kit.SMALL, backend="python")


def test_a_tree_with_an_swa_component_keeps_the_switch_installed():
    state = _install()
    cache_kit.build(cache_kit.SMALL, backend="python")
    assert state.outcomes["swa_thin"].status == "installed"
