"""Cone replay beside HiCache: F's Full KV loaded back from host, the Full component only.

Where F's Full KV sits on host (all of ``[D, F)`` below F, D the depth of the deepest node whose
Full KV is on device; D may lie below or above the cone's start s), stock SGLang cannot load it:
``UnifiedRadixCache.load_back`` brings every component of the loaded nodes back together, and the
SWA component's LOAD_BACK transfer (``SWAComponent.build_hicache_transfers``) needs the window
before F on device or host, which is gone (that is why the cone was asked). Stock then resumes
at the deepest host match whose windows survive (B) and recomputes ``[B, L)``.

:func:`load_full_kv` runs HiCache's own admission-time load-back (``UnifiedRadixCache.init_load_back`` on
F's node, from the adder's admission, after the adder's own load-back budget
``memory_budget.prepare_load_back``) with the SWA component's LOAD_BACK transfer left out while it
runs (:func:`_swa_transfers`): the Full component's spec (every host-only node from F up to the
first device node), the load-back locks and write-back pins, the eviction for room, the
controller's one batch of host-to-device copies, the commit onto the nodes and the ack
(``loading_check``, which moves HiCache's load-back metrics) are all HiCache's. F's node keeps no
SWA (its window is replayed from ``[s, F)``; the first checkpoint re-publishes it). The copy of
``[s, F)`` waits for the batch's load event before it reads the loaded pages
(:func:`wait_loaded`).

Why wraps and not an upstream extension point: HiCache has no load-back strategy registry; the
one by-name seam near it (``component_registry_override`` / ``COMPONENT_REGISTRY``) swaps a whole
component class when the cache is built (and forces the Python tree core); what changes here is
one phase of one method for the duration of one call.

When HiCache cannot give the pages, the request runs stock (its own load-back, if any), with one
``DSV41_SWA_CONE fallback`` line naming why, once per request:

* ``load_back_budget``: the adder's load-back budget (``prepare_load_back``) does not fit it;
* ``load_back_pinned``: a node of ``[D, F)`` is pinned by another request's load-back in flight
  (write-back; HiCache's spec comes back empty);
* ``load_back_threshold``: fewer tokens than ``load_back_threshold`` (page 1 only);
* ``load_back_refused``: no device room after eviction, or the controller refused the copies;
* ``load_back_partial``: the load committed pages but not F's Full KV (:func:`load_verdict`; not
  reachable on 0.5.23's ``UnifiedRadixCache`` without a linker, kept for its subclasses): stock, not
  a ``RuntimeError`` on the scheduler thread;
* at plan time (:func:`.plan.load_unsupported`): ``load_back_rust_core`` (the Rust tree core builds its
  load-back spec in Rust, with no per-component seam; ``DSV41_SWA_THIN=1`` selects the Python
  core), ``load_back_buffer_mode`` (HiCache buffer mode loads through its own pipeline),
  ``load_back_prefill_delayer`` (a delayed admission must not queue a load).
"""

from __future__ import annotations

from typing import Any

from adapter.core import api
from adapter.switches.cone_replay.plan import COUNTERS, LIVE, ConePlan

SWITCH = api.handle(__name__)


