"""What every op's kernel path shares below the implementation choice (:mod:`._dispatch`).

:func:`first_order_only`: the kernel paths are ``custom_vjp``s whose rules call Pallas kernels
(Mosaic GPU, or Triton for ``layer_norm``'s backward), which have no derivative of their own.
Differentiating them again (``jax.hessian``, a gradient of a gradient) used to fail deep inside
JAX ("Differentiation rule for 'mpmd_map' not implemented"); each kernel call goes through this
wrapper, so such a derivative raises a NotImplementedError that names the op and says what to
use instead.

Plain forward mode (``jax.jvp``, ``jax.jacfwd``) of a kernel path never reaches this wrapper: JAX
runs the ``custom_vjp``'s forward rule on the primals only and then raises its own TypeError
("can't apply forward-mode autodiff (jvp) to a custom_vjp function") when it evaluates, or under
``jax.jit`` lowers, the linear part -- outside the op, so the op cannot reword it. The fix is the
same: ``implementation="xla"``.

:func:`by_use`: one call that runs one implementation when it is not differentiated and another
under reverse-mode differentiation (``implementation=None`` where the forward alone and training
were measured fastest on different paths, :func:`pallas_norm._dispatch.choose_by_use`).
"""

from __future__ import annotations

import jax

SECOND_ORDER_HINT = (
    "its kernel paths have first-order reverse-mode derivatives only (jax.grad, jax.vjp); "
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


def by_use(forward, training, *args):
  """``forward(*args)`` when the call is not differentiated; under reverse mode (``jax.grad``,
  ``jax.vjp``) ``training``'s forward and its backward (``jax.vjp(training, *args)``).

  ``args`` are the differentiable inputs (arrays or None); both functions close over nothing
  traced and return the same structure, shapes and dtypes (their values may differ by
  rounding: the forward of an evaluation and of a training step can then differ in the last
  bit of a 16-bit output). Being a ``custom_vjp``, the result has no forward-mode derivative
  (``jax.jvp`` raises JAX's TypeError), as every kernel path.
  """
  @jax.custom_vjp
  def call(*args):
    return forward(*args)

  def call_fwd(*args):
    return jax.vjp(training, *args)  # (outputs, the backward as a pytree of its residuals)

  def call_bwd(backward, cotangents):
    return backward(cotangents)

  call.defvjp(call_fwd, call_bwd)
  return call(*args)
