"""SWA thin on the cache kit (:mod:`overlay_tools.simulate.cache_kit`), as the benches and ``simulate`` build it.

* :func:`install_thin`: SWA thin (and the fast tree core it turns on) through the real boot path;
* :func:`cache_kit` / :func:`traffic_unit`: the cache kit at a scaled DSV4 shape (page 16, window 8,
  chunk 128), thin on or kept stock, HiCache attached when asked, and one unit of other traffic.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from devkit.testkit import radix_cache as rc

if TYPE_CHECKING:
    from overlay_tools.simulate.cache_kit import CacheKit, HiCache

PAGE, WINDOW, CHUNK = 16, 8, 128  # the scaled shape of cache_kit


def install_thin() -> None:
    """SWA thin (and the fast tree core it turns on) installed in this process, or an error naming why not."""
    import importlib
    import os

    from adapter.core import boot

    os.environ.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
    state = boot.install({"DSV41_SWA_THIN": "1"})
    importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    for name in ("fast_tree_core", "swa_thin"):
        if state.outcomes[name].status != "installed":
            raise RuntimeError(f"{name} did not install: {state.outcomes[name].reason}")


def cache_kit(full_tokens: int, swa_tokens: int, thin: bool, hicache: HiCache | None) -> Any:
    """The cache kit at the scaled shape's page, window and chunk (Python tree core), SWA thin's demotion
    on or kept stock, HiCache attached when ``hicache`` is given."""
    from adapter.switches import swa_thin as switch
    from overlay_tools.simulate.cache_kit import Geometry, build

    geometry = Geometry(PAGE, WINDOW, CHUNK, full_tokens=full_tokens, swa_tokens=swa_tokens, max_reqs=8,
                        max_ctx=1 << 16)
    kit = build(geometry, backend="python", hicache=hicache)
    if not thin:
        switch.keep_stock(kit.cache)
    return kit


def traffic_unit(kit: CacheKit, tok: rc.Tokens, rng: random.Random, unit: int, long_len: int = 8192) -> None:
    """One unit of other traffic at the scaled shape: every sixth unit a new ``long_len``-token session, else a sub-agent
    (a 256-768-token chunked turn and a short follow-up)."""
    if unit % 6 == 0:  # a new long session: one chunked turn
        kit.run_turn(tok.fresh(long_len), PAGE)
    else:  # a sub-agent: a chunked turn and a short follow-up turn
        first = kit.run_turn(tok.fresh(rng.randint(16, 48) * PAGE), rng.randint(1, 4) * PAGE)
        kit.run_turn(first.history + tok.fresh(rng.randint(2, 8) * PAGE), rng.randint(1, 4) * PAGE)
