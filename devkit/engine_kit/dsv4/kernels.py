"""Pure-torch stand-ins for the CUDA/JIT kernels on SGLang 0.5.23's DeepSeek-V4 forward (devkit only).

Each function has the signature of the SGLang function it stands in for (``kernels/ops/...``) and
the math of the ``.cuh`` source that function launches; :mod:`.routes` binds them in the kit's
server only. They are plain torch functions, so tests call them directly and compare them by value
with independent references (SGLang's own torch / Triton-twin formulas, transformers' DeepSeek-V4
modules, :mod:`devkit.reference.dsv4_decode`).

Formulas, by source (paths under ``sglang/kernels/jit/csrc/deepseek_v4/``):

* plans (``c_plan.cuh``): one compress row per position ``p`` with ``(p + 1) % ratio == 0``
  (``buffer_len`` = window rows not in this extend), one write row per position the next batch
  still needs (``p >= first_w_pos``, and for C4 the last ``ratio`` rows of every SWA page). State
  slots: C4 ``swa_page * ring + swa_loc % ring`` (rings addressed by SWA page); C128 (and a
  request ring) ``rid * ring + p % ring``.
* C4 (``c4_v2.cuh``): 8 rows, overlap half ``[p-7, p-4]`` (kv ``[0:d]``, score ``[2d:3d]``) and
  own half ``[p-3, p]`` (kv ``[d:2d]``, score ``[3d:4d]``), score + APE, softmax over the 8 per
  channel, weighted kv. The first window has no overlap half (kv 0, score -FLT_MAX).
* C128 (``c128_v2.cuh``): 128 rows (kv ``[0:d]``, score ``[d:2d]``), score + APE, softmax.
  Decode writes the token's row to the state first, then compresses when the window closes.
* store (``fused_norm_rope_v2.cuh``): RMSNorm x weight in fp32, RoPE on the last 64 dims
  (interleaved (re, im) pairs), then the 584-byte V4 row (448 e4m3 nope from bf16-rounded values in
  7 groups of 64 with UE8M0 power-of-two scales, 64 bf16 rope) or, for the 128-dim indexer,
  a 128-point Hadamard / sqrt(128) and a 132-byte row (128 e4m3, one fp32 scale amax / 448).
* main K (``main_norm_rope.cuh`` ``fused_k_norm_rope_flashmla``): as the V4 store, quantised from
  fp32 (no bf16 rounding); Q: RMSNorm without weight, rounded to the dtype, RoPE in fp32.
* indexer Q (``fused_q_indexer_rope_hadamard_quant``): RoPE, Hadamard, e4m3 with fp32 scale
  amax / 448; the head weight out is ``weight * weight_scale * scale``.
* ``silu_and_mul_clamp``: ``silu(min(g, lim)) * clamp(u, -lim, lim)``.

fp8 on torch CPU: ``float8_e4m3fn`` casts round to nearest even and saturate; ``abs``/``amax``
need an upcast first (done here).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
NOPE, ROPE, DIM = 448, 64, 512
GROUP = 64
V4_DATA, V4_SCALE, V4_ROW = 576, 8, 584
INDEXER_DIM, INDEXER_ROW = 128, 132


# ----------------------------------------------------------------------------- small pieces


def v4_page_bytes(page_size: int) -> int:
    """Bytes of one V4 page: ``ceil(584 * page_size / 576) * 576``."""
    return -(-V4_ROW * page_size // V4_DATA) * V4_DATA


def ue8m0_exponent(value: torch.Tensor) -> torch.Tensor:
    """``cast_to_ue8m0``: the biased exponent of the smallest power of two >= ``value`` (> 0), bit-exact."""
    bits = value.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``pack_fp8``: clamp to +-448, then round to nearest even e4m3."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim."""
    x = x.float()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.float()


