"""Lazy pre-norm GEMM ``norm(x) @ w`` (DESIGN.md, op 1): :func:`norm_matmul` (``api``), the XLA
implementation (``xla``), the forward and dx Mosaic-GPU kernels (``mosaic``, ``mosaic_bwd``), the
weight-gradient kernel (``mosaic_dw``) and the measured dispatch thresholds (``routing``)."""

from pallas_norm.ops.norm_matmul.api import norm_matmul

__all__ = ["norm_matmul"]
