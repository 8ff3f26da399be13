"""On every retraction (``release_req`` of a request that is not finished), before the row is
released, one line on stderr with what the tree holds of the row's committed tokens, read from the
Python tree core's nodes (not through ``match_prefix``, whose answer KV parking uses)::

    [kit_seam] park_probe rid=.. prompt=.. committed=.. full_device=.. full_held=..

``full_device``: the tokens from the start whose Full KV the tree holds on the device;
``full_held``: on the device or on HiCache's host tier (a node with a host copy). Both this wrapper
and KV parking's run before the stock ``release_req`` frees anything, so in either order this
reads the tree KV parking read; the two lines of one retraction sit next to each other in the log.
"""

import sys

import wrapt


def _held(core, tokens):
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    node, depth, device, held, on_device = core.root_node, 0, 0, 0, True
    while depth < len(tokens):
        child = next((c for c in node.children.values()
                      if len(c.key) and int(c.key.token_ids[0]) == int(tokens[depth])), None)
        if child is None:
            break
        run = 0
        for a, b in zip(child.key.token_ids, tokens[depth:]):
            if int(a) != int(b):
                break
            run += 1
        full = child.component_data[ComponentType.FULL]
        if full.value is None and full.host_value is None:
            break
        on_device = on_device and full.value is not None
        depth += run
        held = depth
        device = depth if on_device else device
        if run < len(child.key):
            break
        node = child
    return device, held


def _python_core(tree):
    """The tree's Python core, or None (the Rust core's adapter raises NotImplementedError on ``root_node``)."""
    core = getattr(tree, "tree_core", None)
    try:
        return core if core is not None and core.root_node is not None else None
    except (AttributeError, NotImplementedError):
        return None


def _probe(wrapped, instance, args, kwargs):
    req, core = kwargs.get("req"), _python_core(kwargs.get("tree_cache"))
    if req is not None and core is not None and not req.finished() and req.kv.holds_kv:
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[: int(req.kv.kv_committed_len)]
        device, held = _held(core, tokens)
        print(f"[kit_seam] park_probe rid={req.rid} prompt={len(req.origin_input_ids)} committed={len(tokens)} "
              f"full_device={device} full_held={held}", file=sys.stderr, flush=True)
    return wrapped(*args, **kwargs)


def _plant(module):
    batch = sys.modules["sglang.srt.managers.schedule_batch"]
    wrapt.wrap_function_wrapper(batch, "release_req", _probe)


wrapt.register_post_import_hook(_plant, "sglang.srt.managers.scheduler")