def freqs_at(freqs_cis: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[N, 64]`` fp32 (cos, sin) interleaved rows of a complex ``[max_pos, 32]`` (or real ``[max_pos, 64]``) table."""
    table = torch.view_as_real(freqs_cis).flatten(-2) if freqs_cis.is_complex() else freqs_cis
    return table.float()[positions.long()]


def rope_pairs(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved (re, im) pairs of the fp32 ``x [..., 2k]`` by ``freqs [N, 2k]`` (N = x.shape[0])."""
    shape = x.shape
    xr, xi = x.float().reshape(*shape[:-1], -1, 2).unbind(-1)
    f = freqs.reshape(freqs.shape[0], *([1] * (x.dim() - 2)), -1, 2)
    cos, sin = f[..., 0], f[..., 1]
    if inverse:
        sin = -sin
    return torch.stack([xr * cos - xi * sin, xr * sin + xi * cos], -1).reshape(shape)


_HADAMARD: dict[int, torch.Tensor] = {}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Sylvester (natural order) Walsh-Hadamard over the last dim, scaled by ``1/sqrt(n)``, in fp32."""
    n = x.shape[-1]
    if n not in _HADAMARD:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[n] = h / math.sqrt(n)
    return x.float() @ _HADAMARD[n]


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as one flat uint8 tensor (shares storage)."""
    flat = cache.view(torch.uint8)
    if not flat.is_contiguous():
        raise ValueError(f"the cache must be contiguous, got strides {cache.stride()}")
    return flat.reshape(-1)


def quantize_v4_rows(nope: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nope fp32 [N, 448], rope fp32 [N, 64])`` -> (data ``[N, 576]``, scales ``[N, 7]``) uint8 V4 bytes."""
    n = nope.shape[0]
    groups = nope.float().reshape(n, NOPE // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp_min(1e-4)
    exponent = ue8m0_exponent(amax / FP8_MAX)
    inv = torch.pow(2.0, (127 - exponent).float()).unsqueeze(-1)
    fp8 = to_e4m3(groups * inv).reshape(n, NOPE)
    data = torch.empty(n, V4_DATA, dtype=torch.uint8)
    data[:, :NOPE] = fp8.view(torch.uint8)
    data[:, NOPE:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return data, exponent.to(torch.uint8)


def write_v4_rows(cache: torch.Tensor, loc: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                  page_size: int) -> None:
    """Scatter V4 rows into a paged cache at token slots ``loc`` (``[page][ps x 576 data][ps x 8 scale]``)."""
    flat = _flat(cache)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    base = page * v4_page_bytes(page_size)
    data_at = (base + slot * V4_DATA).unsqueeze(-1) + torch.arange(V4_DATA)
    scale_at = (base + page_size * V4_DATA + slot * V4_SCALE).unsqueeze(-1) + torch.arange(scales.shape[-1])
    flat[data_at.reshape(-1)] = data.reshape(-1)
    flat[scale_at.reshape(-1)] = scales.reshape(-1)


def read_v4_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantise V4 rows at token slots ``loc`` -> fp32 ``[N, 512]`` (nope x 2^(e-127) | rope)."""
    flat = _flat(cache)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    base = page * v4_page_bytes(page_size)
    data = flat[(base + slot * V4_DATA).unsqueeze(-1) + torch.arange(V4_DATA)]
    scale = flat[(base + page_size * V4_DATA + slot * V4_SCALE).unsqueeze(-1) + torch.arange(NOPE // GROUP)]
    nope = data[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, NOPE // GROUP, GROUP)
    nope = nope * torch.pow(2.0, scale.float() - 127.0).unsqueeze(-1)
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(-1, NOPE), rope], -1)


def quantize_indexer_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, 128]`` -> (e4m3 ``[N, 128]``, fp32 scale ``[N]`` = max(1e-4, amax) / 448)."""
    scale = x.float().abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    return to_e4m3(x.float() * (1.0 / scale).unsqueeze(-1)), scale


def write_indexer_rows(cache: torch.Tensor, loc: torch.Tensor, fp8: torch.Tensor, scale: torch.Tensor,
                       page_size: int) -> None:
    """Scatter indexer rows: ``[page][ps x 128 e4m3][ps x 4 fp32 scale]``, 132 x ps bytes a page."""
    flat = _flat(cache)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    base = page * INDEXER_ROW * page_size
    value_at = (base + slot * INDEXER_DIM).unsqueeze(-1) + torch.arange(INDEXER_DIM)
    scale_at = (base + INDEXER_DIM * page_size + slot * 4).unsqueeze(-1) + torch.arange(4)
    flat[value_at.reshape(-1)] = fp8.contiguous().view(torch.uint8).reshape(-1)
    flat[scale_at.reshape(-1)] = scale.float().contiguous().view(torch.uint8).reshape(-1)


def read_indexer_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantised indexer rows at ``loc`` -> fp32 ``[N, 128]``."""
    flat = _flat(cache)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    base = page * INDEXER_ROW * page_size
    values = flat[(base + slot * INDEXER_DIM).unsqueeze(-1) + torch.arange(INDEXER_DIM)]
    scale = flat[(base + INDEXER_DIM * page_size + slot * 4).unsqueeze(-1) + torch.arange(4)]
    return values.contiguous().view(torch.float8_e4m3fn).float() * scale.contiguous().view(torch.float32)


# ----------------------------------------------------------------------------- compressor plans

_INVALID_U32 = -1  # 0xFFFFFFFF as int32


def _compute_loc(swa_loc: torch.Tensor, swa_page_size: int, ring_size: int) -> torch.Tensor:
    return (swa_loc // swa_page_size) * ring_size + swa_loc % ring_size


def _state_loc(ratio, rid, position, r2t, f2s, swa_page_size, ring_size, use_req_ring) -> torch.Tensor:
    if ratio == 128 or use_req_ring:
        return rid * ring_size + position % ring_size
    raw = r2t[rid, position].long()
    return _compute_loc(f2s[raw].long(), swa_page_size, ring_size)


def plan_compress_prefill(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                          swa_page_size, ring_size, num_q_tokens, use_cuda_graph=False, use_req_ring=False):
    """``CompressorPrefillPlan.generate``: (plan_c ``[n_c, 16]``, plan_w ``[n_w, 8]``) uint8, as c_plan.cuh."""
    ratio = int(compress_ratio)
    assert ratio in (4, 128) and not (use_req_ring and ratio != 4)
    assert swa_page_size % ring_size == 0 and ring_size % ratio == 0
    overlap = ratio == 4
    window = ratio * (2 if overlap else 1)
    mtp_pad = ring_size - window + 2 if ring_size > window else 0
    seq = [int(v) for v in seq_lens.tolist()]
    ext = [int(v) for v in extend_lens.tolist()]
    rids = req_pool_indices.long().cpu()
    r2t, f2s = req_to_token.cpu(), full_to_state.cpu()
    c_rows, w_rows = [], []
    counter = 0
    for b, (sl, el) in enumerate(zip(seq, ext)):
        assert 0 < el <= sl
        pl = sl - el
        last_c = sl // ratio * ratio
        first_w = min(last_c - (ratio if overlap else 0), sl - mtp_pad)
        j = torch.arange(el)
        pos = pl + j
        ragged = counter + j
        rid = rids[b]
        comp = (pos + 1) % ratio == 0
        if comp.any():
            jc, pc, rc = j[comp], pos[comp], ragged[comp]
            buffer_len = window - torch.clamp(jc + 1, max=window)
            p1 = pc
            p0 = torch.clamp(p1 - ratio, min=0)
            rp0 = _state_loc(ratio, rid, p0, r2t, f2s, swa_page_size, ring_size, use_req_ring) // ratio
            rp1 = _state_loc(ratio, rid, p1, r2t, f2s, swa_page_size, ring_size, use_req_ring) // ratio
            has_buffer = buffer_len > 0
            rp0 = torch.where(has_buffer, rp0, torch.full_like(rp0, -1))
            rp1 = torch.where(has_buffer, rp1, torch.full_like(rp1, b))
            c_rows.append(torch.stack([pc + 1, rc | (buffer_len << 16), rp0, rp1], 1))
        write = pos >= first_w
        if overlap and not use_req_ring:
            write = write | (pos % swa_page_size >= swa_page_size - ratio)
        if write.any():
            pw, rw = pos[write], ragged[write]
            loc = _state_loc(ratio, rid, pw, r2t, f2s, swa_page_size, ring_size, use_req_ring)
            w_rows.append(torch.stack([rw, loc], 1))
        counter += el
    assert counter == int(num_q_tokens), (counter, num_q_tokens)
    plan_c = torch.cat(c_rows) if c_rows else torch.empty(0, 4, dtype=torch.int64)
    plan_w = torch.cat(w_rows) if w_rows else torch.empty(0, 2, dtype=torch.int64)
    if use_cuda_graph:
        pad_c = torch.tensor([[_INVALID_U32, 0, -1, -1]]).expand(int(num_q_tokens) - plan_c.shape[0], 4)
        pad_w = torch.tensor([[_INVALID_U32, -1]]).expand(int(num_q_tokens) - plan_w.shape[0], 2)
        plan_c, plan_w = torch.cat([plan_c, pad_c]), torch.cat([plan_w, pad_w])
    device = req_to_token.device
    return (plan_c.to(torch.int32).contiguous().view(torch.uint8).to(device),
            plan_w.to(torch.int32).contiguous().view(torch.uint8).to(device))


def plan_compress_decode(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens,
                         swa_page_size, ring_size, use_req_ring=False):
    """``CompressorDecodePlan.generate``: plan_d ``[bs, 16]`` uint8 (seq_len, write_loc, read pages)."""
    ratio = int(compress_ratio)
    rid = req_pool_indices.long()
    seq = seq_lens.long()
    p1 = seq - 1
    p0 = torch.clamp(p1 - ratio, min=0)
    args = (req_to_token, full_to_state, swa_page_size, ring_size, use_req_ring)
    write_loc = _state_loc(ratio, rid, p1, *args)
    rp0 = _state_loc(ratio, rid, p0, *args) // ratio
    rp1 = write_loc // ratio
    plan = torch.stack([seq, write_loc, rp0, rp1], 1).to(torch.int32)
    return plan.contiguous().view(torch.uint8)


def _plan_fields(plan_tensor: torch.Tensor) -> torch.Tensor:
    return plan_tensor.contiguous().view(torch.int32).long()


# ----------------------------------------------------------------------------- compressor math


def _pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Softmax of ``score + ape`` over the window dim (1) per channel, weighted sum of ``kv``: fp32."""
    weights = torch.softmax(score.float() + ape.float().unsqueeze(0), dim=1)
    return (kv.float() * weights).sum(1)


def compress_forward(kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio, out=None,
                     is_online=False):
    """``compress_forward``: C4 / C128 state-ring pooling (prefill plans or decode plans); returns ``out``."""
    assert not is_online, "the online C128 compressor is not stood in for"
    ratio, d = int(compress_ratio), int(head_dim)
    assert plan.compress_ratio == ratio
    window = 8 if ratio == 4 else 128
    element = kv_score_input.shape[-1]
    assert element == (4 if ratio == 4 else 2) * d
    in_dtype = kv_score_input.dtype
    buf = kv_score_buffer.reshape(-1, element)
    ape = ape.to(in_dtype).reshape(window, d)
    if out is None:
        out = kv_score_input.new_zeros((plan[1].shape[0], d))
    fields = _plan_fields(plan[1])
    if plan.is_decode:
        seq, write_loc, rp0, rp1 = fields.unbind(1)
        buf[write_loc] = kv_score_input.to(buf.dtype)  # the token joins its ring first
        rows = (seq % 4 == 0) if ratio == 4 else (write_loc % 128 == 127)
        idx = torch.nonzero(rows).flatten()
        if idx.numel():
            buffer_len = torch.full_like(idx, window)
            out[idx] = _compress_rows(buf, None, idx, seq[idx], buffer_len, rp0[idx], rp1[idx], ape, ratio, d,
                                      in_dtype).to(out.dtype)
        return out
    seq = fields[:, 0]
    ragged = fields[:, 1] & 0xFFFF
    buffer_len = (fields[:, 1] >> 16) & 0xFFFF
    rp0, rp1 = fields[:, 2], fields[:, 3]
    valid = torch.nonzero(seq != _INVALID_U32).flatten()
    if valid.numel():
        out[valid] = _compress_rows(buf, kv_score_input, ragged[valid], seq[valid], buffer_len[valid], rp0[valid],
                                    rp1[valid], ape, ratio, d, in_dtype).to(out.dtype)
    w = _plan_fields(plan[2])
    w = w[w[:, 0] != _INVALID_U32]
    if w.numel():  # writes after the compress rows (the kernel launches them second)
        buf[w[:, 1]] = kv_score_input[w[:, 0]].to(buf.dtype)
    return out


def _compress_rows(buf, ragged_input, ragged, seq, buffer_len, rp0, rp1, ape, ratio, d, in_dtype):
    """The window rows of each compress row, from the state ring (``i < buffer_len``) or the ragged input."""
    window = 8 if ratio == 4 else 128
    n = ragged.shape[0]
    i = torch.arange(window if ratio == 128 else 4)
    if ratio == 128:
        from_buffer = i.unsqueeze(0) < buffer_len.unsqueeze(1)
        rows = _rows(buf, ragged_input, from_buffer, rp1.unsqueeze(1) * 128 + i, ragged.unsqueeze(1) - 127 + i,
                     in_dtype)
        return _pool(rows[..., :d], rows[..., d:], ape)
    overlap_ok = (seq > 4).view(n, 1, 1)
    first = _rows(buf, ragged_input, i.unsqueeze(0) < buffer_len.unsqueeze(1), rp0.unsqueeze(1) * 4 + i,
                  ragged.unsqueeze(1) - 7 + i, in_dtype)
    second = _rows(buf, ragged_input, (i + 4).unsqueeze(0) < buffer_len.unsqueeze(1), rp1.unsqueeze(1) * 4 + i,
                   ragged.unsqueeze(1) - 3 + i, in_dtype)
    kv0 = torch.where(overlap_ok, first[..., 0:d], torch.zeros_like(first[..., 0:d]))
    score0 = torch.where(overlap_ok, first[..., 2 * d:3 * d], torch.full_like(first[..., 0:d], -FLT_MAX))
    kv = torch.cat([kv0, second[..., d:2 * d]], 1)
    score = torch.cat([score0, second[..., 3 * d:4 * d]], 1)
    return _pool(kv, score, ape)


def _rows(buf, ragged_input, from_buffer, buffer_slot, ragged_row, in_dtype):
    """``[n, w, element]`` rows in the input dtype: state ring slot where ``from_buffer``, else the ragged row."""
    out = torch.empty(*from_buffer.shape, buf.shape[-1], dtype=in_dtype)
    take = from_buffer
    out[take] = buf[buffer_slot[take]].to(in_dtype)
    if (~take).any():
        assert ragged_input is not None, "a decode compression reads the whole window from the state ring"
        out[~take] = ragged_input[ragged_row[~take]]
    return out


def _store_rows(plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row index into kv, position = seq_len - ratio, out_loc index) of the rows a store writes."""
    fields = _plan_fields(plan[1])
    seq = fields[:, 0]
    if plan.is_decode:
        rows = torch.nonzero(seq % plan.compress_ratio == 0).flatten()
        return rows, seq[rows] - plan.compress_ratio, rows
    rows = torch.nonzero(seq != _INVALID_U32).flatten()
    return rows, seq[rows] - plan.compress_ratio, fields[rows, 1] & 0xFFFF


def compress_norm_rope_store(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size,
                             use_fp4=False, bf16_store=False, kvcache_scale=None, rope_cache=None,
                             fp4_k_write_metadata=None, layout="v4", fp8_2buff=False, kvcache_rope=None):
    """``compress_norm_rope_store``: norm + RoPE + store of each compressed row (V4 or indexer page layout)."""
    if use_fp4 or bf16_store or fp8_2buff:
        raise NotImplementedError("the DSV4 kit stores the V4 fp8 and indexer fp8 layouts only")
    if str(getattr(layout, "value", layout)).lower() not in ("v4",):
        raise NotImplementedError(f"the DSV4 kit stores the V4 layout only, got {layout!r}")
    rows, positions, loc_index = _store_rows(plan)
    if rows.numel() == 0:
        return
    x = rms_norm(kv[rows], norm_eps, norm_weight.to(kv.dtype))
    loc = out_loc[loc_index]
    freqs = freqs_at(freq_cis, positions)
    d = kv.shape[-1]
    if d == INDEXER_DIM:
        x = torch.cat([x[:, :-ROPE], rope_pairs(x[:, -ROPE:], freqs)], -1)
        fp8, scale = quantize_indexer_rows(hadamard(x))
        write_indexer_rows(kvcache, loc, fp8, scale, page_size)
        return
    assert d == DIM, d
    nope = x[:, :NOPE].to(torch.bfloat16).float()  # bf16 round trip, as the unfused path
    data, scales = quantize_v4_rows(nope, rope_pairs(x[:, NOPE:], freqs))
    write_v4_rows(kvcache, loc, data, scales, page_size)


# ----------------------------------------------------------------------------- main attention norm / rope


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False):
    """RoPE on the last dim (interleaved pairs) of ``q`` (and ``k``), in place."""
    freqs = freqs_at(freqs_cis, positions)
    for x in (q, k):
        if x is not None:
            x.copy_(rope_pairs(x, freqs, inverse).to(x.dtype))


def fused_norm_rope_inplace(kv, weight, eps, freq_cis, positions):
    """RMSNorm x weight (rounded to the dtype), then RoPE on the last 64 dims, in place."""
    x = rms_norm(kv, eps, weight).to(kv.dtype).float()
    x[..., -ROPE:] = rope_pairs(x[..., -ROPE:], freqs_at(freq_cis, positions))
    kv.copy_(x.to(kv.dtype))


def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions):
    """Per-head RMSNorm without weight (``eps`` None: no norm), rounded to the dtype, RoPE on the last 64."""
    x = q_input if eps is None else rms_norm(q_input, eps).to(q_input.dtype)
    x = x.float()
    x[..., -ROPE:] = rope_pairs(x[..., -ROPE:], freqs_at(freqs_cis, positions))
    out = x.to(q_input.dtype)
    q_output.copy_(out if q_output.dtype != torch.float8_e4m3fn else out.float().clamp(-FP8_MAX, FP8_MAX))


