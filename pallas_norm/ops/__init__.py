"""One folder per op: ``api`` (the public function: argument checks, implementation choice, the
custom_vjp of the kernel path), ``xla`` (what XLA runs), ``mosaic`` / ``mosaic_bwd`` (the
Mosaic-GPU kernels), ``routing`` (where ``implementation=None`` takes which path: thresholds
measured on the H200) and ``configs`` (tiling knobs), as each op has them. The
math of each op is in :mod:`pallas_norm.reference`. ``rms_norm`` and ``layer_norm`` share
:mod:`.norms` (kernels ``triton_fwd``, ``triton``)."""
