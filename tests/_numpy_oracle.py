"""Independent float64 numpy formulas of every pallas-norm op: the oracle of the CPU tests.

Written from the math in DESIGN.md ("Notation", "The ops") and the jagged convention of
:mod:`pallas_norm.jagged`, not from :mod:`pallas_norm.reference`, so that a slip in the reference
has to be repeated here to go unnoticed. Inputs may be any array (jax, numpy, bfloat16): they are
converted to float64 first, so the oracle sees exactly the (already rounded) values the op sees.
Per-sample python loops keep the jagged formulas obvious rather than fast: keep shapes small.
"""

from __future__ import annotations

import math
import zlib

import chex
import numpy as np


def f64(a):
  """float64 numpy copy of an array (None stays None)."""
  return None if a is None else np.asarray(a).astype(np.float64)


def row_stats(s, norm: str, eps: float):
  """(mean or None, rstd) over the last axis; the mean and variance in float64 (two-pass)."""
  if norm == "rms":
    return None, 1.0 / np.sqrt(np.mean(s * s, axis=-1) + eps)
  mean = np.mean(s, axis=-1)
  var = np.mean((s - mean[..., None]) ** 2, axis=-1)
  return mean, 1.0 / np.sqrt(var + eps)


def normalize(s, norm: str, eps: float, scale=None, bias=None, zero_centered_scale=False):
  """norm(s)·γ + β with γ = 1 + scale when zero-centered; returns (y, mean, rstd)."""
  mean, rstd = row_stats(s, norm, eps)
  centered = s if mean is None else s - mean[..., None]
  y = centered * rstd[..., None]
  if scale is not None:
    y = y * ((1.0 + f64(scale)) if zero_centered_scale else f64(scale))
  if bias is not None:
    y = y + f64(bias)
  return y, mean, rstd


def rms_norm(x, scale=None, residual=None, *, eps=1e-6, zero_centered_scale=False):
  """Returns (y, s, rstd) with s = x (+ residual)."""
  s = f64(x) if residual is None else f64(x) + f64(residual)
  y, _, rstd = normalize(s, "rms", eps, scale, None, zero_centered_scale)
  return y, s, rstd


def layer_norm(x, scale=None, bias=None, residual=None, *, eps=1e-6, zero_centered_scale=False):
  """Returns (y, s, mean, rstd) with s = x (+ residual)."""
  s = f64(x) if residual is None else f64(x) + f64(residual)
  y, mean, rstd = normalize(s, "layer", eps, scale, bias, zero_centered_scale)
  return y, s, mean, rstd


def norm_matmul(x, w, scale=None, bias=None, *, norm="rms", eps=1e-6):
  """Pre-norm GEMM y = (norm(x)·γ + β) @ W. Returns (y, mean, rstd)."""
  xn, mean, rstd = normalize(f64(x), norm, eps, scale, bias)
  return xn @ f64(w), mean, rstd


def norm_matmul_folded(x, w, scale=None, bias=None, *, norm="rms", eps=1e-6):
  """The same y by DESIGN.md's lazy form: r ⊙ (x @ W_γ − μ ⊗ c) + b, W_γ = diag(γ) W,
  c = 1ᵀ W_γ, b = βᵀ W. Cross-checks the oracle itself; float64 only (no rounding of norm(x))."""
  x, w = f64(x), f64(w)
  w_g = w if scale is None else f64(scale)[:, None] * w
  mean, rstd = row_stats(x, norm, eps)
  acc = x @ w_g
  if mean is not None:
    acc = acc - mean[..., None] * w_g.sum(axis=0)
  y = rstd[..., None] * acc
  return y if bias is None else y + f64(bias) @ w


def matmul_norm(x, w, dense_bias=None, residual=None, scale=None, bias=None, *, norm="layer",
                eps=1e-6):
  """Post-norm GEMM h = x @ W (+ dense_bias) (+ residual), y = norm(h)·γ + β.

  Returns (y, h, mean, rstd)."""
  h = f64(x) @ f64(w)
  if dense_bias is not None:
    h = h + f64(dense_bias)
  if residual is not None:
    h = h + f64(residual)
  y, mean, rstd = normalize(h, norm, eps, scale, bias)
  return y, h, mean, rstd


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _relu(s):
  return np.maximum(s, 0.0)