def fused_q_indexer_rope_hadamard_quant(q_input, weight, weight_scale, freqs_cis, positions):
    """Indexer Q: RoPE on the last 64, Hadamard, e4m3 with an fp32 scale per (token, head)."""
    x = q_input.float().clone()
    x[..., -ROPE:] = rope_pairs(x[..., -ROPE:], freqs_at(freqs_cis, positions))
    x = hadamard(x)
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    q_fp8 = to_e4m3(x * (1.0 / scale))
    weights_out = weight.float().unsqueeze(-1) * float(weight_scale) * scale
    return q_fp8, weights_out


def fused_k_norm_rope_flashmla(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size,
                               layout="v4", q=None):
    """Main K: RMSNorm x weight + RoPE, stored as V4 rows at ``out_loc`` (rows with ``out_loc < 0`` skipped)."""
    if q is not None:
        raise NotImplementedError("the query RoPE fused into the K store is HIP only")
    if str(getattr(layout, "value", layout)).lower() != "v4":
        raise NotImplementedError(f"the DSV4 kit stores the V4 layout only, got {layout!r}")
    keep = torch.nonzero(out_loc >= 0).flatten()
    if keep.numel() == 0:
        return
    x = rms_norm(kv[keep], eps, kv_weight)
    data, scales = quantize_v4_rows(x[:, :NOPE], rope_pairs(x[:, NOPE:], freqs_at(freqs_cis, positions[keep])))
    write_v4_rows(kvcache, out_loc[keep], data, scales, page_size)


