"""Standalone row norms :func:`rms_norm` and :func:`layer_norm` (DESIGN.md, op 5): ``api`` (the
public ops, the dispatch questions and the kernel path's ``custom_vjp``), ``routing`` (where
``implementation=None`` takes the kernels, as measured), ``xla`` (XLA's forward and
derivatives), ``triton`` (the one-pass Pallas backward kernel of both, with the Triton lowering;
also the post-norm GEMM's norm backward) and ``triton_fwd`` (the forward kernel that hands the
backward its row statistics)."""

from pallas_norm.ops.norms.api import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
