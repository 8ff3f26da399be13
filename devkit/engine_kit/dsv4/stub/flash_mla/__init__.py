"""Pure-torch stand-in for the ``flash_mla`` package (``sgl-flash-mla``), DeepSeek-V4 kit only.

On the server's ``PYTHONPATH`` only when :mod:`devkit.engine_kit.dsv4.launch` starts it; SGLang's
``kernels/ops/attention/flash_mla_interface.py`` imports it unchanged. The math lives in
:mod:`devkit.engine_kit.dsv4.flashmla`. MegaAttention (``fused_norm_rope_attn_rope_cast``) is
importable and raises when called.
"""

from devkit.engine_kit.dsv4.flashmla import (  # noqa: F401
    FlashMLASchedMeta,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_decoding_metadata,
    get_mla_metadata,
)
from flash_mla import flash_mla_interface  # noqa: F401

__version__ = "0.0.0+dsv41.torchstandin"


class _NotStoodIn:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        raise NotImplementedError(f"flash_mla stand-in: {self._name}.{attr} (MegaAttention) is not stood in for")


fused_norm_rope_attn_rope_cast = _NotStoodIn("fused_norm_rope_attn_rope_cast")
