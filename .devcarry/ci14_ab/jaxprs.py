"""Dumps str(jax.make_jaxpr(...)) of the norms' and flash_norm_attention's kernel paths to
argv[1], one section per case: run on the tree before and after a refactor and diff.
argv[2]: "interpret" (default; any backend) or "gpu" (the kernels' names: "triton" for the
norms, "mosaic" for the others)."""
import sys
import numpy as np
import jax
import jax.numpy as jnp
import pallas_norm as pn
from pallas_norm import jagged
from pallas_norm.ops.norms import api as norms_api

bf = jnp.bfloat16
out = {}
GPU = len(sys.argv) > 2 and sys.argv[2] == "gpu"
NORM_IMPL = "triton" if GPU else "interpret"
IMPL = "mosaic" if GPU else "interpret"


def case(name, f, *args):
  try:
    out[name] = str(jax.make_jaxpr(f)(*args))
  except Exception as e:  # noqa: BLE001
    out[name] = f"ERROR {type(e).__name__}: {e}"


rng = np.random.default_rng(0)
def arr(shape, dtype=bf):
  return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)

for norm_name, op in (("layer", pn.layer_norm), ("rms", pn.rms_norm)):
  for shape in ((64, 256), (2, 16384)):
    for dtype in (bf, jnp.float32):
      x, s, b, r = arr(shape, dtype), arr(shape[-1:]), arr(shape[-1:]), arr(shape, dtype)
      kw = dict(bias=b) if norm_name == "layer" else {}
      def loss(x, s, *extra, op=op, kw=kw):
        y = op(x, s, implementation=NORM_IMPL, **kw)
        return jnp.sum(y.astype(jnp.float32) ** 2)
      case(f"{norm_name} grad {shape} {jnp.dtype(dtype)}", jax.grad(loss, argnums=(0, 1)), x, s)
      if shape[-1] <= 8192:
        def loss_r(x, s, r, op=op, kw=kw):
          y, st = op(x, s, residual=r, zero_centered_scale=True, implementation=NORM_IMPL,
                     **kw)
          return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(st.astype(jnp.float32))
        case(f"{norm_name} grad residual {shape} {jnp.dtype(dtype)}",
             jax.grad(loss_r, argnums=(0, 1, 2)), x, s, r)
        # The by-use path: XLA's forward, the kernels' training.
        def by_use(x, s, norm_name=norm_name):
          return jnp.sum(norms_api._run(("xla", NORM_IMPL), x, s, None, None, norm_name, 1e-6,
                                        False, None).astype(jnp.float32) ** 2)
        case(f"{norm_name} by_use {shape} {jnp.dtype(dtype)}", jax.value_and_grad(by_use), x, s)
      case(f"{norm_name} fwd only {shape} {jnp.dtype(dtype)}",
           lambda x, s, op=op: op(x, s, implementation=NORM_IMPL), x, s)

# The direct entry with the forward kernel at a small N (tests call it so).
entry = getattr(norms_api, "row_norm", None)
if entry is None:
  from pallas_norm.ops.norms import triton as _t
  entry = _t.row_norm
x, s = arr((64, 256)), arr((256,))
case("row_norm forward=kernel", jax.grad(lambda x, s: jnp.sum(entry(
    x, s, None, None, norm="layer", eps=1e-6, interpret=not GPU, forward="kernel").astype(
        jnp.float32) ** 2), argnums=(0, 1)), x, s)

# matmul_norm's backward (norms triton.norm_backward), interpret.
xm, w = arr((128, 128)), arr((128, 128)) * 0.1
case("matmul_norm grad", jax.grad(lambda x, w: jnp.sum(pn.matmul_norm(
    x, w, norm="layer", implementation=IMPL).astype(jnp.float32) ** 2), argnums=(0, 1)),
    xm, w)

# flash_norm_attention: the chain (jagged K/V) and the fused path, traced offsets.
heads, hd = 2, 64
q = arr((80, heads, hd))
qo = jnp.asarray(jagged.offsets_from_lengths(np.array([5, 60])))
ko = jnp.asarray(jagged.offsets_from_lengths(np.array([40, 17])))
k, v = arr((64, heads, hd)) * 0.125, arr((64, heads, hd))
f = heads * hd
aff = dict(ln_scale=arr((f,), jnp.float32), ln_bias=arr((f,), jnp.float32),
           rms_scale=arr((f,), jnp.float32))

def chain(q, k, v, qo, ko):
  return jnp.sum(pn.flash_norm_attention(q, k, v, qo, ko, max_seq_len=64, max_kv_len=64,
                                         implementation=IMPL, **aff).astype(jnp.float32))
case("fna chain grad", jax.grad(chain, argnums=(0, 1, 2)), q, k, v, qo, ko)
kd, vd = arr((2, 64, heads, hd)) * 0.125, arr((2, 64, heads, hd))
def fused(q, k, v, qo):
  return jnp.sum(pn.flash_norm_attention(q, k, v, qo, max_seq_len=64,
                                         implementation=IMPL, **aff).astype(jnp.float32))
case("fna fused grad", jax.grad(fused, argnums=(0, 1, 2)), q, kd, vd, qo)
def gdpa(q, k, v, qo):
  return jnp.sum(pn.gdpa(q, k, v, qo, max_seq_len=64, implementation=IMPL).astype(
      jnp.float32))
case("gdpa grad", jax.grad(gdpa, argnums=(0, 1, 2)), q, kd, vd, qo)

# implementation=None at shapes of the measured domains (abstract: no arrays), training and the
# forward alone: on a Hopper GPU the kernels' paths, elsewhere XLA's.
for norm_name, op, shape in (("layer", pn.layer_norm, (65536, 1024)),
                             ("rms", pn.rms_norm, (262144, 1024)),
                             ("rms", pn.rms_norm, (16384, 32768))):
  xs = jax.ShapeDtypeStruct(shape, bf)
  ss = jax.ShapeDtypeStruct(shape[-1:], bf)
  case(f"{norm_name} default grad {shape}", jax.grad(lambda x, s, op=op: jnp.sum(
      op(x, s).astype(jnp.float32) ** 2), argnums=(0, 1)), xs, ss)
  case(f"{norm_name} default fwd {shape}", lambda x, s, op=op: op(x, s), xs, ss)

with open(sys.argv[1], "w") as fh:
  for name, text in out.items():
    fh.write(f"=== {name}\n{text}\n")
for name, text in out.items():
  print(name, len(text), text[:80].replace("\n", " ") if text.startswith("ERROR") else "")
print("pallas_norm from", pn.__file__, "backend", jax.default_backend(), "mode",
      "gpu" if GPU else "interpret")
