"""ci13: the kernel modules each public op emits, exported for the cuda platform on the CPU, and
the CPU interpret-mode outputs of the same ops. Writes one file per case under OUT:
  <case>.mosaic: every Mosaic GPU / Triton custom call of the exported module, its
                 backend_config included (the serialized kernel module, locations included);
  <case>.npz:    the interpret-mode outputs (forward and gradients), where the case runs on CPU.
Run from the worktree root: PYTHONPATH=$PWD PJRT_NPROC=8 python .devcarry/ci13_ab/export_check.py OUT [--no-run]
Compare two OUT folders with `diff -r` (the .npz byte-equal, e.g. cmp). Names after OUT run only
the cases that start with them. --no-loc strips every location (the kernels' IR alone). With
locations, run one case per process (names after OUT): JAX's trace caches keep the call sites
of the first trace of a shared function, so a case's locations depend on the cases before it."""
import hashlib
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import pallas_norm as pn
from pallas_norm import _dispatch
from jax._src.pallas.triton import gpu_info as _gpu_info

# The Triton lowering asks the device for its GPU: an H200's, as the Mosaic kernels assume.
_gpu_info.get_gpu_info = lambda: _gpu_info.get_gpu_info_from_version(_gpu_info.GpuVersion.H200)

OUT = sys.argv[1]
RUN = "--no-run" not in sys.argv
if "--no-loc" in sys.argv:
  # Every location unknown (file, line, call sites, name stacks): the kernels' IR alone.
  from jax._src import source_info_util
  from jax._src.interpreters import mlir as _mlir
  from jax._src.lib.mlir import ir as _ir
  _mlir.source_info_to_location = lambda *a, **k: _ir.Location.unknown()
  source_info_util.user_frame = lambda *a, **k: None
os.makedirs(OUT, exist_ok=True)
BF = jnp.bfloat16
spec = jax.ShapeDtypeStruct


def kernel_calls(text):
  """The custom calls that carry a kernel: mosaic_gpu* and triton_kernel_call, whole lines."""
  return [l.strip() for l in text.splitlines()
          if re.search(r"custom_call @(mosaic_gpu|triton_kernel_call|__gpu)", l)]


def export_case(name, fn, args):
  saved = _dispatch.on_hopper_gpu, _dispatch.on_cuda_gpu
  _dispatch.on_hopper_gpu = lambda: True
  _dispatch.on_cuda_gpu = lambda: True
  try:
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        *[spec(a.shape, a.dtype) if a is not None else None for a in args])
  finally:
    _dispatch.on_hopper_gpu, _dispatch.on_cuda_gpu = saved
  calls = kernel_calls(exp.mlir_module())
  assert calls, name
  with open(os.path.join(OUT, name + ".mosaic"), "w") as f:
    for c in calls:
      f.write(c + "\n")
  print(name, len(calls), hashlib.sha256("\n".join(calls).encode()).hexdigest()[:16], flush=True)


def run_case(name, fn, args):
  if not RUN:
    return
  out = jax.jit(fn)(*args)
  leaves = [np.asarray(jnp.asarray(l, jnp.float32)) for l in jax.tree.leaves(out)]
  np.savez(os.path.join(OUT, name + ".npz"), *leaves)


def rand(key, shape, dtype=BF, scale=1.0):
  return (jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32) * scale).astype(dtype)


def loss_grad(op, argnums):
  def f(*a):
    y = op(*a)
    y = y[0] if isinstance(y, tuple) else y
    ct = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y.astype(jnp.float32) * ct)
  return lambda *a: (op(*a), jax.grad(f, argnums=argnums)(*a))


def gdpa_cases(impl):
  cases = []
  # dense K/V, jagged K/V, long K/V (streamed), f32 out (D = 64), traced scales
  t, h = 128, 2
  q = rand(1, (t, h, 64))
  kv = rand(2, (2, 128, h, 64)), rand(3, (2, 128, h, 64))
  off = jnp.array([0, 60, 120], jnp.int32)
  op = lambda q, k, v, pre, post: pn.gdpa(q, k, v, off, pre_scale=pre, post_scale=post,
                                          implementation=impl)
  cases.append(("gdpa_dense", loss_grad(op, (0, 1, 2, 3, 4)),
                (q, *kv, jnp.float32(0.7), jnp.float32(1.3))))
  kvj = rand(4, (t, h, 64)), rand(5, (t, h, 64))
  koff = jnp.array([0, 50, 128], jnp.int32)
  op = lambda q, k, v: pn.gdpa(q, k, v, off, koff, max_kv_len=96, activation="silu",
                               implementation=impl)
  cases.append(("gdpa_jagged", loss_grad(op, (0, 1, 2)), (q, *kvj)))
  op = lambda q, k, v: pn.gdpa(q, k, v, off, out_dtype=jnp.float32, implementation=impl)
  cases.append(("gdpa_f32out", loss_grad(op, (0, 1, 2)), (q, *kv)))
  qd = rand(6, (t, h, 128))
  kvl = rand(7, (2, 1024, h, 128)), rand(8, (2, 1024, h, 128))
  op = lambda q, k, v: pn.gdpa(q, k, v, off, implementation=impl)
  cases.append(("gdpa_stream", loss_grad(op, (0, 1, 2)), (qd, *kvl)))
  return cases


