"""Reference attention for the ``sgl_kernel`` stand-in: plain torch, one request at a time.

Kept free of import side effects so tests can load it on its own and check it against SDPA.
"""

from __future__ import annotations

import torch


def attend(q, k, v, q_pos, k_pos, sm_scale, logit_cap, window, sinks, causal):
    """Reference attention of one request. ``q [Lq,H,D]``, ``k [Lk,Hkv,D]``, ``v [Lk,Hkv,Dv]``.

    ``window`` is the kernel's ``sliding_window_size + 1`` (0: none): a key is visible when
    ``k_pos > q_pos - window``. ``sinks [H]`` adds one logit per head to the softmax denominator.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    visible = torch.ones(scores.shape[1:], dtype=torch.bool)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window and window > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(heads, 1, 1).expand(heads, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs)  # a query with no visible key (cannot happen causally) reads zeros
    return torch.einsum("hqk,khd->qhd", probs, v.float())


def _first_visible(first_query: int, window: int) -> int:
    # Keys before this position are outside every query's window: not read (their SWA slots may be freed).
    return max(0, first_query - window + 1) if window and window > 0 else 0


def extend_attention_cpu(q, k_extend, v_extend, o, k_buffer, v_buffer, key_scale, value_scale, req_to_token,
                         req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_extend_len, sm_scale,
                         logit_cap, is_cross_attention, sliding_window_size, encoder_lens=None, sinks=None,
                         tree_mask=None, is_causal=True):
    if tree_mask is not None:
        raise NotImplementedError("sgl_kernel stand-in: extend_attention_cpu with tree_mask (speculative decoding)")
    if is_cross_attention:
        raise NotImplementedError("sgl_kernel stand-in: cross attention")
    for b in range(seq_lens.shape[0]):
        total, new, start = int(seq_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
        prefix = total - new
        first = _first_visible(prefix, sliding_window_size) if is_causal else 0
        locs = req_to_token[int(req_pool_indices[b]), first:total].long()
        keys = k_buffer[locs].float() * key_scale
        values = v_buffer[locs].float() * value_scale
        if k_extend is not None and v_extend is not None:  # the new tokens' K/V, as the kernel reads them
            keys[prefix - first :] = k_extend[start : start + new].float()
            values[prefix - first :] = v_extend[start : start + new].float()
        out = attend(q[start : start + new], keys, values, torch.arange(prefix, total), torch.arange(first, total),
                     sm_scale, logit_cap, sliding_window_size, sinks, is_causal)
        o[start : start + new] = out.to(o.dtype)


def decode_attention_cpu(q, k_buffer, v_buffer, key_scale, value_scale, o, k, v, cache_loc, attn_logits,
                         req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attention,
                         sliding_window_size, encoder_lens=None, sinks=None):
    if is_cross_attention:
        raise NotImplementedError("sgl_kernel stand-in: cross attention")
    if k is not None and v is not None:  # the real kernel stores the new token's K/V itself
        k_buffer[cache_loc.long()] = k.to(k_buffer.dtype)
        v_buffer[cache_loc.long()] = v.to(v_buffer.dtype)
    for b in range(seq_lens.shape[0]):
        total = int(seq_lens[b])
        first = _first_visible(total - 1, sliding_window_size)
        locs = req_to_token[int(req_pool_indices[b]), first:total].long()
        keys = k_buffer[locs].float() * key_scale
        values = v_buffer[locs].float() * value_scale
        out = attend(q[b : b + 1], keys, values, torch.tensor([total - 1]), torch.arange(first, total), sm_scale,
                     logit_cap, sliding_window_size, sinks, True)
        o[b : b + 1] = out.to(o.dtype)
