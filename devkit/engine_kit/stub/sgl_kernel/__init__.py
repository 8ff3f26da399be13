"""Pure-torch stand-in for the CPU build of ``sgl_kernel`` (tests and the gate only, never production).

SGLang 0.5.23's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports the CPU build of ``sgl_kernel``,
which no package registry offers; the PyPI ``sglang-kernel`` is the CUDA build. The launcher in
``devkit.engine_kit.launcher`` puts the folder holding this package on ``PYTHONPATH`` of the
server it starts, and nowhere else.

What is here, and why only this:
* ``assign_req_to_token_pool_cpu``: called on every prefill and decode allocation.
* ``extend_attention_cpu`` / ``decode_attention_cpu`` on ``torch.ops.sgl_kernel``: reference
  attention (GQA, causal, sliding window, logit cap, attention sinks) for SGLang's own CPU backend,
  checked against ``torch.nn.functional.scaled_dot_product_attention`` in tests.
* ``sgl_kernel.kvcacheio`` (:mod:`sgl_kernel.kvcacheio`): the pure-torch host <-> device KV copies
  HiCache's host pools call (``--enable-hierarchical-cache``), bound into those pools by a route
  with the host-memory route beside it (:mod:`sgl_kernel._route`), each checked byte for byte in
  ``tests/upstream/test_hicache_host_io.py``.
* Names imported at module load on the CPU path but called only by speculative decoding: they
  import, and raise ``NotImplementedError`` naming the op when called.
* Any other name raises ``AttributeError`` (so ``from sgl_kernel import X`` fails by name).
  ``convert_weight_packed`` is deliberately absent: ``cpu_has_amx_support()`` stays False and every
  other layer (norms, MLP, MoE, rope, sampling) keeps SGLang's native-torch path.

The backend route (:mod:`sgl_kernel._route`): on a host without AMX SGLang rewrites ``intel_amx``
to ``torch_native``, and ``torch_native`` reads sliding-window K/V with full-pool indices, which
crashes once the SWA pool is smaller than the full pool. Importing this package therefore makes
the backend name ``torch_native`` build SGLang's ``IntelAMXAttnBackend``, the CPU backend that
translates full-pool indices to SWA-pool indices, running on the reference ops below.
"""

from __future__ import annotations

import torch

from sgl_kernel import _route
from sgl_kernel._reference import decode_attention_cpu, extend_attention_cpu

__version__ = "0.0.0+dsv41.torchstandin"

# Imported at load time by SGLang modules on the CPU path, called only by speculative decoding.
IMPORT_ONLY = frozenset(
    {
        "copy_all_layer_kv_cache_cpu",
        "fill_bonus_tokens_cpu",
        "fill_accept_out_cache_loc_cpu",
        "assign_extend_cache_locs_cpu",
        "assign_draft_cache_locs_contiguous_cpu",
        "verify_tree_greedy_cpu",
        "build_tree_kernel_efficient_cpu",
        "rotate_input_ids_cpu",
        "build_draft_decode_metadata_cpu",
    }
)


def _not_implemented(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: op {name!r} is not implemented (speculative decoding only)")

    op.__name__ = name
    return op


def __getattr__(name: str):
    if name in IMPORT_ONLY:
        return _not_implemented(name)
    raise AttributeError(f"sgl_kernel stand-in: op {name!r} is not implemented")


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Row ``r_i`` of ``req_to_token`` gets ``out_cache_loc``'s next ``end_i - start_i`` slots at ``start_i``."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
            offset += n


# SGLang's CPU backend looks these up as torch.ops.sgl_kernel.<name>.
torch.ops.sgl_kernel.extend_attention_cpu = extend_attention_cpu
torch.ops.sgl_kernel.decode_attention_cpu = decode_attention_cpu

_route.install()
