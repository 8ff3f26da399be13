"""A tiny pure-torch hybrid model (sliding-window + full-attention layers) on a real ``SWAKVPool``.

It exists to prove the cone replay exact (issue 5): every layer reads its keys and values from the
KV pool, never from the forward's own tensors, like a paged attention backend. Sliding-window
layers read ``SWAKVPool``'s SWA side through ``full_to_swa_index_mapping``; full-attention layers
read the Full side through the request row of ``req_to_token``.

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
"""

from __future__ import annotations

import math
from typing import Any

import torch


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
