"""A tiny pure-torch hybrid model (sliding-window + full-attention layers) on a real ``SWAKVPool``.

It exists to prove the cone replay exact, in two modes:

* ``forward`` (the pool model): every layer writes its K/V, then reads keys and values from the KV
  pool, never from the forward's own tensors. Sliding-window layers read ``SWAKVPool``'s SWA side
  through ``full_to_swa_index_mapping``; full-attention layers read the Full side through the
  request row of ``req_to_token``. The cone's effect is given as arguments (a Full-side write
  mask and a window floor).
* ``forward_extend`` (the production path): every layer's q/k/v go through a real
  ``RadixAttention`` layer, so with cone replay installed through its ``RadixAttention.forward``
  wrapper (``substitute_full_kv``), to :class:`ExtendBackend`, published with SGLang's own
  ``forward_context``. Like SGLang's extend kernels, the backend writes the extend rows' K/V to the
  pool (``set_kv_buffer``) and attends each row over the prefix K/V read from the pool and the
  extend rows' K/V from the forward's own ``k``/``v``. No floor: no SGLang backend has one.

Each row is computed with the same tensor shapes whatever else the forward holds (one row at a
time, keys gathered per row), so two forwards that feed a row the same inputs give the same fp32
bits; this is what lets a test compare a cone replay with a prefix hit bit for bit.

Window convention (SGLang's): row ``r`` of a sliding-window layer attends the keys ``j`` with
``r - j < W``; the replay floor drops keys below it (``j >= floor``), the way
``build_causal_swa_page_indices`` drops offsets below ``swa_replay_start``.

API::

    model = TinyHybrid(kinds="SFSS", window=8, d=16, seed=0)
    kv = model.make_pool(size=4096, size_swa=1024, page=16)          # a real SWAKVPool (fp32)
    out = model.forward(kv, slots, tokens, start, end, floor=0, mask=None)
        # slots: Full-pool slot of every position [0, end); rows [start, end) are computed;
        # mask=(lo, hi): rows in [lo, hi) write nothing to the Full side (padding slot 0).
    out = model.forward_extend(kv, slots, tokens, start, end)      # the production path (no floor, no mask)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


class TinyHybrid:
    def __init__(self, kinds: str, window: int, d: int = 16, vocab: int = 251, seed: int = 0):
        assert set(kinds) <= {"S", "F"} and "S" in kinds, kinds
        self.kinds, self.window, self.d, self.vocab = kinds, window, d, vocab
        gen = torch.Generator().manual_seed(seed)

        def mat(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float32) / math.sqrt(shape[0])

        self.emb = torch.randn(vocab, d, generator=gen, dtype=torch.float32)
        self.layers = [
            {name: mat(d, d) for name in ("q", "k", "v", "o")} | {"up": mat(d, 2 * d), "down": mat(2 * d, d)}
            for _ in kinds
        ]
        self.swa_layer_ids = [i for i, k in enumerate(kinds) if k == "S"]
        self.full_layer_ids = [i for i, k in enumerate(kinds) if k == "F"]

    @property
    def num_swa_layers(self) -> int:
        return len(self.swa_layer_ids)

    def make_pool(self, size: int, size_swa: int, page: int) -> Any:
        """A real ``SWAKVPool`` for this model: one head of ``d`` per layer, fp32, on CPU."""
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        return SWAKVPool(size=size, size_swa=size_swa, page_size=page, dtype=torch.float32, head_num=1,
                         head_dim=self.d, swa_attention_layer_ids=self.swa_layer_ids,
                         full_attention_layer_ids=self.full_layer_ids, device="cpu")

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean() + 1e-6)

    def forward(self, kv: Any, slots: torch.Tensor, tokens: list[int], start: int, end: int,
                floor: int = 0, mask: tuple[int, int] | None = None) -> torch.Tensor:
        """Compute rows ``[start, end)``; return their final hidden states ``[end - start, d]``.

        ``slots[j]`` is the Full-pool slot of position ``j`` (a request row of ``req_to_token``).
        Keys below ``floor`` are dropped from every sliding window. Rows in ``mask`` (lo, hi)
        send their Full-side writes to the padding slot 0, as masked rows do upstream."""
        slots = slots.to(torch.int64)
        mapping = kv.full_to_swa_index_mapping
        swa_slots = mapping[slots[:end]].to(torch.int64)
        h = [self.emb[tokens[r] % self.vocab].clone() for r in range(start, end)]
        for layer_id, kind in enumerate(self.kinds):
            w = self.layers[layer_id]
            kbuf, vbuf = kv.get_key_buffer(layer_id), kv.get_value_buffer(layer_id)
            xs = [self._norm(x) for x in h]
            for i, r in enumerate(range(start, end)):  # write this layer's K/V of every extend row first
                if kind == "S":
                    loc = int(swa_slots[r])
                elif mask is not None and mask[0] <= r < mask[1]:
                    loc = 0  # the padding slot: the copied Full KV of this row stays as it was
                else:
                    loc = int(slots[r])
                kbuf[loc, 0] = xs[i] @ w["k"]
                vbuf[loc, 0] = xs[i] @ w["v"]
            for i, r in enumerate(range(start, end)):
                if kind == "S":
                    lo = max(r - self.window + 1, floor, 0)
                    loc = swa_slots[lo : r + 1]
                else:
                    loc = slots[: r + 1]
                keys, values = kbuf[loc, 0], vbuf[loc, 0]
                q = xs[i] @ w["q"]
                att = torch.softmax(keys @ q / math.sqrt(self.d), dim=0)
                y = h[i] + (att @ values) @ w["o"]
                h[i] = y + torch.relu(self._norm(y) @ w["up"]) @ w["down"]
        return torch.stack(h) if h else torch.empty(0, self.d)

    def _radix_layers(self) -> list[Any]:
        from sglang.srt.layers.radix_attention import RadixAttention

        if not hasattr(self, "_radix"):
            self._radix = [RadixAttention(1, self.d, self.d**-0.5, 1, layer_id,
                                          sliding_window_size=self.window if kind == "S" else -1)
                           for layer_id, kind in enumerate(self.kinds)]
        return self._radix

    def forward_extend(self, kv: Any, slots: torch.Tensor, tokens: list[int], start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` the way SGLang runs an extend: a real ``ForwardBatch``
        (``ForwardMode.EXTEND``), each layer's attention through the real (installed)
        ``RadixAttention.forward`` to :class:`ExtendBackend`. A cone's replay rows must be
        published by the caller, as ``ModelRunner.forward`` does (``devkit.testkit.cone``)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        slots = slots.to(torch.int64)
        n = end - start
        if n <= 0:
            return torch.empty(0, self.d)
        batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                             input_ids=torch.tensor(tokens[start:end], dtype=torch.int64),
                             req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.tensor([end]),
                             out_cache_loc=slots[start:end], seq_lens_sum=end,
                             extend_prefix_lens_cpu=[start], extend_seq_lens_cpu=[n])
        h = [self.emb[tokens[r] % self.vocab].clone() for r in range(start, end)]
        with forward_context(ForwardContext(attn_backend=ExtendBackend(kv, slots[:end]))):
            for layer_id, attention in enumerate(self._radix_layers()):
                w = self.layers[layer_id]
                xs = [self._norm(x) for x in h]
                q, k, v = (torch.stack([x @ w[name] for x in xs]) for name in ("q", "k", "v"))
                att = attention(q, k, v, batch)
                for i in range(n):
                    y = h[i] + att[i] @ w["o"]
                    h[i] = y + torch.relu(self._norm(y) @ w["up"]) @ w["down"]
        return torch.stack(h)


class ExtendBackend(AttentionBackend):
    """A CPU extend kernel for one request (one head): what SGLang's extend backends do, row by
    row with fixed shapes so two forwards feeding a row the same inputs give the same fp32 bits.
    ``slots``: the request row (Full-pool slot of every position ``[0, end)``). The real
    ``AttentionBackend.forward`` dispatches an EXTEND batch here."""

    def __init__(self, kv: Any, slots: torch.Tensor):
        self.kv, self.slots = kv, slots

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        kv, start, n = self.kv, int(forward_batch.extend_prefix_lens_cpu[0]), q.shape[0]
        mapping = kv.full_to_swa_index_mapping
        is_swa = kv.layers_mapping[layer.layer_id][1]
        if save_kv_cache:  # the backends translate the SWA write loc once per forward
            loc = forward_batch.out_cache_loc
            kv.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch, swa_loc=mapping[loc].to(torch.int64)), k, v)
        kbuf, vbuf = kv.get_key_buffer(layer.layer_id), kv.get_value_buffer(layer.layer_id)
        prefix = self.slots[:start]
        if is_swa:
            prefix = mapping[prefix].to(torch.int64)
        k, v, q = k.reshape(n, -1), v.reshape(n, -1), q.reshape(n, -1)
        window = int(layer.sliding_window_size)
        out = torch.empty(n, q.shape[1])
        for i in range(n):
            r = start + i
            lo = max(r - window + 1, 0) if window > 0 else 0
            keys = torch.cat([kbuf[prefix[lo:start], 0], k[max(lo, start) - start : i + 1]])
            values = torch.cat([vbuf[prefix[lo:start], 0], v[max(lo, start) - start : i + 1]])
            att = torch.softmax(keys @ q[i] / math.sqrt(q.shape[1]), dim=0)
            out[i] = att @ values
        return out
