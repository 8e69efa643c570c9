"""The train-step harness (benchmarks/e2e.py) on the CPU at the tiny config: the baseline arm
differentiates the jagged conversions into scatter-adds and the library's arms do not, the
statistics, and the CLI's JSON."""

import functools
import json
import re
import pathlib
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import e2e  # noqa: E402


@functools.cache
def _tiny_programs(arm):
  """e2e.component_programs of the tiny model for ``arm``, built once per arm in the module
  (not shared between arms: jax caches a jitted program's trace, and the baseline's differs
  from the xla arm's only by the trace context)."""
  train = e2e._load_train_script()
  model, _, (batch,) = e2e._model_and_data(train, e2e.build_config(tiny=True), e2e.ARMS[arm])
  return e2e.component_programs(model, batch)


def _seed_pool_program(arm):
  fn, args = _tiny_programs(arm)["seed_pool"]
  with e2e._trace_context(arm):
    return str(jax.make_jaxpr(fn)(*args))


def test_only_the_baseline_differentiates_conversions_into_scatter_adds():
  assert "scatter-add" in _seed_pool_program("baseline")
  assert "scatter" not in _seed_pool_program("xla")
  # The context restores the library's conversions.
  from pallas_norm import jagged
  assert jagged.to_padded is not jagged._gather_to_padded


def _ads_data():
  e2e._load_train_script()  # puts examples/ on sys.path and imports ads_data
  return sys.modules["ads_data"]


def test_bucket_capacity_is_the_smallest_bucket_that_holds_the_tokens():
  cap = _ads_data().bucket_capacity
  # B·L = 256 in 8 buckets of 32 rows; empty batches still get one bucket.
  assert [cap(n, 8, 32, 8) for n in (0, 1, 32, 33, 129, 256)] == [32, 32, 32, 64, 160, 256]
  assert cap(3, 8, 32, 1) == 256  # one bucket: always B·L
  # Widths round up to 8 rows (the kernels' alignment); the last bucket is B·L = 30 itself.
  assert [cap(n, 5, 6, 4) for n in (7, 9, 25, 30)] == [8, 16, 30, 30]
  with pytest.raises(ValueError, match="buckets must be >= 1"):
    cap(3, 8, 32, 0)
  with pytest.raises(ValueError, match="num_tokens=257"):
    cap(257, 8, 32, 8)


