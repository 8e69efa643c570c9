"""Post-norm GEMM ``norm(x @ w + dense_bias + residual)`` (DESIGN.md, op 2): :func:`matmul_norm`
(``api``), the XLA implementation and the XLA parts of its kernel backward (``xla``), the
forward Mosaic-GPU kernel (``mosaic``), the whole backward at K = N = 128 as one kernel
(``mosaic_bwd``; elsewhere the norm backward is :func:`pallas_norm.ops.norms.triton.norm_backward`,
dx and dW XLA's GEMMs) and the measured dispatch thresholds (``routing``)."""

from pallas_norm.ops.matmul_norm.api import matmul_norm

__all__ = ["matmul_norm"]