def fused_store_cache(input, cache, indices, *, page_size, type, layout="v4", freqs_cis=None):
    """Quantise normed, rotated rows into the paged cache (``type`` ``flashmla``: V4; ``indexer``: 132 B)."""
    if freqs_cis is not None or str(getattr(layout, "value", layout)).lower() != "v4":
        raise NotImplementedError("the DSV4 kit stores the V4 layout only")
    keep = torch.nonzero(indices >= 0).flatten()
    x = input[keep].float()
    if type == "indexer":
        fp8, scale = quantize_indexer_rows(x)
        write_indexer_rows(cache, indices[keep], fp8, scale, page_size)
        return
    data, scales = quantize_v4_rows(x[:, :NOPE], x[:, NOPE:])
    write_v4_rows(cache, indices[keep], data, scales, page_size)


def dequantize_k_cache_paged_dsv4(quant_k_cache, page_table_1_flattened, page_size, out=None, layout="v4"):
    """V4 rows of the listed token slots as bf16 ``[N, 1, 512]`` (slot < 0: zeros)."""
    if str(getattr(layout, "value", layout)).lower() != "v4":
        raise NotImplementedError("the DSV4 kit reads the V4 layout only")
    ids = page_table_1_flattened.long()
    rows = read_v4_rows(quant_k_cache, ids.clamp_min(0), page_size)
    rows = torch.where((ids >= 0).unsqueeze(-1), rows, torch.zeros_like(rows)).to(torch.bfloat16).unsqueeze(1)
    if out is None:
        return rows
    out.copy_(rows)
    return out


