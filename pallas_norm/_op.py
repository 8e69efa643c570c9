"""What every op's kernel path shares below the implementation choice (:mod:`._dispatch`).

:func:`first_order_only`: the kernel paths are ``custom_vjp``s whose rules call Mosaic-GPU
kernels, which have no derivative of their own. Differentiating them again (``jax.jvp``,
``jax.hessian``, a gradient of a gradient) used to fail deep inside JAX ("Differentiation rule
for 'mpmd_map' not implemented"); each kernel call goes through this wrapper, so such a
derivative raises a NotImplementedError that names the op and says what to use instead.
"""

from __future__ import annotations

import jax

SECOND_ORDER_HINT = (
    "the Mosaic kernels have first-order reverse-mode derivatives only (jax.grad, jax.vjp); "
    "for jax.jvp, jax.hessian or a gradient of a gradient pass implementation='xla'")


def first_order_only(op: str, kernel, *args):
  """``kernel(*args)``, whose own derivative raises NotImplementedError naming ``op``.

  The kernel runs inside a ``custom_vjp`` rule, so first-order reverse mode never
  differentiates it; only a second (or forward-mode) derivative reaches this rule.
  """
  @jax.custom_jvp
  def call(*args):
    return kernel(*args)

  @call.defjvp
  def _no_derivative(primals, tangents):
    del primals, tangents
    raise NotImplementedError(f"{op}: {SECOND_ORDER_HINT}")

  return call(*args)
