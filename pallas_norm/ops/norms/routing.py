"""Where ``implementation=None`` takes the row norms' Pallas kernels: the domains measured on
the H200 (the times: ``benchmarks/NOTES.md``, "Standalone norms"), read by
:mod:`pallas_norm.ops.norms.api` (``forward_path``, ``slower_reason``,
``slower_forward_reason``). The kernels' tilings are in :mod:`pallas_norm.ops.norms.triton` and
:mod:`pallas_norm.ops.norms.triton_fwd`."""

from __future__ import annotations

KERNEL_DOMAINS = {
    # norm: ((min N, max N, min rows), ...) for bfloat16 x without a residual
    "layer": ((128, 8192, 65536), (8193, 32768, 16384)),
    "rms": ((128, 2048, 262144),),
}
"""Where ``implementation=None`` trains through the kernels, per norm: the forward kernel of
:mod:`pallas_norm.ops.norms.triton_fwd` and the backward reading its statistics. Each row is
where the H200 measured that path faster in training than the "xla" implementation: bf16
without a residual (``benchmarks/NOTES.md``, "Standalone norms"). Outside them XLA runs; an
explicit "triton"/"interpret" takes :func:`pallas_norm.ops.norms.api.forward_path`'s
forward."""

FORWARD_DOMAINS = {
    # norm: ((min N, max N, min rows), ...) for bfloat16 x without a residual
    "layer": ((128, 8192, 65536), (8193, 32768, 16384)),
    "rms": ((512, 2048, 262144), (8193, 32768, 16384)),
}
"""Where ``implementation=None`` runs a call that is not differentiated (inference) through the
forward kernel: where the H200 measured it faster than XLA's forward alone by more than 1%
(closer is the measurement's spread), at the suite's shapes from N = 128 to 32768
(``benchmarks/NOTES.md``, "Standalone norms"): LayerNorm at every one (the training domains'
rows), RMSNorm at 512 and 2048 (0.94× and 0.99× XLA's, three runs) and past 8192 (XLA's at
128 and 8192). The rows reach past the measured shapes to as many rows as the fewest measured
in their N range."""
