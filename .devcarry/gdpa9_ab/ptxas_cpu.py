"""ptxas's report of the GDPA backward kernel, on a machine without a GPU.

Lowers the kernel for sm_90a (jax.export for cuda), hands the serialized Mosaic module to the
CUDA PJRT plugin's exported MosaicGpuCompile (jax-cuda12-pjrt 0.11.2, unpacked, not installed)
with a stand-in libcuda that reports one sm_90 device, and lets Mosaic's dump options write
the PTX and ptxas -v output (compilation fails after that, at the missing driver: expected;
MOSAIC_GPU_DUMP_TO also writes ~90 MB of MLIR pass logs). The pieces, none installed:
  pip download --no-deps jax-cuda12-pjrt==0.11.2 nvidia-cuda-nvcc-cu12; unzip both;
  the stand-in driver: gcc -shared -fPIC -o libcuda.so.1 fakecuda.c (FAKE_CUDA_C below).

  PLUGIN=/tmp/g9/whl/p/jax_plugins/xla_cuda12/xla_cuda_plugin.so \
  CUDA_NVCC=/tmp/g9/whl/n/nvidia/cuda_nvcc LD_LIBRARY_PATH=/tmp/g9/fakecuda \
  PYTHONPATH=<tree> python ptxas_cpu.py OUT_DIR [add_do] [scales]
"""
import ctypes, os, sys, pathlib

FAKE_CUDA_C = r"""
typedef int CUresult; typedef int CUdevice; typedef void* CUcontext;
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 12080; return 0; }
CUresult cuCtxGetDevice(CUdevice* d) { *d = 0; return 0; }
CUresult cuCtxGetCurrent(CUcontext* c) { *c = (void*)0x1; return 0; }
CUresult cuDeviceGet(CUdevice* d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {  /* 75, 76: cc major, minor */
  *v = attr == 75 ? 9 : 0; return 0; }
CUresult cuGetErrorString(CUresult e, const char** s) { *s = "fakecuda"; return 0; }
CUresult cuGetErrorName(CUresult e, const char** s) { *s = "fakecuda"; return 0; }
"""
out_dir = pathlib.Path(sys.argv[1]).resolve()
out_dir.mkdir(parents=True, exist_ok=True)
add_do = "add_do" in sys.argv[2:]
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
    import io
    b = io.BytesIO(); m.operation.write_bytecode(b, desired_version=0); mods.append(b.getvalue())
  return m
core._run_serde_pass = capture
from pallas_norm.ops.gdpa import mosaic_bwd as gb
spec = jax.ShapeDtypeStruct
batch, t, h, d = 768, 768 * 256, 4, 128
kv = (batch, 128, h, d)
scales = "scales" in sys.argv[2:]  # traced scales: the kernel's scale-gradient partial sums
fn = lambda q, k, v, o, do, pre, post: gb.gdpa_bwd(
    q, k, v, o, None, do, activation="fast_gelu", add_do_to_dq=add_do,
    pre_scale=pre if scales else 1.0, post_scale=post if scales else 1.0)
export.export(jax.jit(fn), platforms=["cuda"])(
    spec((t, h, d), jnp.bfloat16), spec(kv, jnp.bfloat16), spec(kv, jnp.bfloat16),
    spec((batch + 1,), jnp.int32), spec((t, h, d), jnp.bfloat16), spec((), jnp.float32),
    spec((), jnp.float32))
lib = ctypes.CDLL(os.environ["PLUGIN"])
lib.MosaicGpuCompile.argtypes = [ctypes.c_char_p, ctypes.c_int]
lib.MosaicGpuCompile.restype = ctypes.c_void_p
for m in mods:
  r = lib.MosaicGpuCompile(m, len(m))
  print("MosaicGpuCompile ->", r, file=sys.stderr)
print(sorted(p.name for p in out_dir.iterdir()))
