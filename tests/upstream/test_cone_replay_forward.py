"""Cone replay's forward side on ``SWAKVPool``: the replay rows' Full-attention K/V are
the resident Full KV of ``[s, F)``, sliding-window layers are untouched, nothing changes outside a
replay forward, and a replay forward never runs in a prefill graph.

The switch is installed and the real, wrapped ``RadixAttention.forward`` runs on real
``RadixAttention`` layers over a real ``SWAKVPool``, with a real ``ForwardBatch`` in
``ForwardMode.EXTEND``. The attention backend it dispatches to (``get_attn_backend()``, published
with SGLang's own ``forward_context``) is a recording ``AttentionBackend`` subclass: the real
``AttentionBackend.forward`` routes the extend batch to its ``forward_extend``, so what the tests
see is exactly what an extend kernel would receive. The replay rows are published in ``LIVE.active``
as ``ModelRunner.forward`` does for its duration (that publication is tested on its own below).
The end-to-end check (the real engine's branch tokens and logprobs equal a re-prefill's) is
``tests/test_gate_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from adapter.core import boot
from devkit.testkit import cone_replay_parts as cone_replay

PAGE, HEADS, DIM = 4, 2, 8
SWA_LAYER, FULL_LAYER = 0, 1


@pytest.fixture()
def pool():
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    kv = SWAKVPool(size=64, size_swa=64, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                   swa_attention_layer_ids=[SWA_LAYER], full_attention_layer_ids=[FULL_LAYER], device="cpu")
    gen = torch.Generator().manual_seed(0)
    for layer in (SWA_LAYER, FULL_LAYER):
        kv.get_key_buffer(layer).copy_(torch.randn(kv.get_key_buffer(layer).shape, generator=gen))
        kv.get_value_buffer(layer).copy_(torch.randn(kv.get_value_buffer(layer).shape, generator=gen))
    return kv


def _layer(layer_id: int, window: int = -1):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(HEADS, DIM, DIM**-0.5, HEADS, layer_id, sliding_window_size=window)


@pytest.fixture()
def installed():
    """The switch installed: ``RadixAttention.forward`` is its wrapper around the stock method."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from overlay_tools.simulate.cone_turn import install

    state = install(64)
    assert state.outcomes["cone_replay"].status == "armed"
    assert hasattr(RadixAttention.forward, "__wrapped__")
    yield state
    boot.uninstall()


def _recording_backend():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class Recording(AttentionBackend):
        """Records each ``forward_extend`` call; the real ``AttentionBackend.forward`` dispatches."""

        def __init__(self):
            self.calls = []

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            self.calls.append(dict(q=q, k=k, v=v, layer=layer, forward_batch=forward_batch,
                                   save_kv_cache=save_kv_cache, **kwargs))
            return torch.zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    return Recording()


def _extend_batch(tokens: int):
    """A real ``ForwardBatch`` of one request extending ``tokens`` rows (no MLP-sync padding:
    ``global_num_token_non_padded_cpu`` is None, so ``padded_extend_real_tokens`` passes it whole)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                        input_ids=torch.zeros(tokens, dtype=torch.int64),
                        req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.tensor([tokens]),
                        out_cache_loc=torch.arange(tokens), seq_lens_sum=tokens)


def _call(layer, q, k, v, cone):
    """The installed ``RadixAttention.forward`` on ``layer`` inside a forward whose replay rows are
    ``cone``; returns what the attention backend's ``forward_extend`` received."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend, forward_batch = _recording_backend(), _extend_batch(q.shape[0])
    cone_replay.LIVE.active = cone
    try:
        with forward_context(ForwardContext(attn_backend=backend)):
            out = layer(q, k, v, forward_batch, save_kv_cache=False)
    finally:
        cone_replay.LIVE.active = None
    [seen] = backend.calls
    assert out.shape == (q.shape[0], HEADS * DIM)
    assert seen["layer"] is layer and seen["forward_batch"] is forward_batch and seen["q"] is q
    assert seen["save_kv_cache"] is False
    return seen


def _qkv(tokens: int):
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(tokens, HEADS * DIM, generator=gen) for _ in range(3))


