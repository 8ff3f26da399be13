"""The engine kit's test seams (``devkit/engine_kit/seams``) on the real classes they read."""

from __future__ import annotations

import importlib.util

from devkit.engine_kit import launcher
from devkit.testkit import radix_cache as rc
from overlay_tools.simulate import cache_kit


def _park_probe(monkeypatch):
    """The seam's reader alone: its hook on ``release_req`` is not installed in this process (it would
    stay for every later test here)."""
    import wrapt

    monkeypatch.setattr(wrapt, "register_post_import_hook", lambda *args, **kwargs: None)
    spec = importlib.util.spec_from_file_location("park_probe_under_test", launcher.SEAMS_PATH / "park_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_park_probe_reads_how_far_the_tree_holds_a_rows_full_kv_on_device_and_on_host(monkeypatch):
    """On the real ``UnifiedRadixCache`` with HiCache (write-back): a finished turn is held on the
    device; evicted, it is held on host only; a row that diverges is held up to where it does."""
    held = _park_probe(monkeypatch)._held
    kit = cache_kit.build(cache_kit.SMALL, hicache=cache_kit.HiCache(ratio=2.0, write_policy="write_back"))
    toks = rc.Tokens()
    history = kit.run_turn(toks.fresh(400), out_len=16).history
    page = kit.geometry.page
    in_tree = len(history) // page * page
    assert held(kit.core, history) == (in_tree, in_tree)
    assert held(kit.core, history[:200] + toks.fresh(50)) == (200, 200)
    kit.evict(full=1 << 20)
    assert held(kit.core, history) == (0, in_tree)  # write-back: on host only
    kit.cache.sanity_check()
