"""Dev A/B (not committed): the fused forward kernel alone, old (f32 u live across the
attention) vs new (u recomputed from the residual copy), save_attn off/on, H 4 and 2, issue
shape; outputs of new vs old compared first. Then the backward row kernels alone at H4."""
import importlib.util, sys, time
import numpy as np
import jax, jax.numpy as jnp
from benchmarks import timing
from pallas_norm import jagged
from pallas_norm.ops.flash_norm_attention import mosaic as new, norm_bwd

spec = importlib.util.spec_from_file_location("old_mosaic", "scratch_fna_old_mosaic.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_mosaic"] = old; spec.loader.exec_module(old)
rng = np.random.default_rng(768 * 7919 + 512)
lens = rng.integers(1, 513, size=768)
cap = -(-int(lens.sum()) // 128) * 128
offs = jnp.asarray(jagged.offsets_from_lengths(lens))
t0 = time.time()

def inputs(h, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (cap, h, 128), jnp.bfloat16)
  k = (jax.random.normal(ks[1], (768, 128, h, 128)) / 11.3).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (768, 128, h, 128), jnp.bfloat16)
  aff = 1 + 0.1 * jax.random.normal(ks[3], (3, h, 128))
  aff = aff.at[1].add(-1)
  return q, k, v, offs, aff

def forward_ab(h):
  sets = [inputs(h, s) for s in range(3)]
  for save in (False, True):
    res = {}
    for name, mod in (("old", old), ("new", new)):
      fn = jax.jit(lambda q, k, v, o, a, mod=mod, save=save: mod.flash_norm_attention_fwd(
          q, k, v, o, a, 1.0, 1.0, activation="fast_gelu", eps=1e-6, save_attn=save))
      outs = jax.block_until_ready(fn(*sets[0]))
      us = timing.median(timing.measure_us(fn, sets, 10, "cupti"))
      res[name] = (outs, us)
    (o_old, _), (o_new, _) = res["old"], res["new"]
    errs = [float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                  / jnp.linalg.norm(b.astype(jnp.float32).ravel())) for a, b in zip(o_new, o_old)]
    print(f"H{h} save_attn={save}: old {res['old'][1]:.1f} us, new {res['new'][1]:.1f} us; "
          f"new vs old rel err {['%.1e' % e for e in errs]}  [{time.time()-t0:.0f}s]", flush=True)


forward_ab(4)
# The backward row kernels alone at H4 (bf16), CUPTI.
h, n = 4, 512
q, k, v, o, aff = inputs(4, 0)
out, stats, attn = jax.jit(lambda *a: new.flash_norm_attention_fwd(
    *a, 1.0, 1.0, activation="fast_gelu", eps=1e-6, save_attn=True))(q, k, v, o, aff)
g = jax.random.normal(jax.random.key(9), (cap, n), jnp.bfloat16)
rows = lambda a: a.reshape(cap, n)
affine = tuple(aff.reshape(3, n))
end = o[-1]
rms = jax.jit(lambda g, q, attn, stats: norm_bwd.rms_backward(
    g, q, attn, stats, affine, end, pre_layer_norm=True, inner_residual=True))
dz, u, _ = rms(g, rows(q), rows(attn), stats)
us = timing.median(timing.measure_us(rms, [(g, rows(q), rows(attn), stats)], 10, "cupti"))
print(f"rms_backward H4: {us:.1f} us (5 x {cap * n * 2 / 1e6:.0f} MB: floor "
      f"{5 * cap * n * 2 / 4.29e9 * 1e6:.0f} us at 4290 GB/s)", flush=True)
ln = jax.jit(lambda du, dz, g, q, stats: norm_bwd.ln_backward(
    du, dz, g, q, stats, affine[0], end, 0.0, inner_residual=True, outer_residual=True))
us = timing.median(timing.measure_us(ln, [(dz, dz, g, rows(q), stats)], 10, "cupti"))
print(f"ln_backward H4: {us:.1f} us  [{time.time()-t0:.0f}s]", flush=True)

forward_ab(2)
