"""The fused Kunlun PFFN block :func:`flash_norm_attention` (DESIGN.md, op 4; XLA today)."""

from pallas_norm.ops.flash_norm_attention.api import flash_norm_attention

__all__ = ["flash_norm_attention"]
