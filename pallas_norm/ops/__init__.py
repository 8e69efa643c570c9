"""One module per op: argument checks, implementation choice and (once kernels land) the
custom_vjp wiring. The math of each op is in :mod:`pallas_norm.reference`."""
