"""The DeepSeek-V4.1 CPU kit: the DSV4 kit's server (:mod:`devkit.engine_kit.dsv4`) on a tiny
``deepseek_v41`` model with ratio-1/2 KV-source layers, so that SGLang 0.5.23's decoder SWA bounded
replay (``--enable-decoder-swa-bounded-replay``) runs on CPU (devkit only).

:mod:`.launch` writes the config and boots it, :mod:`.checkpoint` writes seeded weights (the DSV4
kit's tensors plus the ratio-1/2 layers' compressor and indexer), :mod:`.check_kernels` compares the
fp4 index-K stand-ins (:mod:`devkit.engine_kit.dsv4.fp4_index`, routed by the DSV4 kit's route
table) with SGLang's own kernels and torch scoring.
"""