# ----------------------------------------------------------------------------- MoE, metadata


def silu_and_mul_clamp(input, output, swiglu_limit):
    """SwiGLU with DSV4's clamp: ``silu(min(g, lim)) * clamp(u, -lim, lim)`` (``input = [g | u]``)."""
    g, u = input.float().chunk(2, -1)
    limit = float(swiglu_limit)
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    output.copy_((torch.nn.functional.silu(g) * u).to(output.dtype))


def init_compression_metadata(seq_lens, positions, raw_out_loc, page_table=None, page_size=0,
                              compute_page_indices=True):
    """Torch twin of ``_init_compressed_attn_metadata_kernel`` (metadata_kernel.py)."""
    n_write = raw_out_loc.shape[0]
    seq = seq_lens.long()
    pos = positions.long()
    loc = raw_out_loc.long()
    out = []
    for ratio in (4, 128):
        s = seq[:n_write]
        out += [
            torch.where(s % ratio == 0, loc // ratio, torch.zeros_like(loc)).to(torch.int64),
            (pos & ~(ratio - 1)).to(torch.int32),
            (seq // ratio).to(torch.int32),
            torch.clamp(seq // ratio, min=1).to(torch.int32),
        ]
    c128_page_indices = None
    if compute_page_indices:
        assert page_table is not None and page_size >= 128 and page_size % 128 == 0
        c128_page = page_size // 128
        max_pages = page_table.shape[1]
        width = c128_page * max_pages
        offsets = torch.arange(width)
        pages = page_table.long()[:, offsets // c128_page]
        vals = pages * c128_page + offsets % c128_page
        vals = torch.where(offsets.unsqueeze(0) < (seq // 128).unsqueeze(1), vals, torch.full_like(vals, -1))
        c128_page_indices = vals.to(torch.int32)
    return (*out, c128_page_indices)


def fill_all_compressed_indices(page_table, compressed_seq_lens, page_indices, *, compress_ratio, page_size,
                                raw_indices=None):
    """Torch twin of ``_fill_all_compressed_indices_kernel``: every reachable compressed slot, -1 past the length."""
    topk = page_indices.shape[1]
    slots_per_page = page_size // compress_ratio
    positions = torch.arange(topk)
    valid = positions.unsqueeze(0) < compressed_seq_lens.long().unsqueeze(1)
    pages = page_table.long()[:, (positions // slots_per_page).clamp(max=page_table.shape[1] - 1)]
    slots = pages * slots_per_page + positions % slots_per_page
    page_indices.copy_(torch.where(valid, slots, torch.full_like(slots, -1)).to(page_indices.dtype))
    if raw_indices is not None:
        raw = torch.where(valid, positions.expand_as(valid), torch.full_like(slots, -1))
        raw_indices.copy_(raw.to(raw_indices.dtype))


# ----------------------------------------------------------------------------- sparse prefill index kernels


def build_swa_token_ids(seq_lens, extend_seq_lens, req_pool_indices, req_to_token, full_to_swa, swa_window,
                        total_swa):
    """Torch twin of ``build_swa_token_ids`` (sparse_prefill_kernels.py): each request's union of SWA
    windows, positions ``[seq_len - gather_len, seq_len)``, as SWA-cache token ids."""
    gather = torch.minimum(seq_lens, extend_seq_lens + (swa_window - 1)).to(torch.int32)
    first = (seq_lens - gather).to(torch.int32)
    offsets = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(gather, 0).to(torch.int32)
    ids = torch.empty(total_swa, dtype=torch.int32)
    for b in range(seq_lens.shape[0]):
        n = int(gather[b])
        pos = int(first[b]) + torch.arange(n)
        full = req_to_token[int(req_pool_indices[b]), pos].long()
        ids[int(offsets[b]):int(offsets[b]) + n] = full_to_swa[full].to(torch.int32)
    return ids, first, gather, offsets


def combine_topk_swa_indices(topk_indices, query_start_loc, query_pos, seq_lens, gather_lens, compressed_base,
                             swa_base, window_size, compress_ratio, topk, out_indices=None, out_lens=None,
                             swa_indices=None, swa_lengths=None):
    """Torch twin of ``combine_topk_swa_indices``: per token ``[top-k + compressed_base | window | -1]`` rows."""
    from sglang.kernels.ops.attention.dsv4.sparse_prefill_kernels import combined_topk_width

    n = topk_indices.shape[0]
    reqs = seq_lens.shape[0]
    width = combined_topk_width(topk, window_size)
    combined = torch.full((n, width), -1, dtype=torch.int32) if out_indices is None else out_indices
    lens = torch.zeros(n, dtype=torch.int32) if out_lens is None else out_lens
    if n == 0:
        return combined, lens
    token = torch.arange(n)
    starts = query_start_loc.long() - int(query_start_loc[0])
    batch = (torch.searchsorted(starts[:reqs].contiguous(), token, right=True) - 1).clamp(0, reqs - 1)
    owned = token < starts[reqs]
    pos = torch.where(owned, query_pos.long(), 0)
    seq, gather = seq_lens.long()[batch], gather_lens.long()[batch]
    cbase, sbase = compressed_base.long()[batch], swa_base.long()[batch]
    topk_len = torch.where(owned, torch.clamp((pos + 1) // compress_ratio, max=topk), 0)
    if swa_indices is not None:
        swa_len = torch.where(owned, swa_lengths.long(), 0)
    else:
        swa_len = torch.where(owned, torch.clamp(pos + 1, max=window_size), 0)
    offset = torch.arange(width).unsqueeze(0)
    in_topk = offset < topk_len.unsqueeze(1)
    in_swa = offset < (topk_len + swa_len).unsqueeze(1)
    k = topk_indices.shape[1]
    topk_vals = topk_indices.long()[:, :min(k, width)]
    topk_vals = torch.cat([topk_vals, torch.full((n, width - topk_vals.shape[1]), -1)], 1)
    topk_vals = torch.where(topk_vals >= 0, topk_vals + cbase.unsqueeze(1), -1)
    rel = offset - topk_len.unsqueeze(1)
    if swa_indices is not None:
        raw = swa_indices.long().gather(1, rel.clamp(0, window_size - 1))
        swa_vals = torch.where(raw >= 0, sbase.unsqueeze(1) + raw, -1)
    else:
        swa_vals = (sbase + pos - swa_len + 1 - (seq - gather)).unsqueeze(1) + rel
    vals = torch.where(in_topk, topk_vals, torch.where(in_swa, swa_vals, -1))
    combined.copy_(vals.to(torch.int32))
    lens.copy_((topk_len + swa_len).to(torch.int32))
    return combined, lens


# ----------------------------------------------------------------------------- hyper-connections


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """``hc_split_sinkhorn`` (TileLang) in torch, as its Triton port ``_hc_split_sinkhorn_triton``:
    pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = row softmax + eps, then Sinkhorn row/column
    normalisations. Returns fp32 ``[b, s, hc]``, ``[b, s, hc]``, ``[b, s, hc, hc]`` in mixes' dtype."""
    b, s, _ = mixes.shape
    hc = hc_mult
    flat = mixes.reshape(b * s, (2 + hc) * hc).float()
    scale, base = hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(flat[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * torch.sigmoid(flat[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = flat[:, 2 * hc:].reshape(-1, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    comb = torch.softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return (pre.reshape(b, s, hc).to(mixes.dtype), post.reshape(b, s, hc).to(mixes.dtype),
            comb.reshape(b, s, hc, hc).to(mixes.dtype))


def mhc_combine(x_flat, pre, hc, out_dtype):
    """``mhc_combine`` (Triton) in torch: ``y[m, h] = sum_k pre[m, k] * x_flat[m, k*H + h]``, fp32 accumulate."""
    m = x_flat.shape[0]
    x = x_flat.float().reshape(m, hc, -1)
    return (pre.float().reshape(m, hc, 1) * x).sum(1).to(out_dtype)


def fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    """``fused_hc_head`` (Triton) by SGLang's own torch path, ``deepseek_v4.hc_head_torch``."""
    from sglang.srt.models.deepseek_v4 import hc_head_torch

    return hc_head_torch(x, hc_fn, hc_scale, hc_base, norm_eps=norm_eps, hc_eps=hc_eps)
