"""The fused Kunlun PFFN block :func:`flash_norm_attention` (DESIGN.md, op 4): ``api`` (the
public op, its custom_vjp and the unfused chain), ``mosaic`` (the forward kernel, one CTA for
every head of a q block), ``cluster`` (the forward kernel as a cluster of H CTAs, where that
one does not fit) and ``norm_bwd`` (the two norm backwards' row kernels around GDPA's backward
kernel, :mod:`pallas_norm.ops.gdpa.mosaic_bwd`). No ``xla`` module: the XLA path is
:func:`pallas_norm.reference.flash_norm_attention`."""

from pallas_norm.ops.flash_norm_attention.api import flash_norm_attention

__all__ = ["flash_norm_attention"]