def test_make_batch_packs_into_the_capacity_and_never_drops_tokens():
  ads_data = _ads_data()
  ds = ads_data.make_synthetic(6, max_seq_len=8, sparse_vocab_size=64, item_vocab_size=64)
  idx = np.arange(6)
  tokens = ads_data.batch_tokens(ds, idx, 8)
  full = ads_data.make_batch(ds, idx, 8)
  assert full.seq_ids.shape == (48,) and int(full.seq_offsets[-1]) == tokens
  bucketed = ads_data.make_batch(ds, idx, 8, token_buckets=6)  # buckets of 8 rows
  assert bucketed.seq_ids.shape == (-(-tokens // 8) * 8,)
  np.testing.assert_array_equal(bucketed.seq_offsets, full.seq_offsets)
  np.testing.assert_array_equal(bucketed.seq_ids, full.seq_ids[:bucketed.seq_ids.shape[0]])
  assert ads_data.make_batch(ds, idx, 8, capacity=tokens).seq_ids.shape == (tokens,)
  with pytest.raises(ValueError, match=f"holds {tokens} tokens, more than its packed capacity"):
    ads_data.make_batch(ds, idx, 8, capacity=tokens - 1)


def test_token_buckets_flag():
  parse = e2e._load_train_script().parse_args
  assert parse(["--devices", "1"]).token_buckets == 1  # auto: 1 off a GPU
  assert parse(["--devices", "1", "--token-buckets", "4"]).token_buckets == 4
  for bad in (["--token-buckets", "0"], ["--token-buckets", "x"]):
    with pytest.raises(SystemExit):
      parse(["--devices", "1"] + bad)


def test_interleaved_times_and_summary():
  calls = []
  programs = {name: (lambda name=name: calls.append(name), ()) for name in "abc"}
  times = e2e.interleaved_times(programs, samples=4, warmup=1)
  assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
  assert calls[3:6] == ["a", "b", "c"] and calls[6:9] == ["b", "c", "a"]  # rotated rounds
  stats = e2e.summarize([0.003, 0.001, 0.002, 0.010])
  assert stats["n"] == 4 and stats["min_ms"] == pytest.approx(1.0)
  assert stats["median_ms"] == pytest.approx(2.5)
  assert stats["p10_ms"] <= stats["p25_ms"] <= stats["median_ms"] <= stats["p75_ms"]


@pytest.mark.slow
def test_cli_writes_the_json_and_default_trains_like_the_reference(tmp_path):
  """The CLI end to end (float32 arms, so that their losses compare to summation order): the
  default arm (library conversions, implementation=None, bucketed capacity) trains like the
  float32 reference (the baseline's plain-JAX conversions and B·L rows, HIGHEST matmuls; on a
  CPU float32 matmuls are that precise anyway). One timed arm: each arm compiles its own train
  step (~13 CPU-s); the baseline's trace context is checked by
  test_only_the_baseline_differentiates_conversions_into_scatter_adds, the speed-ups by
  test_summary_speedups_and_loss_differences."""
  out = tmp_path / "e2e.json"
  assert e2e.main(["--tiny", "--arms", "default", "--components", "", "--samples", "2",
                   "--loss-steps", "3", "--compute-dtype", "float32", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert {(r["component"], r["arm"]) for r in result["rows"]} == {("step", "default")}
  assert all(r["n"] == 2 and r["median_ms"] > 0 for r in result["rows"])
  losses = result["losses"]
  assert len(losses[e2e.LOSS_REFERENCE]) == 3 and np.all(np.isfinite(losses["default"]))
  # The reference packs B·L rows, the library's arms the bucket that holds every batch.
  assert result["capacity"][e2e.LOSS_REFERENCE] == 8 * 32
  assert max(result["real_tokens"]) <= result["capacity"]["default"] < 8 * 32
  np.testing.assert_allclose(losses["default"], losses[e2e.LOSS_REFERENCE], rtol=1e-5)
  assert result["summary"]["loss/default_max_abs_diff_vs_f32"] < 1e-4


def test_summary_speedups_and_loss_differences():
  """summary(): each arm's speed-up over the baseline (median over median) and its loss
  differences from the baseline's and the float32 reference's losses."""
  row = lambda c, a, ms: {"component": c, "arm": a, "median_ms": ms}  # noqa: E731
  result = {"rows": [row("step", "baseline", 140.0), row("step", "default", 56.0),
                     row("mlp", "default", 7.0)],
            "losses": {"baseline": [1.0, 0.5], "default": [1.25, 0.5],
                       e2e.LOSS_REFERENCE: [1.0, 0.75]}}
  got = e2e.summary(result)
  assert got == pytest.approx({"step/default_speedup": 2.5,
                               "loss/default_max_abs_diff": 0.25,
                               "loss/default_mean_abs_diff": 0.125,
                               "loss/baseline_max_abs_diff_vs_f32": 0.25,
                               "loss/baseline_mean_abs_diff_vs_f32": 0.125,
                               "loss/default_max_abs_diff_vs_f32": 0.25,
                               "loss/default_mean_abs_diff_vs_f32": 0.25})


def test_markdown_table_speedups_are_baseline_over_arm():
  row = lambda c, a, ms: {"component": c, "arm": a, "median_ms": ms, "p10_ms": ms - 1,  # noqa: E731
                          "p90_ms": ms + 1}
  result = {"arms": {"baseline": "", "default": ""},
            "rows": [row("step", "baseline", 140.0), row("step", "default", 56.0),
                     row("mlp", "baseline", 7.0)]}
  lines = e2e.markdown_table(result).splitlines()
  assert lines[2] == ("| whole train step (+ AdamW) | 140.0 (139.0–141.0) | 56.0 (55.0–57.0) "
                      "| 2.50× |")
  assert lines[3] == "| interaction MLP | 7.0 (6.0–8.0) | — | — |"


def test_components_differentiate_only_their_own_parameters():
  """Zero gradients of the other parameters (the embedding tables, ~1.3 GB at production)
  would be written by every component program and inflate its time."""
  from flax import nnx
  programs = _tiny_programs("xla")
  owners = {name: {path[:2] if path[0] in e2e._PER_LAYER else path[:1]
                   for path, _ in nnx.to_flat_state(args[0])}
            for name, (_, args) in programs.items()}
  assert owners == {"self_attention": {("qkv", 0), ("attn_out", 0)}, "pffn": {("pffn", 0)},
                    "seed_pool": {("pool_kv",), ("seeds",)},
                    "mlp": {("mlp_in",), ("mlp",), ("head",)}}


_HLO = """HloModule jit_step, is_scheduled=true
ENTRY %main {
  %loop_add_fusion.2 = f32[8]{0} fusion(%p), kind=kLoop, calls=%c1, metadata={op_name="jit(step)/jvp(pffn)/add"}
  %custom-call.7 = bf16[8,8]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(self_attention))/dot_general"}
  %input_reduce_fusion = f32[8]{0} fusion(%q), kind=kInput, calls=%c2, metadata={op_name="jit(step)/optimizer/reduce_sum"}
  ROOT %copy-start.1 = f32[8]{0} copy(%r)
}
"""


def test_kernel_profile_attributes_fusions_by_name_and_library_kernels_by_order():
  from benchmarks import kernel_profile as kp
  kernels = [("loop_add_fusion_2", 1.0), ("sm90_xmma_gemm_bf16bf16", 4.0),
             ("splitk_reduce", 0.5), ("input_reduce_fusion", 2.0), ("mystery", 0.25),
             ("loop_add_fusion_2", 1.0)]
  prof = kp.profile(kernels, iterations=2, hlo_text=_HLO)
  assert prof["kernel_ms"] == pytest.approx(4.375) and prof["kernels_per_call"] == 3
  # The GEMM and the kernel after it belong to the custom call after the last fusion.
  assert prof["by_component"] == {"self-attention": 2.25, "PFFN": 1.0,
                                  "optimizer (AdamW)": 1.0, "rest": 0.125}
  assert prof["by_kind"]["GEMM"] == 2.25  # with its split-K reduction
  assert prof["by_kind"]["reductions (norm statistics, softmax, sums)"] == 1.0
  assert prof["by_kind"]["elementwise (loop fusions)"] == 1.0
  name, ms, count, kind, component, op_name = prof["top"][0]
  assert (name, ms, count, component) == ("sm90_xmma_gemm_bf16bf16", 2.0, 0.5, "self-attention")


def test_model_scopes_label_the_step():
  """The model's and the step's named scopes reach the step's op names (what the profile
  groups by; the compiled HLO's op_name metadata carries the same names): every component of
  kernel_profile.COMPONENT_SCOPES is found in the tiny step."""
  from benchmarks import kernel_profile as kp
  fn, args = e2e.default_step(e2e._load_train_script(), e2e.build_config(tiny=True), "xla")
  text = fn.lower(*args).as_text(debug_info=True)
  assert all(re.search(pattern, text) for _, pattern in kp.COMPONENT_SCOPES)
