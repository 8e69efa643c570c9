"""ptxas's register/spill report of every Mosaic-GPU kernel of the library at the suite's shapes,
on a machine without a GPU (gdpa9's ptxas_cpu.py method, for all ops at once).

Each case is the suite's (benchmarks/cases.py) op called with implementation="mosaic" ("ours"
for the plain GEMM), exported for cuda (jax.export), differentiated with jax.vjp for the
training ("fwd+bwd") form; every Mosaic module lowered is captured and handed to the CUDA PJRT
plugin's exported MosaicGpuCompile with a stand-in libcuda reporting one sm_90 device, with
Mosaic's dump options writing the PTX and the ptxas -v report into OUT/<case>/<i>/ (the
compilation then fails at the missing driver: expected). Prints one row per kernel: case, the
kernel's index in the case (lowering order), registers, spill stores/loads, C75xx warnings,
and the PTX's hash (the same kernel in several cases has one hash). Not covered: the Triton
kernels (matmul_norm's norm backward, FNA's backward row kernels in norm_bwd.py): XLA compiles
their Triton IR, which needs a GPU client.

  PLUGIN=/tmp/g9/whl/p/jax_plugins/xla_cuda12/xla_cuda_plugin.so \
  CUDA_NVCC=/tmp/g9/whl/n/nvidia/cuda_nvcc LD_LIBRARY_PATH=/tmp/g9/fakecuda \
  PYTHONPATH=<tree> python ptxas_all.py OUT_DIR [--only REGEX]
"""
import argparse, ctypes, hashlib, io, os, re, sys, pathlib

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--only", default=None, help="regex over the case names")
args = ap.parse_args()
out_dir = pathlib.Path(args.out).resolve()
out_dir.mkdir(parents=True, exist_ok=True)
os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", JAX_PLATFORMS="cpu",
                  MOSAIC_GPU_DUMP_TO=str(out_dir / "_lowering"))
import jax, jax.numpy as jnp, numpy as np
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

from pallas_norm import _dispatch
_dispatch.on_hopper_gpu = lambda: True  # the export targets an H200
# The Triton kernels of the training forms (FNA's row kernels, matmul_norm's norm backward) lower
# to Triton IR only (compiled later by XLA, not here: no report for them) but ask for the GPU's
# compute capability first: an H200's, so the Mosaic kernels after them are lowered too.
from jax._src.pallas.triton import gpu_info as _gpu_info
_gpu_info.get_gpu_info = lambda: _gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90a",
                                                   compute_capability=90)
sys.path.insert(0, os.getcwd())
from benchmarks import cases as C

MKN = [(262144, 512, 512), (262144, 1024, 1024), (262144, 512, 2048)]
def suite():
  out = []
  for s in MKN:
    out.append(C.Case("gemm", "", C._mkn(*s), "fwd"))
    for op, var in C.FUSED_VARIANTS:
      for mode in C.MODES:
        out.append(C.Case(op, var, C._mkn(*s), mode))
  for h in (2, 4, 8):
    for mode in C.MODES:
      out.append(C.Case("flash_norm_attention", "", C._attn(h, 512), mode))
  for mode in C.MODES:
    out.append(C.Case("gdpa", "", C._attn(4, 512), mode))
  return out

lib = ctypes.CDLL(os.environ["PLUGIN"])
lib.MosaicGpuCompile.argtypes = [ctypes.c_char_p, ctypes.c_int]
lib.MosaicGpuCompile.restype = ctypes.c_void_p

def spec_rand(shape, scale=1.0, offset=0.0):
  return jax.ShapeDtypeStruct(shape, C.DTYPE)

def to_spec(x):
  return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(x.shape, x.dtype)

def export_case(case):
  prob = C.build(case, "mosaic")
  fn = prob.impl_fn("ours" if case.op == "gemm" else "mosaic")
  specs = tuple(to_spec(x) for x in prob.make_set(spec_rand))
  if case.mode == "fwd+bwd":
    diff = prob.diff
    def train(*a):
      def f(*d):
        full = list(a)
        for i, v in zip(diff, d):
          full[i] = v
        return fn(*full)
      y, vjp = jax.vjp(f, *(a[i] for i in diff))
      return vjp(y)
    export.export(jax.jit(train), platforms=["cuda"])(*specs)
  else:
    export.export(jax.jit(fn), platforms=["cuda"])(*specs)

PAT = dict(regs=r"Used (\d+) registers", st=r"(\d+) bytes spill stores", ld=r"(\d+) bytes spill loads")
def parse(d):
  txt = "".join(p.read_text() for p in d.glob("*.ptxas"))
  ptx = b"".join(p.read_bytes() for p in sorted(d.glob("*.ptx")))
  row = {k: (int(m.group(1)) if (m := re.search(p, txt)) else -1) for k, p in PAT.items()}
  row["warn"] = ",".join(sorted(set(re.findall(r"\((C7\d\d\d)\)", txt)))) or "-"
  row["ptx"] = hashlib.sha1(ptx).hexdigest()[:8] if ptx else "-"
  return row

rows = []
for case in suite():
  name = case.name
  if args.only and not re.search(args.only, name):
    continue
  mods.clear()
  try:
    export_case(case)
  except Exception as e:  # report; the Mosaic modules lowered before the failure still count
    # (matmul_norm's training form: its norm backward is a Triton kernel, which lowers only
    # with a GPU present; the Mosaic forward was lowered before it)
    print(f"{name}: export failed after {len(mods)} Mosaic modules: {type(e).__name__}: "
          f"{str(e)[:200]}", file=sys.stderr)
  for i, m in enumerate(mods):
    d = out_dir / name.replace("/", "_") / str(i)
    d.mkdir(parents=True, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(d)
    lib.MosaicGpuCompile(m, len(m))
    rows.append((name, i, parse(d)))
    r = rows[-1][2]
    print(f"{name:58s} {i} regs {r['regs']:4d} spill {r['st']:4d}/{r['ld']:4d} B  {r['warn']:12s} {r['ptx']}", flush=True)

print("\n| case | kernel | registers | spill stores / loads (B) | C75xx | ptx |")
print("|---|---|---|---|---|---|")
for name, i, r in rows:
  print(f"| {name} | {i} | {r['regs']} | {r['st']} / {r['ld']} | {r['warn']} | {r['ptx']} |")
