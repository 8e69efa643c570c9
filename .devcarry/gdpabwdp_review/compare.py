import sys, os, json
import numpy as np
sys.path.insert(0, "/work/wt-gdpabwdp"); sys.path.insert(0, "/work/wt-gdpabwdp/tests")
os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
import jax, jax.numpy as jnp
src = open("/tmp/fuzz/fuzz.py").read()
ns = {"np": np, "jnp": jnp}
exec(src[src.index("def make_case"):src.index("def run")], ns)
import test_gdpa_bwd_kernel as T
ids = [int(x) for x in sys.argv[1].split(",")] if "-" not in sys.argv[1] else range(*map(int, sys.argv[1].split("-")))
bad_cases = []
for i in ids:
  fb, fm = f"/tmp/fuzz/br/case{i}.npz", f"/tmp/fuzz/mn/case{i}.npz"
  if not os.path.exists(fb): continue
  c = ns["make_case"](i)
  b = np.load(fb); outs = [b[f"o{j}"] for j in range(5)]
  msgs = []
  if os.path.exists(fm):
    m = np.load(fm)
    for j in range(5):
      x, y = b[f"o{j}"], m[f"o{j}"]
      if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
        msgs.append(f"o{j} differs from main (maxdiff {np.nanmax(np.abs(x - y)) if x.shape == y.shape and x.size else 'shape'})")
  else:
    msgs.append("no main output")
  q, k, v, qo, ko, do = ns["inputs"](c, i)
  dq, dk, dv = outs[:3]
  if c["bad"]:
    for n, x in zip(("dq", "dk", "dv"), (dq, dk, dv)):
      if not np.all(np.isnan(x)): msgs.append(f"bad offsets: {n} not all NaN ({np.sum(~np.isnan(x))} finite)")
  else:
    ref, terms = T._reference_grads(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(qo),
                                    None if ko is None else jnp.asarray(ko), jnp.asarray(do), c["act"], 0.7, 1.3)
    total = int(qo[-1])
    want_dq = np.asarray(ref[0]).copy()
    if c["add_do"]:
      want_dq[:total] += np.asarray(do[:total], np.float32)
    for n, got, want in (("dq", dq, want_dq), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
      want = np.asarray(want)
      if not np.all(np.isfinite(got)): msgs.append(f"{n}: non-finite {np.sum(~np.isfinite(got))}")
      nrm = np.linalg.norm(want)
      err = np.linalg.norm(np.nan_to_num(got) - want) / nrm if nrm > 0 else np.linalg.norm(np.nan_to_num(got))
      if err >= 1e-2: msgs.append(f"{n}: rel err {err:.3g}")
    if np.any(dq[total:]): msgs.append("dq padding nonzero")
    if ko is not None and (np.any(dk[int(ko[-1]):]) or np.any(dv[int(ko[-1]):])): msgs.append("dk/dv padding nonzero")
    sg = c["scale_grads"] if c["scale_grads"] is not None else c["traced"]
    if sg:
      for n, got, want, t in zip(("dpre", "dpost"), outs[3:], ref[3:], terms):
        if abs(float(got) - float(want)) > 1e-2 * (abs(float(want)) + t): msgs.append(f"{n} {float(got)} vs {float(want)}")
    elif outs[3].size: msgs.append("scale grads returned")
  print(i, "OK" if not msgs else msgs, flush=True)
