"""ptxas's report of the GDPA forward kernel, on a machine without a GPU.

Adapted from gdpa9's ptxas_cpu.py (the backward): lowers the forward kernel for sm_90a
(jax.export for cuda), hands the serialized Mosaic module to the CUDA PJRT plugin's exported
MosaicGpuCompile (jax-cuda12-pjrt 0.11.2, unpacked, not installed) with a stand-in libcuda that
reports one sm_90 device, and lets Mosaic's dump options write the PTX and ptxas -v output
(compilation fails after that, at the missing driver: expected). Cases (ab.py's): h4 (dense K/V
Lkv=128, H=4, D=128, bf16, T = 768 * 256), h2 (H=2), full4 (T = 768 * 512), jag4 (jagged K/V,
max_kv_len=128). The pieces, none installed:
  pip download --no-deps jax-cuda12-pjrt==0.11.2 nvidia-cuda-nvcc-cu12; unzip both;
  the stand-in driver: gcc -shared -fPIC -o libcuda.so.1 fakecuda.c (FAKE_CUDA_C in gdpa9's).

  PLUGIN=/tmp/g9/whl/p/jax_plugins/xla_cuda12/xla_cuda_plugin.so \
  CUDA_NVCC=/tmp/g9/whl/n/nvidia/cuda_nvcc LD_LIBRARY_PATH=/tmp/g9/fakecuda \
  PYTHONPATH=<tree> python ptxas_cpu.py OUT_DIR [h4|h2|full4|jag4]
"""
import ctypes, io, os, sys, pathlib

out_dir = pathlib.Path(sys.argv[1]).resolve()
out_dir.mkdir(parents=True, exist_ok=True)
case = sys.argv[2] if len(sys.argv) > 2 else "h4"
os.environ.update(MOSAIC_GPU_DUMP_TO=str(out_dir), MOSAIC_GPU_DUMP_PTX="1",
                  MOSAIC_GPU_DUMP_PTXAS="1", JAX_PLATFORMS="cpu")
import jax, jax.numpy as jnp
from jax import export
import jax.experimental.mosaic.gpu.core as core
os.environ["MOSAIC_GPU_CUDA_ROOT"] = os.environ["CUDA_NVCC"]
mods = []
orig = core._run_serde_pass
def capture(module, *, serialize, ir_version=None):
  m = orig(module, serialize=serialize, ir_version=ir_version)
  if serialize:
    b = io.BytesIO(); m.operation.write_bytecode(b, desired_version=0); mods.append(b.getvalue())
  return m
core._run_serde_pass = capture
from pallas_norm.ops.gdpa import mosaic as gf
spec = jax.ShapeDtypeStruct
batch, t, d, lkv = 768, 768 * 256, 128, 128
h = 2 if case == "h2" else 4
t = 768 * 512 if case == "full4" else t
if case == "jag4":
  kv = (768 * 64, h, d)
  fn = lambda q, k, v, qo, ko, pre, post: gf.gdpa_fwd(
      q, k, v, qo, ko, pre, post, activation="fast_gelu", max_kv_len=lkv)
  extra = (spec((batch + 1,), jnp.int32),)
else:
  kv = (batch, lkv, h, d)
  fn = lambda q, k, v, qo, pre, post: gf.gdpa_fwd(
      q, k, v, qo, None, pre, post, activation="fast_gelu", max_kv_len=None)
  extra = ()
export.export(jax.jit(fn), platforms=["cuda"])(
    spec((t, h, d), jnp.bfloat16), spec(kv, jnp.bfloat16), spec(kv, jnp.bfloat16),
    spec((batch + 1,), jnp.int32), *extra, spec((), jnp.float32), spec((), jnp.float32))
lib = ctypes.CDLL(os.environ["PLUGIN"])
lib.MosaicGpuCompile.argtypes = [ctypes.c_char_p, ctypes.c_int]
lib.MosaicGpuCompile.restype = ctypes.c_void_p
for m in mods:
  r = lib.MosaicGpuCompile(m, len(m))
  print("MosaicGpuCompile ->", r, file=sys.stderr)
print(sorted(p.name for p in out_dir.iterdir()))
