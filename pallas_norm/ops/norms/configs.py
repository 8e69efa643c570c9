"""Where ``implementation=None`` takes the row norms' Pallas kernels: the domains measured on
the H200 (the times: ``benchmarks/NOTES.md``, "Standalone norms"), read by
:mod:`pallas_norm.ops.norms.api` (``forward_path``, ``slower_reason``,
``slower_forward_reason``). The kernels' tilings are in :mod:`pallas_norm.ops.norms.triton` and
:mod:`pallas_norm.ops.norms.triton_fwd`."""

from __future__ import annotations

LAYER_AUTODIFF_MIN_N = 24576
"""From this row width the "xla" ``layer_norm`` is differentiated by autodiff of the reference
under ``jax.checkpoint`` (:func:`pallas_norm.ops.norms.xla.normalize_rows`'s
``layer_by_autodiff``: reverse mode keeps x only, the rule x and the row statistics) instead of
the one-pass rule: XLA compiles that gradient to a faster program than the rule's from about
this width on the H200 (bf16 fwd+bwd at 1 GB of x: checkpointed autodiff 2889 vs the rule's
3184 µs at N = 24576; plain autodiff, the same program under one ``jit``, 2603 vs 3412 at
32768; the rule 20–25% faster at 12288 and 16384; ``benchmarks/NOTES.md``, "Standalone
norms"). It also beats the kernel path there, so ``KERNEL_DOMAINS`` stops below it. Applies on
every backend: only the H200 was measured."""

KERNEL_DOMAINS = {
    # norm: ((min N, max N, min rows), ...) for bfloat16 x without a residual
    "layer": ((128, 8192, 65536), (8193, LAYER_AUTODIFF_MIN_N - 1, 16384)),
    "rms": ((128, 2048, 262144),),
}
"""Where ``implementation=None`` trains through the kernels, per norm: the forward kernel of
:mod:`pallas_norm.ops.norms.triton_fwd` and the backward reading its statistics. Each row is
where the H200 measured that path faster in training than the "xla" implementation: bf16
without a residual (``benchmarks/NOTES.md``, "Standalone norms"); LayerNorm's stops where the
"xla" path turns to autodiff (``LAYER_AUTODIFF_MIN_N``), faster there. Outside them XLA runs; an
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
(``benchmarks/NOTES.md``, "Standalone norms"): LayerNorm at every one (past N = 24576 training
runs XLA), RMSNorm at 512 and 2048 (0.94× and 0.99× XLA's, three runs) and past 8192 (XLA's at
128 and 8192). The rows reach past the measured shapes to as many rows as the fewest measured
in their N range."""
