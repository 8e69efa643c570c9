"""Interpret-mode outputs of the changed kernels, hashed: run once per tree and compare.

  PJRT_NPROC=8 python bitid.py TREE   (prints one digest per case)

Cases: the FNA cluster forward at H = 1 (interpret mode's only cluster size; inference form and
save_residuals form, resident K/V), the post-norm forward (matmul_norm, layer+res and rms, at
tiny shapes), the pre-norm dx kernel through norm_matmul's vjp (layer)."""
import hashlib, sys
import numpy as np
tree = sys.argv[1]
sys.path.insert(0, tree)
import jax, jax.numpy as jnp
import pallas_norm as pn
from pallas_norm.ops.flash_norm_attention import cluster
assert pn.__file__.startswith(tree), pn.__file__
only = sys.argv[2] if len(sys.argv) > 2 else ""
rng = np.random.default_rng(0)
bf = jnp.bfloat16


def n(s, sc=1.0, off=0.0):
  return jnp.asarray((sc * rng.standard_normal(s, np.float32) + off).astype(bf))


def digest(xs):
  h = hashlib.sha256()
  for x in jax.tree.leaves(xs):
    h.update(np.asarray(x).tobytes())
  return h.hexdigest()[:16]


def fna_cluster(save):
  lens = [5, 70, 0, 9]; t = 128; d = 128; h = 1
  offs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
  q, k, v = n((t, h, d), 1.0, 0.3), n((len(lens), 128, h, d), d ** -0.5), n((len(lens), 128, h, d))
  affine = jnp.stack([n((h, d), 0.1, 1.0), n((h, d), 0.1), n((h, d), 0.1, 1.0)]).astype(jnp.float32)
  return cluster.flash_norm_attention_fwd(
      q, k, v, offs, affine, jnp.float32(0.9), jnp.float32(1.1), activation="fast_gelu",
      eps=1e-5, save_residuals=save, interpret=True)


def matmul_norm(norm, res):
  m, k, nn = 256, 128, 256
  x, w = n((m, k)), n((k, nn), k ** -0.5)
  r = n((m, nn)) if res else None
  return pn.matmul_norm(x, w, residual=r, scale=n((nn,), 0.1, 1.0),
                        norm_bias=n((nn,), 0.1) if norm == "layer" else None, norm=norm,
                        implementation="interpret")


def norm_matmul_grads(norm, k, nn):
  m = 256
  x, w, s = n((m, k)), n((k, nn), k ** -0.5), n((k,), 0.1, 1.0)
  b = n((k,), 0.1) if norm == "layer" else None
  f = lambda x, w, s, b: pn.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm,
                                        implementation="interpret").astype(jnp.float32).sum()
  return jax.grad(f, argnums=(0, 1, 2) + ((3,) if b is not None else ()))(x, w, s, b)


cases = {
    "fna_cluster_h1": lambda: fna_cluster(False),
    "fna_cluster_h1_saved": lambda: fna_cluster(True),
    "matmul_norm_layer_res": lambda: matmul_norm("layer", True),
    "matmul_norm_rms": lambda: matmul_norm("rms", False),
    "norm_matmul_layer_dx": lambda: norm_matmul_grads("layer", 128, 128),
}
for name, fn in cases.items():
  if only and only not in name:
    continue
  print(name, digest(jax.block_until_ready(fn())), flush=True)
