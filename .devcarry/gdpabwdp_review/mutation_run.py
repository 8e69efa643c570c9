import sys, os, time
tree = sys.argv[1]
sys.path.insert(0, tree); sys.path.insert(0, tree + "/tests")
os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
import jax, jax.numpy as jnp, numpy as np
import test_gdpa_bwd_kernel as T
from pallas_norm import mgpu
T.gb.mgpu.num_sms = lambda interpret: int(sys.argv[2]) if len(sys.argv) > 2 else 3
t0 = time.time()
for name, fn in [
    ("dense", lambda: T._check([0, 130, 1, 0, 64, 7, 264, 9, 0], 664, 2, 128, "fast_gelu", lkv=128, seed=7, traced_scales=True)),
    ("jagged", lambda: T._check([0, 130, 1, 0, 64, 7, 264], 472, 1, 128, "silu", kv_lengths=[40, 0, 300, 3, 70, 128, 5], kv_capacity=840, seed=8, traced_scales=True)),
]:
  try:
    fn(); print(name, "pass", round(time.time() - t0, 1), flush=True)
  except Exception as e:
    print(name, "FAIL", repr(e)[:300], round(time.time() - t0, 1), flush=True)
