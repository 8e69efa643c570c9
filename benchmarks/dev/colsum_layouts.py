"""Diagnostic (session 6): column sums of a (128, 64) bf16 SMEM tile by two warpgroups, each
over its 64 rows, in three forms; prints each form's max error against NumPy.
  A  WGMMA_TRANSPOSED load, jnp.sum(axis=0), store
  B  WGMMA load, jnp.sum(axis=0) (cross-warp SMEM scratch, shared by the warpgroups), store
  C  as A, read-modify-write into zeroed SMEM, twice (so the result is 2x)
  D  as B, warpgroup 1's scratch moved past a padding allocation (run_scoped)
    PYTHONPATH=$PWD python3 benchmarks/dev/colsum_layouts.py
"""
import functools
import jax, jax.numpy as jnp, numpy as np
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax
from pallas_norm import mgpu_common

F32 = jnp.float32


def run(form, threads=2):
  tr, wgmma = plgpu.Layout.WGMMA_TRANSPOSED, plgpu.Layout.WGMMA

  def kernel(x_gmem, o_gmem):
    tf = mgpu_common.swizzle_transforms(64, jnp.bfloat16)

    @functools.partial(pl.run_scoped, x_smem=plgpu.SMEM((128, 64), jnp.bfloat16, transforms=tf),
                       o_smem=plgpu.SMEM((2, 64), F32), bar=plgpu.Barrier(num_arrivals=1),
                       collective_axes="wg")
    def _(x_smem, o_smem, bar):
      wg = lax.axis_index("wg")
      @pl.when(wg == 0)
      def _():
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar)
      plgpu.barrier_wait(bar)
      rows = x_smem.at[pl.ds(wg * 64, 64)]
      if form == "B":
        o_smem[wg] = jnp.sum(plgpu.load(rows, layout=wgmma).astype(F32), axis=0)
      elif form == "A":
        o_smem[wg] = jnp.sum(plgpu.load(rows, layout=tr).astype(F32), axis=0)
      elif form == "D":  # B, with warpgroup 1's scratch moved past a padding allocation
        red = lambda: jnp.sum(plgpu.load(rows, layout=wgmma).astype(F32), axis=0)
        o_smem[wg] = lax.cond(wg == 0, red, lambda: pl.run_scoped(
            lambda pad: red(), plgpu.SMEM((1024,), F32)))
      else:
        o_smem[wg] = plgpu.layout_cast(jnp.zeros((64,), F32), tr.reduce(0))
        for _ in range(2):
          part = jnp.sum(plgpu.load(rows, layout=tr).astype(F32), axis=0)
          o_smem[wg] = plgpu.load(o_smem.at[wg], layout=tr.reduce(0)) + part
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[wg])
      plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((2, 64), F32), grid=(1,),
                      grid_names=("x",), num_threads=threads, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(
                          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  x = jax.random.normal(jax.random.key(0), (128, 64), F32).astype(jnp.bfloat16)
  want = np.asarray(x, np.float64).reshape(2, 64, 64).sum(axis=1) * (2 if form == "C" else 1)
  got = np.asarray(jax.jit(call)(x), np.float64)
  if threads == 1:  # only warpgroup 0 ran: row 0 of the output
    got, want = got[:1], want[:1]
  print(form, "max err", float(np.max(np.abs(got - want))), "max |want|",
        float(np.max(np.abs(want))), "got[0,:4]", got[0, :4], "want[0,:4]", want[0, :4],
        flush=True)


for form, threads in [("A", 2), ("B", 2), ("C", 2), ("D", 2), ("A", 1), ("B", 1), ("C", 1)]:
  print("threads", threads, end=" ")
  try:
    run(form, threads)
  except Exception as e:  # noqa: BLE001
    print(form, "error", type(e).__name__, str(e)[:300], flush=True)
