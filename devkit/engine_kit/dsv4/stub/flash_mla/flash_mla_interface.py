"""``flash_mla.flash_mla_interface`` of the stand-in: the scheduling metadata class."""

from devkit.engine_kit.dsv4.flashmla import FlashMLASchedMeta  # noqa: F401
