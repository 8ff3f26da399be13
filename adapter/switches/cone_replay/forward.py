"""Cone replay's forward side: the replay rows of a batch, and what each layer does with them.

* :func:`replay_rows` (after ``ForwardBatch.init_new``): the replay rows of one extend batch and
  F's tree slots of ``[s, F)``; one line ``DSV41_SWA_CONE forward rows=..``. The result rides on
  the live ForwardBatch and is published in ``plan.LIVE.active`` for the duration of
  ``ModelRunner.forward`` (the runners copy the live batch into static buffers, so an attribute on
  it would not survive). Such a batch never runs in a prefill CUDA graph.
* ``SWAKVPool`` (:func:`substitute_full_kv`, in ``RadixAttention.forward``): SGLang's extend
  kernels read the extend rows' K/V from the forward's own ``k``/``v``, not from the cache, so in
  every Full-attention layer the replay rows' ``k``/``v`` become the resident Full KV of
  ``[s, F)``; sliding-window layers are untouched.
* DeepSeek-V4 (:mod:`.dsv4`): ``encoder_swa_compress_rows`` on the ForwardBatch masks the
  compressor / indexer writes of the cone's copied rows; the DSV4 attention layers do not go
  through :func:`substitute_full_kv` (no ``layers_mapping``: they pass through unchanged).
"""

from __future__ import annotations

from typing import Any

from adapter.core import api
from adapter.switches.cone_replay import dsv4
from adapter.switches.cone_replay.geometry import cache_config
from adapter.switches.cone_replay.plan import COPIED, COUNTERS, FORWARDED, LIVE, REQ_ATTR

SWITCH = api.handle(__name__)
FORWARD_ATTR = "_dsv41_cone_rows"  # (batch rows, F's tree slots, pool) of one forward's replay rows
# The replay rows of the forward running now: a field-less attribute does not survive the runners'
# copies of the live ForwardBatch (dataclasses.replace into static buffers), so ModelRunner.forward
# publishes them in LIVE.active for its duration; forwards of one process never overlap.


def swa_kv_pool_unsupported(kvpool: Any) -> str | None:
    """Why the ``SWAKVPool`` forward side (:func:`substitute_full_kv`) cannot run on this pool (None: it can)."""
    name = type(kvpool).__name__
    full = getattr(kvpool, "full_kv_pool", None)
    if full is None or not hasattr(full, "k_buffer"):
        return f"the Full side of {name} ({type(full).__name__}) is not an MHA pool; only MHA Full layers are substituted"
    if getattr(full, "store_dtype", full.dtype) != full.dtype or full.dtype.itemsize == 1:
        return f"the Full KV cache is quantized ({full.dtype}); the replay rows' K/V cannot be read back exactly"
    return None


def replay_rows(batch: Any, layout: list | None = None) -> tuple[Any, Any] | None:
    """The replay rows of one extend batch: (row indices in the batch's token order, the tree
    slots of ``[s, F)`` they read their Full-side K/V from); None when it has none. Marks the
    plans spent: a later pass of the same request is an ordinary extend. ``layout``, when given,
    receives ``(prefix_len, extend_len, plan or None)`` per request in batch order."""
    import torch

    if not batch.forward_mode.is_extend() or batch.prefix_lens is None:
        return None
    rows, slots, start = [], [], 0
    for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        plan = getattr(req, REQ_ATTR, None)
        if plan is not None and plan.state == COPIED and prefix == plan.s:
            rows.append(torch.arange(start, start + plan.F - plan.s, dtype=torch.int64))
            slots.append(plan.source.to(torch.int64))
            plan.state = FORWARDED
            LIVE.copied = max(0, LIVE.copied - 1)
        else:
            plan = None
        if layout is not None:
            layout.append((int(prefix), int(extend), plan))
        start += extend
    if not rows:
        return None
    device = batch.out_cache_loc.device
    return torch.cat(rows).to(device), torch.cat(slots).to(device)


def _forward_batch_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    forward_batch = wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs["batch"]
    layout: list[tuple[int, int, Any]] = []
    cone = replay_rows(batch, layout) if LIVE.copied else None
    if cone is not None:
        model_runner = args[1] if len(args) > 1 else kwargs["model_runner"]
        cone = (*cone, model_runner.token_to_kv_pool)
        setattr(forward_batch, FORWARD_ATTR, cone)
        COUNTERS.forwards += 1
        cfg = cache_config(getattr(batch, "tree_cache", None))
        if cfg is not None and cfg.dsv4:
            masked = dsv4.apply(forward_batch, layout, cfg.window, cfg.page)
            COUNTERS.masked_rows += masked
            SWITCH.event("DSV41_SWA_CONE forward", rows=int(cone[0].numel()), masked=masked)
        else:
            SWITCH.event("DSV41_SWA_CONE forward", rows=int(cone[0].numel()))
    return forward_batch


def substitute_full_kv(layer: Any, k: Any, v: Any, cone: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """In a Full-attention layer of ``SWAKVPool``, the replay rows' K/V become the resident Full KV
    of ``[s, F)`` (F's tree slots); sliding-window layers are returned unchanged.
    ``cone``: (rows, slots, pool) as :func:`replay_rows` and the model runner's pool give them."""
    rows, slots, pool = cone
    mapping = getattr(pool, "layers_mapping", None)
    if mapping is None or mapping[layer.layer_id][1]:
        return k, v
    key_buffer, value_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    k = k.reshape(k.shape[0], *key_buffer.shape[1:]).clone()
    v = v.reshape(v.shape[0], *value_buffer.shape[1:]).clone()
    k[rows] = key_buffer[slots].to(k.dtype)
    v[rows] = value_buffer[slots].to(v.dtype)
    COUNTERS.substituted_layers += 1
    return k, v


def _model_forward(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    forward_batch = args[0] if args else kwargs["forward_batch"]
    cone = getattr(forward_batch, FORWARD_ATTR, None)
    if cone is None:
        return wrapped(*args, **kwargs)
    LIVE.active = cone
    try:
        return wrapped(*args, **kwargs)
    finally:
        LIVE.active = None


def _attention_forward(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    cone = LIVE.active
    if cone is None or instance.is_cross_attention:
        return wrapped(*args, **kwargs)
    q = args[0] if args else kwargs["q"]
    k = args[1] if len(args) > 1 else kwargs["k"]
    v = args[2] if len(args) > 2 else kwargs["v"]
    if k is None or "k_rope" in kwargs:  # KV-shared layer, or MLA (refused at cache build)
        return wrapped(*args, **kwargs)
    k, v = substitute_full_kv(instance, k, v, cone)
    forward_batch = args[3] if len(args) > 3 else kwargs["forward_batch"]
    rest = {key: val for key, val in kwargs.items() if key not in ("q", "k", "v", "forward_batch")}
    return wrapped(q, k, v, forward_batch, *args[4:], **rest)


def _can_run_graph(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    if LIVE.active is not None:
        return False  # a graph would replay attention without the substitution
    return wrapped(*args, **kwargs)
