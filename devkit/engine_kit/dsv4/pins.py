"""Pins of the SGLang 0.5.23 functions the DeepSeek-V4 kit routes (replaces or wraps): data only.

``"module:qualname" -> sha256(inspect.getsource(inspect.unwrap(fn)))`` (the hash of
``adapter.core.pins.source_hash``). Each was added after reading the function and the kernel
source it launches; :mod:`.routes` refuses to patch a target whose installed source differs.
Kept apart from the overlay's production pin table: these are devkit-only targets.
"""

PINS: dict[str, str] = {
    # 0. chat encoding: DeepSeek's recipe encoder is for DeepSeek's tokenizer, not the kit's
    "sglang.srt.entrypoints.openai.chat_encoding:resolve_chat_encoding_spec": (
        "a93f6c384d831379a1b6136a92dbc1e298a458f7529524e4c0e7f153278290bb"
    ),
    # 1. rope factory (SWA-only layers ask for unscaled rope; CPU takes only deepseek_yarn)
    "sglang.srt.layers.rotary_embedding.factory:get_rope_wrapper": (
        "7847ad65131200933f62443d456302bf5fc9abc93bbe17027babf1014c231345"
    ),
    # 2. the CPU fp8-KV guard at the top of configure()
    "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator.configure": (
        "c8e14f836b5692247f85d8c1bdecd325a7fa45678606322d5015d13b917f185d"
    ),
    # 3. compressed-attention metadata (Triton kernels -> torch twins)
    "sglang.kernels.ops.attention.dsv4.metadata_kernel:init_compression_metadata": (
        "77526181aabd1d8a7eeca7e9ac454baba6cd29ca7e3c85820d31304ca2785c8b"
    ),
    "sglang.kernels.ops.attention.dsv4.metadata_kernel:fill_all_compressed_indices": (
        "9a30dae67d3b40013c723412f056d5b57949a248598bc4a09c4fa545b49362ac"
    ),
    # 4. backend: _flash_mla_with_kvcache bound under is_cuda() only
    "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.__init__": (
        "7a9a4034be4fbfaf79040f05d2a455f3e78372ad3e38a69a5e9de9abf745f59f"
    ),
    # 5. compressor (c_plan.cuh, c4_v2.cuh, c128_v2.cuh, fused_norm_rope_v2.cuh)
    "sglang.kernels.ops.attention.dsv4.compress:CompressorPrefillPlan.generate": (
        "aaaba5ad0134dc09f740b9e2b9668408df354ec0a30a22c941020796f69c6354"
    ),
    "sglang.kernels.ops.attention.dsv4.compress:CompressorDecodePlan.generate": (
        "bcb4983ff6bfbe13622a5580cc0972a21678c2a828e6e006a420b64149d14a19"
    ),
    "sglang.kernels.ops.attention.dsv4.compress:compress_forward": (
        "62c573f114e8bca633b42614cb2e9d930e68634eb17127dc490911de7ad2599f"
    ),
    "sglang.kernels.ops.attention.dsv4.compress:compress_norm_rope_store": (
        "b93ca8199dc8e6bde7c7aee9ec0050de1e15c1ef8585837390fb3789d1af2392"
    ),
    # 6. main / indexer norm + rope (+ Hadamard + e4m3) and the stores (main_norm_rope.cuh, store.cuh)
    "sglang.kernels.ops.attention.dsv4.norm_rope:fused_rope_inplace": (
        "c4fe38d373b29790ddd57371085b45efc1da7ebbacf181a87e3359e469d2bd00"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope:fused_norm_rope_inplace": (
        "b1f245e7bd986d40a1b7ff6ffc9d177822ac6cd34b808220992c310eb5b70a1f"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope:fused_q_norm_rope": (
        "75df54d972c9c830d5c82c2a1a98a005264606db75eb524b35ab0bb93f5a0756"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope:fused_q_indexer_rope_hadamard_quant": (
        "72eebcda88838281bd0a501cd50026786e369b92344ad15dd86faa554fedcde5"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope:fused_k_norm_rope_flashmla": (
        "70a35cef07bb293145e558d542d989c22b01afbf62950866e1a6ec68d28f3bd9"
    ),
    "sglang.kernels.ops.layernorm.mhc:hc_split_sinkhorn": (
        "49c9bec793d5f79d10bb0a1d48324855e94072ff264cd4bd74f3d16600984a70"
    ),
    "sglang.kernels.ops.layernorm.mhc:mhc_combine": (
        "d8f1c2884648d1de61700f56fe5c64d06841a06961a5748ff96bef14dd50e47b"
    ),
    "sglang.kernels.ops.layernorm.mhc_head:fused_hc_head": (
        "ab13c5c99c4b752a204cfcdddaff5bbd9bf893ebfb42049777decf1959684e40"
    ),
    "sglang.kernels.ops.attention.dsv4.attn:fused_store_cache": (
        "264ad21bc1f5453f5385e1a28a3cf1a8c543f525f254d8e6fca74b291999ecc2"
    ),
    "sglang.kernels.ops.attention.dsv4.sparse_prefill_kernels:build_swa_token_ids": (
        "c05f5c66ed8ca1596857d3e58b25f30d359982394796d4eed4be41a0229378af"
    ),
    "sglang.kernels.ops.attention.dsv4.sparse_prefill_kernels:combine_topk_swa_indices": (
        "da29030aa81f3e721f83c050fce4d2e1de7ddd950655b6d4a18b4967975b4c61"
    ),
    "sglang.kernels.ops.attention.dsv4.dequant_k_cache:dequantize_k_cache_paged_dsv4": (
        "0f77ac0930e41f9b3da1801de89866d3290d11fc9d42caa9ed552977c3c09b72"
    ),
    # 7. SwiGLU clamp, and the MoE CPU path that ignores swiglu_limit upstream
    "sglang.kernels.ops.activation.silu_and_mul_clamp:silu_and_mul_clamp": (
        "dc7f66a2d5c028a8b5379e8599d637745104413db4071536df527deed7241093"
    ),
    "sglang.srt.layers.moe.fused_moe_native:moe_forward_native": (
        "53b7e13072dbf34488e8a461eda07f378e25b2da3fe57205d126ced4878745da"
    ),
    # 8. V4.1 ratio-1/2 KV-source layers: the fp4 index-K pool's Triton kernels
    "sglang.kernels.ops.quantization.fp4_indexer_quant:quantize_fp4_indexer_tensor": (
        "45fa6596cc3b0efa55e03a6565e01c6d1b841b24a4d2e060463e82a7e21612cd"
    ),
    "sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache:store_fp4_index_k_cache": (
        "53eed9930493318027e700c012295e0d655fea1653a53dbe6806a9712402c472"
    ),
    "sglang.kernels.ops.attention.dsv4.fp4_indexer:fp4_index_logits_decode": (
        "3ad02e4bd99040549e4960317e8df356acada867a9cb81524233d0ef9937a53b"
    ),
    # ... and the torch prefill top-k, whose choice among tied scores moved with the forward's width
    "sglang.srt.layers.attention.dsv4.v41_indexer.full_topk:FullTopKIndexer._torch_prefill": (
        "d9e1475013a691a22dda098f8006dd20f8d42b4c1aec360a5dac2fe07013d030"
    ),
}
