"""Scratch A/B (not committed): fused FNA forward, dynamic head loop (HEAD) vs static unroll."""
import sys, time
import numpy as np, jax, jax.numpy as jnp
import pallas_norm as pn
from pallas_norm import jagged, reference
from pallas_norm.ops.flash_norm_attention import mosaic as new
import scratch_fna_static as old
from benchmarks import timing

def rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

for H in (4, 2):
  rng = np.random.default_rng(768 * 7919 + 512)
  lens = rng.integers(1, 513, size=768)
  T = -(-int(lens.sum()) // 128) * 128
  qo = jnp.asarray(jagged.offsets_from_lengths(lens))
  ks = jax.random.split(jax.random.key(0), 6)
  q = jax.random.normal(ks[0], (T, H, 128), jnp.bfloat16)
  k = (jax.random.normal(ks[1], (768, 128, H, 128)) / 11.3).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (768, 128, H, 128), jnp.bfloat16)
  aff = jnp.stack([1 + 0.1 * jax.random.normal(ks[3], (H * 128,)), 0.1 * jax.random.normal(ks[4], (H * 128,)), 1 + 0.1 * jax.random.normal(ks[5], (H * 128,))]).reshape(3, H, 128)
  kw = dict(activation="fast_gelu", eps=1e-6)
  f_new = jax.jit(lambda q, k, v, o, a: new.flash_norm_attention_fwd(q, k, v, o, a, 1.0, 1.0, **kw)[0])
  f_old = jax.jit(lambda q, k, v, o, a: old.flash_norm_attention_fwd(q, k, v, o, a, 1.0, 1.0, **kw)[0])
  f_train = jax.jit(lambda q, k, v, o, a: new.flash_norm_attention_fwd(q, k, v, o, a, 1.0, 1.0, save_attn=True, **kw)[0])
  g1, b1, g2 = aff.reshape(3, -1)
  f_ref = jax.jit(lambda q, k, v, o: reference.flash_norm_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), o, ln_scale=g1, ln_bias=b1, rms_scale=g2, max_seq_len=512))
  args = (q, k, v, qo, aff)
  ref = f_ref(q, k, v, qo)
  n = int(lens.sum())
  f_s2 = jax.jit(lambda q, k, v, o, a: new.flash_norm_attention_fwd(q, k, v, o, a, 1.0, 1.0, config=new.Config(64, 2), **kw)[0])
  fs = [("dynamic", f_new), ("static", f_old), ("dynamic+attn", f_train)] + ([("dynamic kv_stages=2", f_s2)] if H == 2 else [])
  for name, f in fs:
    out = f(*args)
    err = rel(out[:n], ref[:n])
    t = timing.median(timing.measure_us(f, [args], 10, "cupti"))
    print(f"H{H} {name}: {t:.1f} us, rel err {err:.2e}", flush=True)
