"""The GDPA forward kernel (pallas_norm.ops.gdpa.mosaic) against the reference.

CPU tests run the kernel in GPU interpret mode with the race detector on and every
uninitialized buffer (SMEM and the output) filled with NaN, so an output row the kernel never
writes shows up as NaN; the padding rows of q and of jagged K/V are NaN too (the kernel must
never let them reach a real row). ``gpu`` tests compile and run the kernel at the issue's sizes
(dense, resident and streamed jagged K/V, every activation): no CPU lowering test duplicates
them.

The oracle is :func:`pallas_norm.reference.gdpa` on float32-upcast inputs. Tolerance: relative
Frobenius error < 2e-2 (P and the output are rounded to bf16/f16; tanh and exp are the GPU's
approximate instructions), and padding rows exactly zero.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_norm as pn
from pallas_norm import jagged, mgpu, reference
from pallas_norm.ops.gdpa import configs, mosaic

TOL = 2e-2


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _problem(seed, q_lens, heads, head_dim, *, kv_lens=None, lkv=64, capacity=None,
             dtype=jnp.bfloat16, kv_capacity=None):
  """Random inputs; q rows and jagged K/V rows past the last offset are NaN."""
  ks = jax.random.split(jax.random.key(seed), 3)
  total = int(np.sum(q_lens))
  capacity = capacity or -(-total // 8) * 8
  q = jax.random.normal(ks[0], (capacity, heads, head_dim), jnp.float32).astype(dtype)
  q = q.at[total:].set(jnp.nan)
  q_offsets = jnp.asarray(jagged.offsets_from_lengths(np.asarray(q_lens)))
  scale = head_dim ** -0.5
  if kv_lens is None:
    shape = (len(q_lens), lkv, heads, head_dim)
    kv_offsets = None
  else:
    kv_total = int(np.sum(kv_lens))
    shape = (kv_capacity or -(-kv_total // 8) * 8 + 8, heads, head_dim)
    kv_offsets = jnp.asarray(jagged.offsets_from_lengths(np.asarray(kv_lens)))
  k = (scale * jax.random.normal(ks[1], shape, jnp.float32)).astype(dtype)
  v = jax.random.normal(ks[2], shape, jnp.float32).astype(dtype)
  if kv_lens is not None:
    k, v = k.at[kv_total:].set(jnp.nan), v.at[kv_total:].set(jnp.nan)
  return q, k, v, q_offsets, kv_offsets


def _check(q, k, v, q_offsets, kv_offsets, *, activation="fast_gelu", pre_scale=1.0,
           post_scale=1.0, max_kv_len=None, out_dtype=None, config=None, interpret=True):
  # Jitted: the wrapper's ops around the kernel compile as one program, not one each.
  out = jax.jit(lambda q, k, v, qo, ko, pre, post: mosaic.gdpa_fwd(
      q, k, v, qo, ko, pre, post, activation=activation, max_kv_len=max_kv_len,
      out_dtype=out_dtype, config=config, interpret=interpret))(
          q, k, v, q_offsets, kv_offsets, jnp.float32(pre_scale), jnp.float32(post_scale))
  out = jax.block_until_ready(out)
  if interpret:
    assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  max_seq_len = max(1, int(np.max(np.diff(np.asarray(q_offsets)))))  # padded oracle: small
  # Jitted: one compiled program instead of one per eager op (most of the oracle's CPU time).
  oracle = jax.jit(lambda q, k, v: reference.gdpa(
      q, k, v, q_offsets, kv_offsets, activation=activation, pre_scale=pre_scale,
      post_scale=post_scale, max_seq_len=max_seq_len, max_kv_len=max_kv_len))
  ref = oracle(f32(q), f32(k), f32(v))
  assert out.shape == q.shape and out.dtype == jnp.dtype(out_dtype or q.dtype)
  got, ref = np.asarray(out, np.float32), np.asarray(ref)
  assert np.isfinite(got).all(), "rows never written (NaN-filled) or NaN leaked"
  total = int(np.asarray(q_offsets)[-1])
  assert not np.any(got[total:] != 0), "padding rows must be zeros"
  assert _rel_err(got[:total], ref[:total]) < TOL
  return out


def test_activations_kernel_forms_match_reference():
  """The kernel's rewritten activations (gelu's erf, relu without custom_jvp) are the same
  functions as the reference's, over the range scores take and far in the tails (fast_gelu's
  fold around z² overflows to inf there: still no NaN where the reference is finite)."""
  s = jnp.concatenate([jnp.linspace(-12.0, 12.0, 4001, dtype=jnp.float32),
                       jnp.array([-1e30, -1e10, -1e4, 1e4, 1e10, 1e30], jnp.float32)])
  for name, fn in reference.ACTIVATIONS.items():
    np.testing.assert_allclose(mosaic.KERNEL_ACTIVATIONS[name](s), fn(s), rtol=1e-6,
                               atol=1e-6, err_msg=name)  # A&S erf: < 1.5e-7 · |s|/2


def test_dense_kv_d128_edge_lengths():
  """Lengths 1, 63, 0, 129 (blocks straddling samples, an empty sample, 3 q blocks over 2
  consumers with one q stage, so the producer waits on releases), spare capacity past the real
  tokens (a padding chunk), D = 128, Lkv = 128 in two 64-key steps."""
  q, k, v, qo, _ = _problem(0, [1, 63, 0, 129], 1, 128, lkv=128, capacity=256)
  _check(q, k, v, qo, None, activation="fast_gelu", pre_scale=0.7, post_scale=1.5,
         config=configs.Config(block_kv=64, q_stages=1))


def test_dense_kv_matches_an_oracle_that_rounds_as_the_kernel():
  """The forward against an oracle rounding where the kernel must (P to q's dtype for the
  tensor core, the output to q's dtype) and nowhere else, with a bound 40× tighter than
  :data:`TOL`: scores rounded to bf16 before the activation passed the reference check (3.2e-3
  against the kernel's own 2.4e-3; a mutation test) and give 3.9e-3 here. Interpret mode sums
  in the oracle's order (0 here); a GPU's order differs, so this runs on the CPU only."""
  q, k, v, qo, _ = _problem(0, [1, 63, 0, 129], 1, 128, lkv=128, capacity=256)
  pre, post = 0.7, 1.5
  out = mosaic.gdpa_fwd(q, k, v, qo, None, jnp.float32(pre), jnp.float32(post),
                        activation="fast_gelu", max_kv_len=None, interpret=True)
  total = int(qo[-1])
  seg = np.asarray(jagged.segment_ids(qo, q.shape[0]))[:total]
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  s = np.einsum("thd,tlhd->thl", f32(q[:total]), f32(k)[seg])
  p = f32(reference.ACTIVATIONS["fast_gelu"](jnp.asarray(pre * s)).astype(q.dtype))
  want = f32(jnp.asarray(post * np.einsum("thl,tlhd->thd", p, f32(v)[seg])).astype(q.dtype))
  assert _rel_err(f32(out[:total]), want) < 5e-4


def test_jagged_kv_f16_unaligned_offsets():
  """Jagged K/V with offsets off the 8-row grid (window edges masked on both sides), an empty
  K/V sample (zeros out), K/V padding rows NaN, float16, 127 q rows (2 blocks)."""
  q, k, v, qo, ko = _problem(2, [127, 5, 9], 1, 64, kv_lens=[3, 70, 0], dtype=jnp.float16)
  _check(q, k, v, qo, ko, activation="gelu", max_kv_len=70)


def test_streamed_kv_ring_wraps():
  """K/V streamed per q block (the path for K/V windows too long for SMEM): 3 q blocks over 2
  consumers, 150 keys (rows 3..152, off the 8-row grid at both ends, NaN padding after them)
  in 3 blocks through 2-slot rings, so the producer waits on the consumers' releases; more
  samples with keys than the 2 CTAs, so the rings' positions carry across items; float32
  output."""
  q, k, v, qo, ko = _problem(9, [4, 129, 9, 30, 1], 1, 64, kv_lens=[3, 150, 66, 1, 70])
  _check(q, k, v, qo, ko, activation="relu2", max_kv_len=160, out_dtype=jnp.float32,
         config=configs.Config(block_kv=64, q_stages=1, kv_stages=2))


def test_nan_kv_stays_in_its_sample():
  """A NaN in the packed K/V of samples 1 (q rows sharing q blocks with samples 0 and 3; keys
  sharing 8-row windows and key blocks with its neighbours') and 2 (no q rows) reaches no
  output row of another sample, as in the reference. (Dense K/V: a work item reads only its
  sample's K/V and stores only its rows.)"""
  q, k, v, qo, ko = _problem(13, [5, 40, 0, 27], 1, 64, kv_lens=[3, 9, 5, 70])
  for s in (1, 2):
    rows = slice(int(ko[s]), int(ko[s + 1]))
    k, v = k.at[rows].set(jnp.nan), v.at[rows].set(jnp.nan)
  out = jax.block_until_ready(mosaic.gdpa_fwd(q, k, v, qo, ko, jnp.float32(0.7),
                                              jnp.float32(1.3), activation="silu",
                                              max_kv_len=None, interpret=True))
  assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  ref = jax.jit(lambda *a: reference.gdpa(  # one program, not one per eager op
      *(x.astype(jnp.float32) for x in a), qo, ko, activation="silu", pre_scale=0.7,
      post_scale=1.3, max_seq_len=40))(q, k, v)
  rows = np.r_[0:5, 45:q.shape[0]]  # samples 0 and 3, and the padding rows
  got = np.asarray(out, np.float32)[rows]
  assert np.all(np.isfinite(got)), "NaN/inf outside the poisoned samples"
  assert _rel_err(got, np.asarray(ref)[rows]) < TOL


def test_persistent_rounds_dense_kv():
  """Many items per CTA (2 persistent CTAs in interpret mode, 9 samples and a padding chunk):
  the next item's K/V loaded into the other of two buffers while the current one runs, buffers
  reused (the producer waits for both consumers' release), items with one q block (consumer 1
  idle), an empty sample, and ring positions carried across items."""
  q, k, v, qo, _ = _problem(11, [70, 5, 64, 1, 0, 33, 130, 9, 17], 1, 64, lkv=128,
                            capacity=344)
  _check(q, k, v, qo, None, activation="silu", pre_scale=0.9,
         config=configs.Config(block_kv=64, q_stages=1, kv_buffers=2))


def test_persistent_rounds_jagged_kv_one_buffer():
  """As above with jagged K/V (odd offsets, an empty K/V sample) and one K/V buffer (the next
  load waits for the current item's release): the V edges zeroed per item in the shared
  buffer."""
  q, k, v, qo, ko = _problem(12, [9, 66, 3, 40, 1, 12, 7], 1, 64,
                               kv_lens=[3, 70, 0, 17, 64, 5, 9])
  _check(q, k, v, qo, ko, activation="fast_gelu", max_kv_len=70,
         config=configs.Config(block_kv=64, q_stages=1, kv_buffers=1))


def test_public_op_kernel_path_grads(seed=4):
  """pn.gdpa with implementation="interpret": forward and backward by the kernels (the
  custom_vjp) against jax.grad of the float32 reference, traced pre/post scales included.
  Then, in the same compiled program (offsets traced; merged from a test of its own that
  compiled the kernels again at other sizes): offsets that break the convention (first != 0
  leaves rows 0..3 outside every sample) give NaN in every output row on the kernel path too,
  with no extra pass over the output, and NaN in every row of every gradient: the backward
  runs on the forward's all-empty samples with NaN scales, so dq's padding rows (0 · pre ·
  post) and dk, dv (zero accumulators times the scales) are NaN, never the zeros that empty
  samples give; so are the gradients of traced scales (they were 0: the poison's select sent
  the caller's scales a zero cotangent; found by a mutation test). One forward kernel run for
  all (the op's output is the custom_vjp's forward rule's)."""
  q, k, v, qo, _ = _problem(seed, [5, 64], 1, 64, lkv=64, capacity=72)
  q = jnp.where(jnp.isnan(q), 0, q)
  weights = jnp.cos(jnp.arange(q.size).reshape(q.shape))

  def loss_and_out(q, k, v, pre, post, offsets):
    out = pn.gdpa(q, k, v, offsets, pre_scale=pre, post_scale=post, activation="silu",
                  implementation="interpret")
    return jnp.sum(out.astype(jnp.float32) * weights), out

  grad_and_out = jax.jit(jax.grad(loss_and_out, argnums=range(5), has_aux=True))

  def ref_out(q, k, v, pre, post):
    return reference.gdpa(q, k, v, qo, None, activation="silu", pre_scale=pre,
                          post_scale=post, max_seq_len=64)

  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  args = (q, k, v, jnp.float32(0.7), jnp.float32(1.3))
  kernel = grad_and_out(*args, qo)[0]
  want = jax.jit(jax.grad(lambda *a: jnp.sum(ref_out(*a) * weights), argnums=range(5)))(
      f32(q), f32(k), f32(v), args[3], args[4])
  for got, ref in zip(kernel[:3], want[:3]):
    assert _rel_err(got, ref) < TOL
  # The scale gradients are sums of terms of both signs that cancel (d post = Σ (o/post) ⊙ g,
  # d pre = Σ (dq/pre) ⊙ q): judged against the size of their terms, not only the sum's (the
  # kernel's bf16 operands make an error of ~2⁻⁹ per term, which a cancelling sum keeps).
  out = jax.jit(ref_out)(f32(q), f32(k), f32(v), args[3], args[4])
  terms = (np.linalg.norm(np.asarray(want[0]) / 0.7 * np.asarray(f32(q))),
           np.linalg.norm(np.asarray(out) / 1.3 * np.asarray(weights)))
  for got, ref, size in zip(kernel[3:], want[3:], terms):
    assert abs(float(got) - float(ref)) <= TOL * (abs(float(ref)) + size), (got, ref, size)
  grads, out = grad_and_out(*args, jnp.array([4, 5, 69], jnp.int32))
  assert bool(jnp.all(jnp.isnan(out)))
  for name, g in zip(("q", "k", "v", "pre_scale", "post_scale"), grads, strict=True):
    assert bool(jnp.all(jnp.isnan(g))), name


def test_unsupported_reasons():
  q = jnp.zeros((64, 2, 96), jnp.bfloat16)
  assert "head dim" in mosaic.unsupported_reason(q, q[None], None, None, None)
  q = jnp.zeros((64, 2, 64), jnp.float32)
  assert "float32" in mosaic.unsupported_reason(q, q[None], None, None, None)
  q = jnp.zeros((60, 2, 64), jnp.bfloat16)
  assert "multiples of 8" in mosaic.unsupported_reason(q, jnp.zeros((1, 64, 2, 64), q.dtype),
                                                       None, None, None)
  q = jnp.zeros((64, 2, 128), jnp.bfloat16)
  long_kv = (q, jnp.zeros((4096, 2, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32), 1024, None)
  assert mosaic.unsupported_reason(*long_kv) is None and mosaic.streams_kv(*long_kv)
  with pytest.raises(NotImplementedError, match="head dim"):
    pn.gdpa(jnp.zeros((64, 2, 96), jnp.bfloat16), jnp.zeros((1, 64, 2, 96), jnp.bfloat16),
            jnp.zeros((1, 64, 2, 96), jnp.bfloat16), jnp.array([0, 64], jnp.int32),
            implementation="interpret")


# ------------------------------------------------------------------------------------------------
# GPU, the sizes.

def _pffn_lengths(seed, batch, lmax, density):
  rng = np.random.default_rng(seed)
  if density >= 1.0:
    return np.full(batch, lmax)
  return rng.integers(1, 2 * int(lmax * density), size=batch).clip(1, lmax)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,density,head_dim", [(4, 0.5, 128), (2, 0.5, 128), (4, 1.0, 128),
                                                    (4, 0.5, 64)])
def test_gpu_dense_kv(heads, density, head_dim):
  lens = _pffn_lengths(0, 768, 512, density)
  q, k, v, qo, _ = _problem(5, lens, heads, head_dim, lkv=128,
                            capacity=-(-int(lens.sum()) // 8) * 8 + 136)
  _check(q, k, v, qo, None, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", sorted(reference.ACTIVATIONS))
def test_gpu_activations(activation):
  lens = _pffn_lengths(1, 64, 512, 0.5)
  q, k, v, qo, _ = _problem(6, lens, 2, 128, lkv=128)
  _check(q, k, v, qo, None, activation=activation, pre_scale=0.5, post_scale=2.0,
         interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("max_kv_len", [128, 200, 520])
def test_gpu_jagged_kv(max_kv_len):
  """Jagged K/V, odd offsets, NaN K/V padding, float16; resident K/V up to 200, streamed at
  520."""
  rng = np.random.default_rng(2)
  lens = rng.integers(0, 300, size=256)
  kv_lens = rng.integers(0, max_kv_len + 1, size=256)
  q, k, v, qo, ko = _problem(7, lens, 4, 128, kv_lens=kv_lens, dtype=jnp.float16)
  _check(q, k, v, qo, ko, activation="silu", max_kv_len=max_kv_len, interpret=False)


@pytest.mark.parametrize("kv_lens,max_kv_len", [([3, 64], 64), ([57, 57], 57)])
def test_jagged_kv_samples_of_exactly_max_kv_len_off_the_row_grid(kv_lens, max_kv_len):
  """A K/V sample of exactly max_kv_len keys that starts off the 8-row grid: its window needs
  max_kv_len + 7 rows (ALIGN − 1 more than the bound; 57 + 7 fills a 64-row window), and
  every key counts (a mutation test dropped the ALIGN − 1 rows, or clipped the window's end one
  row short, unnoticed)."""
  q, k, v, qo, ko = _problem(13, [8, 8], 1, 64, kv_lens=kv_lens)
  _check(q, k, v, qo, ko, activation="identity", max_kv_len=max_kv_len)


def test_config_and_dense_kv_length_refusals():
  """Config refuses a 1-slot K/V ring (None or >= 2); dense K/V whose length is a multiple of
  8 but not of 64 is refused with a reason, so a sequence falls back to XLA's values instead
  of raising from the kernel (mutation tests removed both refusals unnoticed)."""
  with pytest.raises(ValueError, match="kv_stages"):
    configs.Config(kv_stages=1)
  q, k, v, qo, _ = _problem(14, [5, 11], 1, 64, lkv=72)
  q = jnp.where(jnp.isnan(q), 0, q)
  reason = mosaic.unsupported_reason(q, k, None, None, None)
  assert reason is not None and "64" in reason
  np.testing.assert_array_equal(
      np.asarray(pn.gdpa(q, k, v, qo, implementation=("interpret", "xla")), np.float32),
      np.asarray(pn.gdpa(q, k, v, qo, implementation="xla"), np.float32))


@pytest.mark.parametrize("lens,kv_lens,padding", [([70, 9], None, 200),
                                                  ([9, 130, 40], [20, 0, 33], 8)])
def test_items_without_keys_of_several_blocks(lens, kv_lens, padding):
  """Items without keys that span several q blocks, so both consumers store zero blocks (other
  tests have at most one): 200 padding rows after dense samples, a 130-row jagged sample with
  no keys. Those rows exactly 0, no row left unwritten (interpret mode fills NaN), the rest
  against the reference (a mutation test stored consumer 1's zero blocks over consumer 0's
  unnoticed)."""
  total = sum(lens)
  q, k, v, qo, ko = _problem(15, lens, 1, 64, kv_lens=kv_lens,
                             capacity=-(-total // 8) * 8 + padding)
  out = _check(q, k, v, qo, ko, activation="silu", pre_scale=0.7, post_scale=1.3,
               max_kv_len=None if kv_lens is None else max(kv_lens))
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  zero_rows = np.arange(total, q.shape[0])
  if kv_lens is not None:
    zero_rows = np.r_[int(qo[1]):int(qo[2]), zero_rows]
  assert not np.any(out[zero_rows])


def test_edge_calls_found_by_review():
  """Dense K/V with Lkv = 0 falls back to XLA's zeros in a sequence (the kernel refuses it);
  a second derivative of the kernel path raises naming gdpa; bad traced offsets give NaN
  gradients on the XLA path too, also where no row of any sample is left (all q and k, v)."""
  q = jax.random.normal(jax.random.key(0), (64, 2, 64), jnp.bfloat16)
  empty_kv = jnp.zeros((2, 0, 2, 64), jnp.bfloat16)
  off = jnp.array([0, 3, 63], jnp.int32)
  out = pn.gdpa(q, empty_kv, empty_kv, off, implementation=("interpret", "xla"))
  assert out.shape == q.shape and not bool(jnp.any(out != 0))
  assert "Lkv = 0" in mosaic.unsupported_reason(q, empty_kv, None, None, None)
  # T = 0 (a multiple of 8) reached the kernel: ZeroDivisionError in interpret mode, also from
  # a sequence and from flash_norm_attention's chain (review finding).
  dense = q[None, :].reshape(1, 64, 2, 64)
  assert "T = 0" in mosaic.unsupported_reason(q[:0], dense, None, None, None)
  zero = jnp.zeros((2,), jnp.int32)
  for op in (pn.gdpa, pn.flash_norm_attention):
    assert op(q[:0], dense, dense, zero, implementation=("interpret", "xla")).shape == (0, 2, 64)

  k = jax.random.normal(jax.random.key(1), (1, 64, 2, 64), jnp.bfloat16)
  first = lambda q: jnp.sum(pn.gdpa(q, k, k, jnp.array([0, 8], jnp.int32),  # noqa: E731
                                    implementation="interpret").astype(jnp.float32))
  with pytest.raises(NotImplementedError, match="gdpa"):
    jax.grad(lambda q: jnp.sum(jax.grad(first)(q).astype(jnp.float32)))(q[:8])

  kv = jax.random.normal(jax.random.key(2), (16, 2, 64), jnp.bfloat16) / 8
  loss = lambda q, k, v, o, ko, s: jnp.sum(pn.gdpa(  # noqa: E731
      q, k, v, o, ko, pre_scale=s, implementation="xla").astype(jnp.float32))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 5)))(
      q, kv, kv, jnp.array([0, 40, 30], jnp.int32), jnp.array([0, 0, 13], jnp.int32),
      jnp.float32(0.9))
  for g in grads:
    assert bool(jnp.all(jnp.isnan(g)))


@pytest.mark.parametrize("n", [1, 7, 300, mosaic.RANK_BY_COMPARISON_MAX + 5])
def test_work_table_order_is_a_stable_descending_sort(n):
  """The work tables' order by pair counts (and the sort above RANK_BY_COMPARISON_MAX) is
  ``argsort(-keys, stable=True)``, ties (many at small key ranges) in index order."""
  rng = np.random.default_rng(n)
  keys = jnp.asarray(rng.integers(0, 9, n), jnp.int32)
  table = jnp.asarray(rng.integers(-3, 1 << 20, (n, 7)), jnp.int32)
  want = np.asarray(table)[np.argsort(-np.asarray(keys), kind="stable")]
  sort = jax.jit(mosaic.sort_rows_descending)
  np.testing.assert_array_equal(sort(table, keys), want)
  np.testing.assert_array_equal(sort(table[:, 3], keys), want[:, 3])


@pytest.mark.parametrize("n", [1, 7, 300, mosaic.RANK_BY_COMPARISON_MAX + 5])
def test_small_cumsum_and_search_match_numpy(n):
  """The schedules' pairwise cumulative sum and count-at-most (and their fallbacks above
  RANK_BY_COMPARISON_MAX) equal np.cumsum and np.searchsorted(side="right"), zeros and
  repeated values included."""
  rng = np.random.default_rng(n)
  values = rng.integers(0, 9, n).astype(np.int32)
  ends = np.cumsum(values).astype(np.int32)
  np.testing.assert_array_equal(jax.jit(mosaic.cumsum_small)(jnp.asarray(values)), ends)
  points = np.arange(-2, int(ends[-1]) + 3, dtype=np.int32)
  np.testing.assert_array_equal(
      jax.jit(mosaic.count_at_most)(jnp.asarray(ends), jnp.asarray(points)),
      np.searchsorted(ends, points, side="right"))




def test_work_items_samples_longest_first_then_padding_chunks():
  """The work table's first B rows are the samples, longest first (ties in sample order), as
  the backward's dense tile order reads them (their KV_WIN is the sample); then the padding
  chunks in row order, covering [q_offsets[-1], T) exactly."""
  lengths = np.array([5, 0, 130, 5, 64, 0, 77, 130])
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  capacity = 1400
  table = np.asarray(jax.jit(mosaic.work_items, static_argnums=(2, 3, 4))(
      jnp.asarray(offsets), None, capacity, len(lengths), 128))
  batch = len(lengths)
  np.testing.assert_array_equal(table[:batch, mosaic.KV_WIN],
                                np.argsort(-lengths, kind="stable"))
  first = table[:, mosaic.Q_WIN] + table[:, mosaic.Q_LO]
  size = table[:, mosaic.Q_HI] - table[:, mosaic.Q_LO]
  order = np.argsort(-lengths, kind="stable")
  np.testing.assert_array_equal(size[:batch], lengths[order])
  real = lengths[order] > 0  # an empty sample's window says nothing (lo = hi = 0)
  np.testing.assert_array_equal(first[:batch][real], offsets[:-1][order][real])
  chunks = size[batch:] > 0
  assert np.all(np.diff(first[batch:][chunks]) > 0)  # row order
  covered = np.zeros(capacity, bool)
  for lo, n in zip(first[batch:][chunks], size[batch:][chunks]):
    assert not covered[lo:lo + n].any()
    covered[lo:lo + n] = True
  assert covered[offsets[-1]:].all() and not covered[:offsets[-1]].any()


def test_zero_heads_raise_before_any_kernel():
  """q of shape (T, 0, D) (H = 0) reached the kernel, whose interpret mode raised
  ZeroDivisionError from Pallas' block padding, also from a sequence ("interpret", "xla")
  (review12). The op now refuses it as it refuses D = 0, with a ValueError naming q, whatever
  the implementation asked for."""
  q = jnp.zeros((16, 0, 64), jnp.bfloat16)
  dense = jnp.zeros((2, 64, 0, 64), jnp.bfloat16)
  jagged_kv = jnp.zeros((16, 0, 64), jnp.bfloat16)
  off = jnp.array([0, 5, 14], jnp.int32)
  for k, kv_off in ((dense, None), (jagged_kv, off)):
    for implementation in ("interpret", ("interpret", "xla"), None):
      with pytest.raises(ValueError, match="q has no heads"):
        pn.gdpa(q, k, k, off, kv_off, implementation=implementation)