def fna_cases(impl):
  t, h = 128, 2
  q = rand(11, (t, h, 64))
  off = jnp.array([0, 60, 120], jnp.int32)
  kvj = rand(12, (t, h, 64)), rand(13, (t, h, 64))
  koff = jnp.array([0, 50, 128], jnp.int32)
  ln = rand(14, (h * 64,), jnp.float32)
  op = lambda q, k, v, s: pn.flash_norm_attention(q, k, v, off, koff, ln_scale=s,
                                                  implementation=impl)
  cases = [("fna_chain_jagged", loss_grad(op, (0, 1, 2, 3)), (q, *kvj, ln))]
  kv = rand(15, (2, 128, h, 64)), rand(16, (2, 128, h, 64))
  op = lambda q, k, v, s: pn.flash_norm_attention(q, k, v, off, ln_scale=s, implementation=impl)
  cases.append(("fna_fused_dense", loss_grad(op, (0, 1, 2, 3)), (q, *kv, ln)))
  return cases


def norm_matmul_cases(impl):
  cases = []
  for m, k, n, norm, bias, odt in [(77, 256, 128, "layer", True, None),  # row sums (K <= 256)
                                   (64, 512, 256, "rms", False, None),  # row sums, cluster 2 (GPU)
                                   (40, 320, 192, "layer", True, None),  # fused row terms
                                   (40, 320, 192, "layer", False, jnp.float32),  # y_term (f32 y)
                                   (24, 320, 512, "rms", True, None),  # y_term, x̂ (K < N)
                                   (24, 576, 128, "rms", False, None)]:  # y_term, no x̂
    x = rand(k + n, (m, k))
    w = rand(k + n + 1, (k, n), scale=k ** -0.5)
    s = rand(k + n + 2, (k,), scale=0.2) + 1
    b = rand(k + n + 3, (k,), scale=0.2) if bias else None
    op = lambda x, w, s, b, norm=norm, odt=odt: pn.norm_matmul(
        x, w, scale=s, norm_bias=b, norm=norm, out_dtype=odt, implementation=impl)
    name = f"nm_{m}x{k}x{n}_{norm}{'_b' if bias else ''}{'_f32' if odt else ''}"
    cases.append((name, loss_grad(op, (0, 1, 2, 3) if bias else (0, 1, 2)), (x, w, s, b)))
  return cases


def matmul_norm_cases(impl):
  x, w, r = rand(31, (40, 128)), rand(32, (128, 256), scale=128 ** -0.5), rand(33, (40, 256))
  op = lambda x, w, r: pn.matmul_norm(x, w, residual=r, implementation=impl)
  return [("mn_res", loss_grad(op, (0, 1, 2)), (x, w, r))]


def norms_cases(impl):
  impl = "triton" if impl == "mosaic" else impl
  x, s, b = rand(41, (64, 256)), rand(42, (256,), jnp.float32), rand(43, (256,), jnp.float32)
  return [("layer_norm", loss_grad(lambda x, s, b: pn.layer_norm(x, s, b, implementation=impl),
                                   (0, 1, 2)), (x, s, b)),
          ("rms_norm", loss_grad(lambda x, s: pn.rms_norm(x, s, implementation=impl), (0, 1)),
           (x, s))]


ALL = [gdpa_cases, fna_cases, norm_matmul_cases, matmul_norm_cases, norms_cases]
only = [a for a in sys.argv[2:] if not a.startswith("--")]
for make in ALL:
  for (name, fn, args), (_, ifn, iargs) in zip(make("mosaic"), make("interpret")):
    if only and not any(name.startswith(o) for o in only):
      continue
    export_case(name, fn, args)
    if name != "gdpa_stream" and not name.startswith("nm_64x512"):
      run_case(name, ifn, iargs)
      RUN and print("  ran", name, flush=True)
