"""DeepSeek-V4's SwiGLU clamp on SGLang 0.5.23's MoE CPU path (the DSV4 kit's route).

Upstream's ``moe_forward_native`` (the routed experts on CPU) builds a plain ``SiluAndMul`` and never
reads ``MoeRunnerConfig.swiglu_limit``; the GPU runners apply ``silu(min(g, lim)) * clamp(u, -lim,
lim)`` (``moe_runner/triton.py``, ``deep_gemm.py``, ``swiglu_limit_func``). The kit's route wraps
the real function so the CPU kit matches GPU semantics. Reference: each routed expert computed by
hand with SGLang's own torch ``swiglu_limit_func``; fp32, so equal up to summation order (1e-5).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from devkit.engine_kit.dsv4 import routes


def _case():
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, topk = 4, 32, 16, 9, 2
    layer = SimpleNamespace(num_experts=experts,
                            w13_weight=torch.randn(experts, 2 * inter, hidden, generator=g),
                            w2_weight=torch.randn(experts, hidden, inter, generator=g) / 8)
    x = torch.randn(tokens, hidden, generator=g)  # gate/up pre-activations ~ N(0, 32): many beyond 10
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), -1)
    return layer, x, (weights, ids, None)


def _reference(layer, x, topk_output, limit):
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import swiglu_limit_func

    weights, ids, _ = topk_output
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = x[t:t + 1] @ layer.w13_weight[e].T
            act = torch.empty(1, gate_up.shape[1] // 2)
            swiglu_limit_func(act, gate_up, limit)
            out[t] += weights[t, k] * (act @ layer.w2_weight[e].T)[0]
    return out


def test_the_routed_moe_cpu_path_applies_dsv4s_swiglu_limit_as_the_gpu_runners_do():
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    layer, x, topk_output = _case()
    config = MoeRunnerConfig(activation="silu", swiglu_limit=10.0)
    upstream = fused_moe_native.moe_forward_native
    routed = routes._moe_native(fused_moe_native, upstream)
    want = _reference(layer, x, topk_output, 10.0)
    torch.testing.assert_close(routed(layer, x, topk_output, config), want, atol=1e-5, rtol=1e-5)
    # upstream drops the clamp: the same call is far from the GPU semantics
    stock = upstream(layer, x, topk_output, config)
    assert float((stock - want).abs().max()) > 1.0
    assert fused_moe_native.SiluAndMul is not None and fused_moe_native.moe_forward_native is upstream


def test_without_a_swiglu_limit_the_route_is_the_upstream_path():
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    layer, x, topk_output = _case()
    config = MoeRunnerConfig(activation="silu")
    routed = routes._moe_native(fused_moe_native, fused_moe_native.moe_forward_native)
    assert torch.equal(routed(layer, x, topk_output, config),
                       fused_moe_native.moe_forward_native(layer, x, topk_output, config))
