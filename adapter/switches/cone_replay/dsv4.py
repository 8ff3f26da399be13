"""Cone replay on DeepSeek-V4 pools (``DeepSeekV4TokenToKVPool`` + ``DeepseekV4AttnBackend``).

What the DSV4 forward does with a replay batch (read from SGLang 0.5.23):

* Every layer stores its main SWA KV, then reads it back from the cache (``_forward_attention``:
  ``store_cache`` then the paged reads), so the replay rows ``[s, F)`` write and read their own,
  recomputed SWA KV. That is the replay: nothing to mask there (their slots are fresh pages of
  the request, not the tree's).
* The compressors (C4 / C128 latents, the C4 indexer keys) and their state rings write through
  ``DeepseekV4AttnBackend._compressor_out_loc``, which sends every row outside
  ``ForwardBatch.encoder_swa_compress_rows`` to slot 0. :func:`forward_fields` keeps only the rows
  that must write: everything except the cone's ``[s, F - R)``, ``R = align_up(W, page) + page``
  (:func:`geometry.dsv4_republished_rows`), whose compressed entries were copied from F's
  resident pages and must stay as they are. The last ``R`` rows before F write their compressed
  groups, index keys and C4 state rings (paired with the SWA pages the first checkpoint
  re-publishes), exact by the bound (:func:`geometry.cone_bound_dsv4`).
* Window floor: none is set. ``encoder_swa_row_floor`` has no effect on the paged pool's main
  window (only the request-window branch of ``make_core_attn_metadata`` and the decoder-replay
  tail read it; the main prefill caller passes no ``swa_replay_start`` and the sparse prefill
  gather has no floor), and the bound does not need one: replay rows near s read the evicted
  positions below s as the SWA padding slot, which changes rows inside the cone only.

* DeepSeek-V4.1's ratio-1/2 KV-source layers write their latents (``c1_out_loc`` / ``c2_out_loc``,
  built from the same masked ``out_cache_loc``) and fp4 index keys through the same slot-0 rule,
  and read every row's latents from the request's pages (``_snapshot_low_ratio_k_slots``), so the
  copied bytes of ``[s, F - R)`` stay what the rows >= F read. The layers that read a source
  layer's KV own none: their window is their SWA KV only.
* Decoder SWA bounded replay (``--enable-decoder-swa-bounded-replay``, which SGLang turns on for
  V4.1 on CUDA/HIP): the last KV-source layer first compresses every row of the extend
  (``DeepseekV4AttnBackend.write_tail_source_kv``, through the same masked write locations), then
  it and every later layer run on the extend's last W rows only, each row floored at
  ``seq_len - W`` (``late_layer_tail_layout``): those rows read no late layer's window below the
  tail. Window information crosses rows only in the layers before the tail, so the bound counts
  the layers up to the last KV source (:func:`geometry.cone_bound_dsv4`'s ``tail_from``; the V4.1
  kit: 768 instead of 1,024), and the mask keeps the compressed rows the tail reads. A request
  asking for prompt logprobs runs its whole extend through the late layers
  (``late_layer_whole_extend``), reading their window below the extend; that path is upstream's and
  is not what the exactness tests compare.

Shown exact on CPU (the kit servers: real pool, backend and tree, the kits' torch stand-ins for the
CUDA kernels): for the V4 layout with C0/C4/C128 layers (``tests/engine/test_cone_replay_dsv4_server.py``)
and with V4.1's ratio-1/2 KV-source layers (``tests/engine/test_cone_replay_v41_server.py``), every
row >= F leaves bit for bit the SWA KV and compressed pages (latents, index keys) of a stock prefix
hit at F and gets the same logprobs; a later session resuming one page below F too; without the
mask they differ. Beside decoder bounded replay (``tests/engine/test_cone_replay_v41_decoder_server.py``),
every row the tail path writes (the early layers' SWA KV and the compressed pages from F, the late
layers' last W rows) and the output tokens' logits and logprobs equal a stock hit's under the same
flags; one page below the bound and without the mask they differ. GPU kernels: not verified.

What is refused at cache build (one line each, :func:`.decision.decide`): the unified KV ring (HIP), the
request window of ``--enable-encoder-swa-bounded-replay`` (the tree then keeps no SWA component:
refused earlier, see the switch's cache check; with a paged draft SWA it still does not gate the
match), a KV layout other than V4 (V4.1's 528-byte fp8, fp4, TRT-LLM uniform fp8: SGLang picks
them on SM100 / gfx950 only), unless the test-only ``DSV41_SWA_CONE_FORWARD_STANDIN=1`` says act
anyway; and (the switch's cache check) decoder bounded replay on a pool without KV-source layers
(:data:`.decision.NO_TAIL_LAYER`).
"""

from __future__ import annotations

from typing import Any

from adapter.switches.cone_replay.geometry import dsv4_republished_rows


def forward_fields(rows: list[tuple[int, int, Any]], window: int, page: int) -> Any:
    """DeepSeek-V4's forward field for one extend batch: ``encoder_swa_compress_rows``. ``rows``:
    per request ``(prefix_len, extend_len, plan or None)`` in batch order. A cone's rows
    ``[s, F - R)`` are left out (their compressor and indexer writes go to slot 0: the copied
    latents stay). No window floor is built (see the module docstring)."""
    import torch

    keep = []
    for prefix, extend, plan in rows:
        if plan is None:
            keep.append(torch.ones(extend, dtype=torch.bool))
            continue
        pos = torch.arange(prefix, prefix + extend, dtype=torch.int64)
        lo, hi = plan.s, plan.F - dsv4_republished_rows(window, page)
        keep.append(~((pos >= lo) & (pos < hi)))
    mask = torch.cat(keep) if keep else torch.zeros(0, dtype=torch.bool)
    return torch.nonzero(mask).flatten()


def apply(forward_batch: Any, layout: list[tuple[int, int, Any]], window: int, page: int) -> int:
    """Set ``encoder_swa_compress_rows`` on a replay batch; returns the number of masked rows."""
    keep = forward_fields(layout, window, page)
    device = forward_batch.out_cache_loc.device
    total = int(forward_batch.out_cache_loc.shape[0])
    forward_batch.encoder_swa_compress_rows = keep.to(device)
    return total - int(keep.numel())
