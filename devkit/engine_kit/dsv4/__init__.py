"""The DeepSeek-V4 CPU engine kit: SGLang 0.5.23's real server serving a tiny DeepseekV4ForCausalLM.

Devkit only, never on a production path. :mod:`.launch` boots it (args, env, SWA page check),
:mod:`.kernels` and :mod:`.flashmla` are the pure-torch stand-ins for the CUDA/JIT kernels,
:mod:`.routes` binds them in the kit server (pinned by :mod:`.pins`), ``stub/flash_mla`` is the
``flash_mla`` package stand-in put on the server's ``PYTHONPATH``.
"""
