"""Which XLA GEMM the backward's GEMM expressions get on the GPU (session 5).

``dx = dh wᵀ`` and ``dw = xᵀ dh`` (M = 262144, K = N = 512, bf16 in, f32 accumulation, bf16
out), each written four ways. In the post-norm backward one of them compiled to a Triton
``gemm_fusion`` of ~245 µs where XLA's own VJP gets cuBLAS GEMMs of ~184 µs. Prints each
form's kernels (CUPTI, median of 5)::

    PYTHONPATH=$PWD python3 benchmarks/gpu_weight_grad_forms.py
"""

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.breakdown import per_kernel_us

F32, HI = jnp.float32, lax.Precision.HIGHEST
M, K, N = 262144, 512, 512

DX_FORMS = {  # dx = dh @ wᵀ: (M, N) @ (N, K)
    "dx_matmul_T_f32_highest": lambda d, w: jnp.matmul(
        d, w.T, preferred_element_type=F32, precision=HI).astype(d.dtype),
    "dx_matmul_T_f32": lambda d, w: jnp.matmul(d, w.T, preferred_element_type=F32).astype(
        d.dtype),
    "dx_dot_general_f32": lambda d, w: lax.dot_general(
        d, w, (((1,), (1,)), ((), ())), preferred_element_type=F32).astype(d.dtype),
    "dx_matmul_T_bf16_out": lambda d, w: jnp.matmul(d, w.T),
}

FORMS = {
    "matmul_T_f32_highest": lambda x, d: jnp.matmul(
        x.T, d, preferred_element_type=F32, precision=HI).astype(x.dtype),
    "matmul_T_f32": lambda x, d: jnp.matmul(x.T, d, preferred_element_type=F32).astype(x.dtype),
    "dot_general_f32": lambda x, d: lax.dot_general(
        x, d, (((0,), (0,)), ((), ())), preferred_element_type=F32).astype(x.dtype),
    "matmul_T_bf16_out": lambda x, d: jnp.matmul(x.T, d),
}


def main():
  kx, kd = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (M, K), F32).astype(jnp.bfloat16)
  d = jax.random.normal(kd, (M, N), F32).astype(jnp.bfloat16)
  w = (jax.random.normal(kx, (K, N), F32) / K**0.5).astype(jnp.bfloat16)
  cases = [(name, form, (d, w), jnp.matmul(d.astype(F32), w.T.astype(F32), precision=HI))
           for name, form in DX_FORMS.items()]
  cases += [(name, form, (x, d), jnp.matmul(x.T.astype(F32), d.astype(F32), precision=HI))
            for name, form in FORMS.items()]
  for name, form, args, want in cases:
    fn = jax.jit(form)
    err = float(jnp.max(jnp.abs(fn(*args).astype(F32) - want)) / jnp.max(jnp.abs(want)))
    kernels = per_kernel_us(fn, args, iterations=5)
    total = sum(us for _, us in kernels)
    print(f"{name:<24} {total:8.1f} us  err {err:.1e}  " +
          ", ".join(f"{k[:60]} {us:.1f}" for k, us in kernels), flush=True)


if __name__ == "__main__":
  main()