def test_full_layer_replay_rows_read_the_resident_kv_of_f_and_other_rows_keep_their_own(installed, pool):
    q, k, v = _qkv(12)
    rows = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10])  # a request's replay rows in the batch's token order
    slots = torch.arange(20, 28)  # F's tree slots of [s, F)
    seen = _call(_layer(FULL_LAYER), q, k, v, (rows, slots, pool))
    kbuf, vbuf = pool.get_key_buffer(FULL_LAYER), pool.get_value_buffer(FULL_LAYER)
    assert torch.equal(seen["k"][rows], kbuf[slots]) and torch.equal(seen["v"][rows], vbuf[slots])
    others = torch.tensor([0, 1, 2, 11])
    assert torch.equal(seen["k"][others].flatten(1), k[others]) and torch.equal(seen["v"][others].flatten(1), v[others])
    assert not torch.equal(k[rows], kbuf[slots].flatten(1))  # the forward's own K/V did differ
    assert cone_replay.COUNTERS.substituted_layers >= 1


def _untouched(seen, k, v) -> bool:
    """The backend got the forward's own K/V: ``RadixAttention.forward``'s head views of them."""
    return all(got.data_ptr() == own.data_ptr() and torch.equal(got.flatten(1), own)
               for got, own in ((seen["k"], k), (seen["v"], v)))


def test_sliding_window_layers_pass_their_own_k_and_v_to_the_backend_in_a_replay_forward(installed, pool):
    q, k, v = _qkv(12)
    cone = (torch.arange(2, 6), torch.arange(20, 24), pool)
    assert _untouched(_call(_layer(SWA_LAYER, window=7), q, k, v, cone), k, v)


def test_full_layers_pass_their_own_k_and_v_to_the_backend_outside_a_replay_forward(installed, pool):
    q, k, v = _qkv(12)
    assert _untouched(_call(_layer(FULL_LAYER), q, k, v, None), k, v)


def test_model_forward_publishes_the_replay_rows_only_for_its_own_duration():
    class Batch:
        pass

    live = Batch()
    setattr(live, cone_replay.FORWARD_ATTR, ("rows", "slots", "pool"))
    during = []

    def forward(forward_batch):
        during.append(cone_replay.LIVE.active)
        # the runners copy the live batch (dataclasses.replace): the copy has no attribute
        assert cone_replay._can_run_graph(lambda fb: True, None, (Batch(),), {}) is False
        return "ok"

    assert cone_replay._model_forward(forward, None, (live,), {}) == "ok"
    assert during == [("rows", "slots", "pool")] and cone_replay.LIVE.active is None
    assert cone_replay._can_run_graph(lambda fb: True, None, (Batch(),), {}) is True

    def failing(forward_batch):
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError):
        cone_replay._model_forward(failing, None, (live,), {})
    assert cone_replay.LIVE.active is None

    def plain(forward_batch):
        during.append(cone_replay.LIVE.active)
        return "plain"

    assert cone_replay._model_forward(plain, None, (Batch(),), {}) == "plain" and during[-1] is None


def test_the_switch_wraps_the_forward_side_when_installed_and_unwraps_on_uninstall():
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from overlay_tools.simulate.cone_turn import install

    stock = (RadixAttention.forward, ModelRunner.forward, vars(ForwardBatch)["init_new"])
    state = install(64)
    try:
        assert state.outcomes["cone_replay"].status == "armed"
        assert RadixAttention.forward is not stock[0] and ModelRunner.forward is not stock[1]
        assert RadixAttention.forward.__wrapped__ is stock[0]
    finally:
        boot.uninstall()
    assert (RadixAttention.forward, ModelRunner.forward, vars(ForwardBatch)["init_new"]) == stock


def test_only_an_unquantized_mha_full_pool_gets_the_forward_side(pool):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    assert cone_replay.forward_unsupported(pool) is None
    fp8 = cone_replay.forward_unsupported(_with_full(pool, dtype=torch.float8_e4m3fn))
    assert fp8.startswith("the Full KV cache is quantized (torch.float8_e4m3fn)")
    mla = MLATokenToKVPool(size=16, page_size=PAGE, dtype=torch.float32, kv_lora_rank=8, qk_rope_head_dim=4,
                           layer_num=1, device="cpu", enable_memory_saver=False)
    assert "MLATokenToKVPool) is not an MHA pool" in cone_replay.forward_unsupported(_with_full(pool, pool=mla))


def _with_full(kv, *, dtype=None, pool=None):
    import copy

    other = copy.copy(kv)
    other.full_kv_pool = copy.copy(kv.full_kv_pool) if pool is None else pool
    if dtype is not None:
        other.full_kv_pool.dtype = dtype
    return other
