"""Post-norm GEMM ``norm(x @ w + dense_bias + residual)`` (DESIGN.md, op 2): :func:`matmul_norm`
(``api``), the XLA parts of its kernel backward (``xla``), the forward and norm-backward
Mosaic-GPU kernels (``mosaic``, ``mosaic_bwd``) and the measured dispatch thresholds
(``configs``)."""

from pallas_norm.ops.matmul_norm.api import matmul_norm

__all__ = ["matmul_norm"]