ACTIVATIONS = {
    # tanh approximation of GELU (Hendrycks & Gimpel), the "fast" GELU.
    "fast_gelu": lambda s: 0.5 * s * (1.0 + np.tanh(_SQRT_2_OVER_PI * (s + 0.044715 * s**3))),
    "gelu": lambda s: 0.5 * s * (1.0 + _erf(s / math.sqrt(2.0))),
    "silu": lambda s: s / (1.0 + np.exp(-s)),
    "relu": _relu,
    "relu2": lambda s: _relu(s) ** 2,
    "leaky_relu": lambda s: np.where(s >= 0, s, 0.01 * s),
    "identity": lambda s: s,
}


def _sample_kv(k, v, kv_offsets, b):
  if kv_offsets is None:
    return k[b], v[b]
  lo, hi = int(kv_offsets[b]), int(kv_offsets[b + 1])
  return k[lo:hi], v[lo:hi]


def gdpa(q, k, v, q_offsets, kv_offsets=None, *, activation="fast_gelu", pre_scale=1.0,
         post_scale=1.0):
  """o_h = post_scale · act(pre_scale · q_h k_hᵀ) v_h per sample; padding rows stay zero.

  q (T, H, D) packed; k, v dense (B, L, H, D) or packed (Tkv, H, D) with kv_offsets."""
  q, k, v = f64(q), f64(k), f64(v)
  q_off = np.asarray(q_offsets)
  kv_off = None if kv_offsets is None else np.asarray(kv_offsets)
  act = ACTIVATIONS[activation]
  out = np.zeros_like(q)
  for b in range(q_off.shape[0] - 1):
    lo, hi = int(q_off[b]), int(q_off[b + 1])
    kb, vb = _sample_kv(k, v, kv_off, b)
    s = np.einsum("lhd,jhd->hlj", q[lo:hi], kb)
    out[lo:hi] = post_scale * np.einsum("hlj,jhd->lhd", act(pre_scale * s), vb)
  return out


def flash_norm_attention(q, k, v, q_offsets, kv_offsets=None, *, ln_scale=None, ln_bias=None,
                         rms_scale=None, activation="fast_gelu", pre_scale=1.0, post_scale=1.0,
                         eps=1e-6):
  """u = LN(q)·γ1 + β1, z = u + gdpa(u, k, v), out = RMS(z)·γ2 + q over all H·D features.

  Returns (out, (ln_mean, ln_rstd), rms_rstd); padding rows of out are zero (stats of padding
  rows are whatever the formula gives and are not compared)."""
  q = f64(q)
  t, h, d = q.shape
  qf = q.reshape(t, h * d)
  u, ln_mean, ln_rstd = normalize(qf, "layer", eps, ln_scale, ln_bias)
  attn = gdpa(u.reshape(t, h, d), k, v, q_offsets, kv_offsets, activation=activation,
              pre_scale=pre_scale, post_scale=post_scale).reshape(t, h * d)
  z = u + attn
  y, _, rms_rstd = normalize(z, "rms", eps, rms_scale)
  out = (y + qf).reshape(t, h, d)
  out[int(np.asarray(q_offsets)[-1]):] = 0.0
  return out, (ln_mean, ln_rstd), rms_rstd


# ---- comparison and data helpers shared by the CPU tests ------------------------------------


def assert_close(actual, expected, tol: float, what: str = "") -> None:
  """Elementwise |actual - expected| <= tol·(|expected| + max(1, max|expected|)).

  The absolute part is scaled by the largest expected magnitude, so one ``tol`` per input dtype
  (a count of that dtype's rounding steps) covers outputs of any size, including the entries of
  a product that cancel to near zero."""
  expected = f64(expected)
  scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
  chex.assert_trees_all_close(f64(actual), expected, rtol=tol, atol=tol * scale,
                              custom_message=what or None)


def seed_of(text: str) -> int:
  """A stable per-test seed: every test draws its own fresh random inputs."""
  return zlib.crc32(text.encode())
