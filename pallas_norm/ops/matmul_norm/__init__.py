"""Post-norm GEMM ``norm(x @ w + dense_bias + residual)`` (DESIGN.md, op 2): :func:`matmul_norm`
(``api``), the XLA parts of its kernel backward (``xla``), the forward Mosaic-GPU kernel
(``mosaic``; the norm backward is :func:`pallas_norm.ops.norms.triton.norm_backward`) and the
measured dispatch thresholds (``configs``)."""

from pallas_norm.ops.matmul_norm.api import matmul_norm

__all__ = ["matmul_norm"]