def host_full_kv(cache: Any) -> str | None:
    """The installed line's ``host_full_kv`` field, read when the cache is built (HiCache attaches
    just after, from the same server arguments): ``load_back`` (the cone loads F's Full KV from
    host), ``stock_rust_core`` (falls back: ``load_back_rust_core``); None without HiCache."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    urc = __import__(SWITCH.module_of("UnifiedRadixCache.match_prefix"), fromlist=["get_memory"])
    try:  # the memory arguments in effect (those init_hicache reads next)
        hierarchical = bool(urc.get_memory().enable_hierarchical_cache)
    except Exception:  # nothing published (a bare cache): no HiCache either
        hierarchical = False
    if not hierarchical and getattr(cache, "cache_controller", None) is None:
        return None
    return "load_back" if isinstance(cache.tree_core, UnifiedTreeCore) else "stock_rust_core"


def load_full_kv(adder: Any, req: Any, plan: ConePlan, extend_len: int, max_new_tokens: int) -> str | None:
    """Load ``[D, F)``'s Full KV back through HiCache for an admitted plan; None on success (the
    request's ``last_node`` is then F's node, as after a stock load-back), else the reason."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    cache = adder.tree_cache
    if getattr(adder, "prefill_delayer_single_pass", None) is not None:
        return "load_back_prefill_delayer"
    if not adder.memory_budget.prepare_load_back(
        full_tokens=plan.load + extend_len + max_new_tokens + adder.page_size,
        extend_input_len=extend_len, max_new_tokens=max_new_tokens, swa_host_hit_length=0,
        chunk_limit=adder.rem_chunk_tokens,
    ):
        return "load_back_budget"
    LIVE.loading = [plan.anchor, None]  # while init_load_back runs for it
    try:
        loaded, _node = cache.init_load_back(
            InitLoadBackParams(best_match_node=plan.anchor, host_hit_length=plan.load, req=req))
        spec_tokens = LIVE.loading[1]
    finally:
        LIVE.loading = None
    anchor_on_device = not cache.tree_core.is_full_device_evicted(plan.anchor)
    why = load_verdict(loaded, anchor_on_device, spec_tokens, int(getattr(cache, "load_back_threshold", 1)))
    if why is not None:
        return why
    req.last_node = plan.anchor
    COUNTERS.loads += loaded > 0
    COUNTERS.loaded_tokens += loaded
    planned = {} if loaded == plan.load else {"planned": plan.load}  # the tree moved since the match
    SWITCH.event("DSV41_SWA_CONE load", rid=req.rid, tokens=loaded, D=plan.F - plan.load, F=plan.F, s=plan.s,
                 **planned)
    return None


def load_verdict(loaded: int, anchor_on_device: bool, spec_tokens: int | None, threshold: int) -> str | None:
    """What ``init_load_back``'s answer means for the cone: None when F's node holds its Full KV on
    device after the call (so does its whole path: HiCache keeps a device node's ancestors on
    device), and the cone goes on with what it got whatever the count (``loaded`` may even be 0 when
    another request's load-back brought the path back since the match); else the fallback reason.

    Stock (``PrefillAdder.add_one_req`` in 0.5.23) goes on with a load of more tokens than promised
    (resident Full KV behind host-only aux state), re-selects its admission without a host hit when
    nothing loaded, and raises ``RuntimeError`` when ``0 < loaded < promised``. The cone needs no
    count: it replays from s whatever lies below, so any load that committed F's node will do; a
    load that committed pages but not F's node (``load_back_partial``) leaves them to the tree (HiCache
    acks them in ``loading_check``) and the request runs stock, as after an empty load.
    """
    if anchor_on_device:
        return None
    if loaded > 0:
        return "load_back_partial"
    if not spec_tokens:
        return "load_back_pinned"
    if spec_tokens < max(1, threshold):
        return "load_back_threshold"
    return "load_back_refused"


def wait_loaded(batch: Any) -> None:
    """Make the copy wait for the batch's HiCache load (``ready_to_load_host_cache`` started it on the
    controller's stream; the forward's layers wait per layer, the copy reads every layer at once)."""
    index = getattr(batch, "hicache_consumer_index", -1)
    controller = getattr(batch.tree_cache, "cache_controller", None)
    if index is None or index < 0 or controller is None:
        return
    counter = controller.layer_done_counter
    counter.events[index].wait(counter.num_layers - 1)


def _build_load_back_spec(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    spec = wrapped(*args, **kwargs)
    loading = LIVE.loading
    node_id = args[0] if args else kwargs["node_id"]
    if loading is not None and node_id == loading[0]:
        loading[1] = len(spec[0].host_indices)
    return spec


def _swa_transfers(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase

    phase = args[1] if len(args) > 1 else kwargs["phase"]
    if LIVE.loading is not None and phase == CacheTransferPhase.LOAD_BACK:
        return None  # the cone replays the window: only the Full component is loaded back
    return wrapped(*args, **kwargs)
