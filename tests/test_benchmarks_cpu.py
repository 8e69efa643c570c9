"""The benchmark suite (benchmarks/) on the CPU, at tiny shapes.

These prove that every code path the GPU run takes executes: inputs, the oracle check before
timing, the timer, the derived columns and the report files. Times on a CPU are wall clock and
are never asserted.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pallas_norm as pn
from benchmarks import breakdown, cases, e2e, report, run, timing  # pytest's pythonpath: the root

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The GEMM ops and the row norm of --quick in one variant and, but for norm_matmul, one mode:
# short enough for CI. layer_norm fwd+bwd runs the row-norm kernel (rms_norm's is the same). The
# attention ops' rows run XLA alone (test_attention_cases_check_and_time_their_xla_rows): in
# interpret mode their kernels cost ~40% of this test (gdpa's ~9 s a call), and the
# benchmark's kernel plumbing (cases._kernel_impl_fn, the same for every op) runs here; the
# kernels themselves are tested in tests/test_gdpa_kernel.py and
# tests/test_flash_norm_attention_kernel.py. test_every_case_runs_at_tiny_shapes runs all.
QUICK_SUBSET = r"norm_matmul/rms/.*/fwd$|matmul_norm/layer\+res/.*fwd\+bwd|layer_norm/.*fwd\+bwd"
KERNEL_STATUSES = {"ok", "n/a", "wrong"}  # "error" means the suite could not run a kernel


def _cli_env():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
             PJRT_NPROC="8")  # interpret-mode kernels deadlock with fewer CPU computations
  env.pop("OUT", None)
  return env


def _run_suite(tmp_path, *flags, timeout, returncode=0):
  """Runs the suite in a subprocess (a hanging interpret-mode kernel fails, not hangs, the test),
  checks its exit status and returns (results, json path, the finished process)."""
  cmd = [sys.executable, "-m", "benchmarks.run", "--results-dir", str(tmp_path), *flags]
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=_cli_env(), capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"")[-4000:]
    pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{out!r}")
  assert proc.returncode == returncode, proc.stdout[-4000:] + proc.stderr[-4000:]
  [path] = tmp_path.glob("*.json")
  return json.loads(path.read_text()), path, proc


def _check_rows(results):
  rows = results["rows"]
  by_case = {}
  for r in rows:
    by_case.setdefault(r["case"], {})[r["impl"]] = r
  for name, impls in by_case.items():
    if name.startswith("train_step"):
      continue
    xla = impls["xla"]
    # The oracle check ran: a bf16 result differs from the f32 oracle, but not by much.
    assert xla["status"] == "ok", xla
    assert 0 < xla["rel_err"] < run.TOLERANCE, xla
    assert xla["time_us"] > 0 and len(xla["times_us"]) == results["iterations"], xla
    assert xla["floor_us"] > 0 and xla["bytes"] > 0, xla
    for impl, r in impls.items():
      if impl == "xla":
        continue
      assert r["status"] in KERNEL_STATUSES, r
      if r["status"] in ("ok", "wrong"):
        assert r["rel_err"] is not None, r
      if r["status"] == "ok":
        assert r["time_us"] > 0 and r["ratio_xla"] is not None, r
    limit = xla["limit_case"]
    if limit is not None:
      assert limit in by_case, f"{name}: its limit {limit} did not run"
      assert xla["ratio_limit"] == pytest.approx(xla["time_us"] / xla["limit_us"]), xla
      assert xla["hidden"] is None  # only fused implementations hide anything
  return by_case


def test_quick_interpret_suite_writes_checked_results(tmp_path):
  # One timed call per implementation: each interpret-mode call takes seconds.
  results, path, _ = _run_suite(tmp_path, "--interpret", "--quick", "--only", QUICK_SUBSET,
                                "--iterations", "1", timeout=600)
  assert results["timer"] == "wall" and results["backend"] == "cpu"
  assert results["flags"]["interpret"] and results["flags"]["tiny"]
  for key in ("jax_version", "device", "date", "git_commit", "tolerance", "wall_s"):
    assert results[key] is not None, key
  ceilings = results["ceilings"]
  assert ceilings["copy_GBps"] > 0 and ceilings["gemm_TFLOPs"] > 0
  by_case = _check_rows(results)
  ops = {r["op"] for r in results["rows"]}
  assert ops == {"gemm", "norm_matmul", "matmul_norm", "layer_norm"}
  assert {r["mode"] for r in results["rows"]} == {"fwd", "fwd+bwd"}
  assert all("interpret" in impls for name, impls in by_case.items()
             if not name.startswith("gemm"))

  md = path.with_suffix(".md").read_text()
  assert "| case | mode | impl | time µs | × limit | × XLA | floor µs | hidden | status |" in md
  assert "Wall-clock timer" in md
  assert path.with_suffix(".png").stat().st_size > 0
  # The report CLI regenerates the same table from the JSON alone.
  path.with_suffix(".md").unlink()
  report.main([str(path)])
  assert path.with_suffix(".md").read_text() == md
  assert "| norm_matmul rms | 256x128x128 |" in report.readme_table(results, "fwd")
  assert "| matmul_norm layer+res | 256x128x128 |" in report.readme_table(results, "fwd+bwd")


def test_attention_cases_check_and_time_their_xla_rows(tmp_path):
  """The attention cases' inputs, oracle check and timing, and PFFN's limit (GDPA alone),
  XLA alone (in process: nothing interpret-mode to hang)."""
  results = run.main(["--tiny", "--quick", "--only", r"^flash_norm_attention/.*/fwd$", "--impls",
                      "none", "--no-plot", "--no-e2e", "--results-dir", str(tmp_path),
                      "--iterations", "1"])
  by_case = _check_rows(results)
  assert {r["op"] for r in results["rows"]} == {"gdpa", "flash_norm_attention"}
  [fna] = [name for name in by_case if name.startswith("flash_norm_attention/")]
  assert by_case[fna]["xla"]["limit_case"].startswith("gdpa/")


def _scaled_norm_matmul(case):
  del case
  return lambda x, w, scale: 1.1 * pn.norm_matmul(x, w, scale=scale, implementation="xla")


def _absent(case):
  raise NotImplementedError(f"no such kernel for {case.name}")


def _broken(case):
  del case

  def fn(x, w, scale):
    raise RuntimeError("kernel failed to lower")
  return fn


def test_wrong_absent_and_broken_implementations_are_reported(tmp_path):
  for name, factory in (("scaled", _scaled_norm_matmul), ("absent", _absent),
                        ("broken", _broken)):
    cases.register_impl("norm_matmul", name, factory)
  try:
    results = run.main(["--tiny", "--quick", "--only", r"norm_matmul/rms/.*/fwd$", "--impls",
                        "scaled,absent,broken", "--no-plot", "--results-dir", str(tmp_path),
                        "--iterations", "2"])
  finally:
    for name in ("scaled", "absent", "broken"):
      cases.unregister_impl("norm_matmul", name)
  by_impl = {r["impl"]: r for r in results["rows"] if r["op"] == "norm_matmul"}
  assert set(by_impl) == {"xla", "scaled", "absent", "broken"}  # --impls dropped "mosaic"
  scaled = by_impl["scaled"]
  assert scaled["status"] == "wrong" and scaled["rel_err"] == pytest.approx(0.1, abs=0.01)
  assert scaled["time_us"] is None and scaled["times_us"] == []  # a wrong output is not timed
  assert by_impl["absent"]["status"] == "n/a"
  assert by_impl["broken"]["status"] == "error"
  assert "kernel failed to lower" in by_impl["broken"]["message"]
  assert by_impl["xla"]["status"] == "ok" and by_impl["xla"]["time_us"] > 0
  # The GEMM-alone limit ran although --only did not name it.
  assert any(r["op"] == "gemm" and r["status"] == "ok" for r in results["rows"])
  # The command line would exit with EXIT_WRONG ("error" and "n/a" alone do not count).
  assert run.wrong_cases(results) == {"norm_matmul/rms/256x128x128/fwd": ["scaled"]}
  assert run.exit_status(results) == run.EXIT_WRONG
  results["rows"] = [r for r in results["rows"] if r["status"] != "wrong"]
  assert run.exit_status(results) == 0


def _nan_norm_matmul(case):
  del case
  return lambda x, w, scale: pn.norm_matmul(x, w, scale=scale, implementation="xla") * jnp.nan


def _grad_off_norm_matmul(case):
  """The right forward, 1.5× the gradient of x."""
  del case

  def fn(x, w, scale):
    x = 1.5 * x - jax.lax.stop_gradient(0.5 * x)
    return pn.norm_matmul(x, w, scale=scale, implementation="xla")
  return fn


@pytest.mark.parametrize("name,factory,cases_re", [
    ("nan", _nan_norm_matmul, r"norm_matmul/rms/.*/fwd$"),
    ("gradoff", _grad_off_norm_matmul, r"^norm_matmul/rms/.*/fwd\+bwd$")])
def test_nan_outputs_and_wrong_gradients_are_wrong(tmp_path, name, factory, cases_re):
  """A NaN output (its error is NaN, which no tolerance may accept) and, in fwd+bwd, a right
  forward with a wrong gradient (the check takes the worst output, not the first) are "wrong"
  and not timed (a mutation test accepted both unnoticed)."""
  cases.register_impl("norm_matmul", name, factory)
  try:
    results = run.main(["--tiny", "--quick", "--only", cases_re, "--impls", name, "--no-plot",
                        "--no-e2e", "--results-dir", str(tmp_path), "--iterations", "1"])
  finally:
    cases.unregister_impl("norm_matmul", name)
  rows = [r for r in results["rows"] if r["impl"] == name]
  assert rows
  for r in rows:
    assert r["status"] == "wrong" and r["time_us"] is None, r


def test_imprecise_xla_baseline_is_still_timed(tmp_path):
  # A tolerance below bf16's rounding error: the XLA rows become "imprecise" and stay the
  # baseline (timed, ratios computed); a kernel would say "wrong" and not be timed.
  results = run.main(["--tiny", "--quick", "--only", r"matmul_norm/rms/.*/fwd$", "--impls",
                      "none", "--tolerance", "1e-5", "--no-plot", "--no-e2e",
                      "--results-dir", str(tmp_path), "--iterations", "2"])
  rows = {r["op"]: r for r in results["rows"]}
  assert set(rows) == {"gemm", "matmul_norm"}
  for r in rows.values():
    assert r["status"] == "imprecise" and r["rel_err"] > 1e-5 and r["time_us"] > 0, r
  assert rows["matmul_norm"]["ratio_limit"] == pytest.approx(
      rows["matmul_norm"]["time_us"] / rows["gemm"]["time_us"])
  assert "timed as the baseline" in report.markdown(results)


def test_resume_runs_only_what_the_budget_cut(tmp_path):
  flags = ["--tiny", "--quick", "--only", r"^rms_norm/.*/fwd$", "--impls", "none", "--no-plot",
           "--no-e2e", "--results-dir", str(tmp_path), "--iterations", "2"]
  cut = run.main(flags + ["--budget-s", "0"])
  [row] = cut["rows"]
  assert row["status"] == "skipped" and "time budget" in row["message"]
  resumed = run.main(flags + ["--resume"])
  [row] = resumed["rows"]
  assert row["status"] == "ok" and row["time_us"] > 0
  assert resumed["ceilings"] == cut["ceilings"]  # kept, not measured again
  again = run.main(flags + ["--resume"])
  assert again["rows"][0]["times_us"] == row["times_us"]  # finished cases are not rerun


def test_rotating_calls_each_input_set_in_turn():
  fn = jax.jit(lambda a: a * 2)
  sets = [(jnp.full((4,), float(i + 1)),) for i in range(3)]
  rot = timing.Rotating(fn, sets)
  # profiler.measure re-jits (and so freezes one input set into) anything not Wrapped.
  assert isinstance(rot, jax.stages.Wrapped)
  got = [float(rot(None)[0]) for _ in range(4)]
  assert got == [2.0, 4.0, 6.0, 2.0]
  assert rot.lower().compile() is not None
  times = timing.measure_us(fn, sets, 3, "wall")
  assert len(times) == 3 and all(t > 0 for t in times)
  with pytest.raises(ValueError, match="timer"):
    timing.measure_us(fn, sets, 3, "cuda-events")
  with pytest.raises(ValueError, match="iterations"):
    timing.measure_us(fn, sets, 0, "wall")


def test_case_list_is_consistent():
  all_cases = cases.all_cases()
  names = [c.name for c in all_cases]
  assert len(names) == len(set(names))
  quick = cases.select(all_cases, quick=True, only=None, tiny_shapes=False)
  assert 0 < len(quick) < len(all_cases) and all(c.quick for c in quick)
  only = cases.select(all_cases, quick=False, only=r"^gdpa/", tiny_shapes=False)
  assert only and all(c.op == "gdpa" for c in only)
  tiny = cases.select(all_cases, quick=False, only=None, tiny_shapes=True)
  ops_modes = {(c.op, c.variant, c.mode) for c in all_cases}
  assert {(c.op, c.variant, c.mode) for c in tiny} == ops_modes  # every op survives tiny
  for c in all_cases:
    if c.op in ("gdpa", "flash_norm_attention"):
      lens = cases.attention_lengths(c)
      assert lens.min() >= 1 and lens.max() <= c.dim("L")
    if c.op in ("rms_norm", "layer_norm"):  # ~1 GB inputs
      assert 0.9e9 < 2 * c.dim("M") * c.dim("N") < 1.2e9


def test_docs_name_routing_and_configs_attributes_that_exist():
  """Every `routing.NAME` and `configs.NAME` of the docs is an attribute of such a module: the
  dispatch limits moved from each op's configs.py to routing.py (GDPA's configs.py, its
  tiling, stays), and a review found NOTES.md and EXPERIMENTS.md still naming seven of them
  `configs.` (`configs.KERNEL_DOMAINS`, `configs.kernel_slower_forward_reason`, ...)."""
  from pallas_norm.ops.gdpa import configs
  from pallas_norm.ops.matmul_norm import routing as matmul_norm_routing
  from pallas_norm.ops.norm_matmul import routing as norm_matmul_routing
  from pallas_norm.ops.norms import routing as norms_routing
  modules = {"configs": [configs],
             "routing": [matmul_norm_routing, norm_matmul_routing, norms_routing]}
  removed = {"LAYER_AUTODIFF_MIN_N"}  # a rule the notes tell the history of: measured, removed
  docs = ["README.md", "docs/LAYOUT.md", "docs/DESIGN.md", "benchmarks/NOTES.md",
          "benchmarks/EXPERIMENTS.md"]
  missing = [(doc, f"{kind}.{name}") for doc in docs
             for kind, name in re.findall(r"`(configs|routing)\.(\w+)`", (ROOT / doc).read_text())
             if name != "py" and name not in removed
             and not any(hasattr(m, name) for m in modules[kind])]
  assert not missing


@pytest.mark.slow
def test_full_suite_largest_cases_fit_the_h200():
  """Device memory of the largest cases: input sets plus the ten outputs profiler.measure keeps
  alive must fit the 139 GB of the H200 (abstract shapes only, nothing is allocated)."""
  for c in cases.all_cases():
    args, out = run.abstract_io(cases.build(c), c.mode)
    in_b, out_b = run.nbytes(args), run.nbytes(out)
    sets = min(8, max(1, math.ceil(run.ROTATE_BYTES / in_b)))
    assert sets * in_b + 11 * out_b < 100e9, (c.name, in_b, out_b)


def test_floors_table_covers_the_headline_shapes():
  table = report.floors_table(4300.0, 790.0)
  assert "norm_matmul/rms/262144x512x512" in table and "gdpa/B768_H4_L512" in table
  # 262144x512x512 bf16 fwd: x, w, γ in, y out: 2·(2·262144·512 + 512² + 512) bytes.
  row = next(line for line in table.splitlines()
             if line.startswith("| norm_matmul/rms/262144x512x512 | fwd |"))
  nbytes = 2 * (2 * 262144 * 512 + 512 * 512 + 512)
  assert f"| {nbytes / 4300e3:.0f} |" in row


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PALLAS_NORM_BENCH_ALL"),
                    reason="~10 min: set PALLAS_NORM_BENCH_ALL=1 to run every case at tiny shapes")
def test_every_case_runs_at_tiny_shapes(tmp_path):
  """Before spending GPU time on a changed suite: every case, kernels in interpret mode."""
  results, _, _ = _run_suite(tmp_path, "--interpret", "--iterations", "1", "--budget-s",
                             "1500", timeout=1500)
  by_case = _check_rows(results)
  expected = {c.name for c in cases.select(cases.all_cases(), quick=False, only=None,
                                           tiny_shapes=True)}
  assert expected <= set(by_case)
  e2e_rows = [r for r in results["rows"] if r["op"] == "train_step"]
  assert e2e_rows and all(r["status"] in ("ok", "skipped") for r in e2e_rows), e2e_rows


def test_copy_ceiling_kernels_read_and_write_every_element_once():
  """Each copy kernel returns a new array of the same shape and dtype that differs from the
  input (nothing XLA could alias away), and the XOR copy undoes itself."""
  x = jax.random.normal(jax.random.key(0), (4096,), jnp.bfloat16)
  for name, fn in run.COPY_KERNELS.items():
    y = jax.jit(fn)(x)
    assert y.shape == x.shape and y.dtype == x.dtype, name
    assert bool(jnp.any(y != x)), name
  twice = run._xor_words(run._xor_words(x))
  assert bool(jnp.all(jax.lax.bitcast_convert_type(twice, jnp.uint16)
                      == jax.lax.bitcast_convert_type(x, jnp.uint16)))


def test_precompile_leaves_nothing_to_compile_when_timing():
  """After ``precompile`` (from shapes, in threads), checking and timing a case starts no
  backend compilation: the timing loop measures, it does not compile."""
  compiles = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  [case] = [c for c in cases.all_cases() if c.name == "norm_matmul/rms/262144x512x512/fwd"]
  case = cases.tiny(case)
  ctx = run.Context(timer="wall", iterations=1, kernel="interpret", tiny=False, max_sets=1,
                    deadline=math.inf, impls=frozenset(), ceilings={"gemm_TFLOPs": 1.0,
                                                                    "copy_GBps": 1.0})
  prep = run.prepare(case, ctx)  # tiny=False: inputs come from a jitted generator to compile
  _, compiled, total = run.precompile([prep], workers=2, timed_workers=2)
  assert compiled == total == 3  # the XLA program, the oracle check, the input generator
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    rows = run.run_case(prep, ctx)
  finally:
    from jax._src import monitoring  # the public module has no unregister in jax 0.11.2
    monitoring.unregister_event_duration_listener(listener)
  assert [r["status"] for r in rows] == ["ok"], rows
  assert compiles == [], f"{len(compiles)} programs compiled while timing"


@pytest.mark.parametrize("flags,message", [
    (["--impls", "bogus"], "unknown implementation"),
    (["--only", "("], "invalid regular expression"),
    (["--tolerance", "-1"], "--tolerance"),
    (["--budget-s", "-5"], "--budget-s"),
    (["--compile-timed-workers", "0"], "--compile-timed-workers"),
    (["--impls", ","], "no implementation"),  # ran every implementation, as without --impls
    (["--impls", ""], "no implementation"),
])
def test_bad_flags_are_argparse_errors(flags, message, capsys):
  with pytest.raises(SystemExit) as e:
    run.parse_args(flags)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_full_size_cases_without_a_gpu_exit_with_a_hint():
  """Full-size cases on a CPU would allocate tens of GB and die in a traceback (review finding)."""
  if jax.default_backend() == "gpu":
    pytest.skip("runs the cases on a GPU")
  with pytest.raises(SystemExit, match="need a GPU.*--interpret"):
    run.main(["--only", "rms_norm", "--no-e2e"])


def test_selection_errors_and_names(tmp_path):
  with pytest.raises(SystemExit, match="selects no case"):
    run.main(["--list", "--only", "no-such-case"])
  # The end-to-end case answers to the name --list prints.
  assert run.E2E_NAME == "train_step/kunlun"
  args_a = run.parse_args(["--tiny", "--only", "rms_norm"])
  args_b = run.parse_args(["--tiny", "--only", "layer_norm"])
  assert run._stem(args_a, "cpu") != run._stem(args_b, "cpu")  # no overwriting
  assert run.parse_args(["--interpret", "--impls", "mosaic"]).impls == "interpret"


def _listed(capsys, *flags):
  run.main(["--list", *flags])
  return capsys.readouterr().out.split()


@pytest.mark.parametrize("flags", [[], ["--tiny"], ["--interpret"], ["--interpret", "--quick"]])
def test_only_matches_the_names_list_prints(flags, capsys):
  names = _listed(capsys, *flags)
  assert names and len(names) == len(set(names))
  for name in names:  # every listed name selects itself, and only itself
    assert _listed(capsys, *flags, "--only", f"^{re.escape(name)}$") == [name], name
  if "--interpret" in flags or "--tiny" in flags:
    assert "norm_matmul/rms/256x128x128/fwd" in names
    assert _listed(capsys, *flags, "--only", r"norm_matmul/rms/256x128x128/fwd$") == [
        "norm_matmul/rms/256x128x128/fwd"]
    # A full-size name selects nothing at tiny shapes, and the error says why.
    with pytest.raises(SystemExit, match="selects no case.*tiny shapes"):
      run.main(["--list", *flags, "--only", r"norm_matmul/rms/262144x512x512/fwd$"])
  # A pattern without a shape selects the same cases at either size.
  full = _listed(capsys, "--only", "^matmul_norm/rms/")
  tiny = _listed(capsys, "--tiny", "--only", "^matmul_norm/rms/")
  assert tiny == list(dict.fromkeys(cases.tiny(c).name for c in cases.all_cases()
                                    if c.name in full))


def test_wrong_output_exits_3_after_writing_everything(tmp_path):
  # A tolerance below bf16 rounding: every kernel row is "wrong" (the XLA rows "imprecise").
  name = "norm_matmul/rms/256x128x128/fwd"
  results, path, proc = _run_suite(tmp_path, "--interpret", "--only", f"^{re.escape(name)}$",
                                   "--tolerance", "1e-9", "--iterations", "1", "--no-plot",
                                   timeout=300, returncode=run.EXIT_WRONG)
  assert {r["case"] for r in results["rows"]} == {name, "gemm/256x128x128/fwd"}
  assert run.wrong_cases(results) == {name: ["interpret"], "gemm/256x128x128/fwd": ["ours"]}
  assert results["wall_s"] is not None  # the final write happened
  assert "**wrong**" in path.with_suffix(".md").read_text()
  [summary] = [line for line in proc.stderr.splitlines() if "cases wrong" in line]
  assert summary.startswith("python -m benchmarks.run: 2 of 2 cases wrong"), summary
  assert f"{name} [interpret]" in summary and "exit status 3" in summary


def test_list_into_a_closed_pipe_exits_quietly():
  proc = subprocess.Popen([sys.executable, "-m", "benchmarks.run", "--list"], cwd=ROOT,
                          env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  proc.stdout.close()  # the reader is gone before the listing starts (`--list | true`)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0 and b"Error" not in err, err.decode()


@pytest.mark.parametrize("values", [["0", "0"], ["-1", "790"], ["4300", "nan"], ["x", "1"]])
def test_report_floors_must_be_positive(values, capsys):
  with pytest.raises(SystemExit) as e:
    report.main(["--floors", *values])
  assert e.value.code == 2 and "argument --floors" in capsys.readouterr().err


def _results(*rows_of):
  """A results JSON as benchmarks.run writes it, with the given (case, impl, time_us) rows."""
  rows = []
  for case, impl, t in rows_of:
    rows.append(run._base_row(case, impl, status="ok", time_us=t, times_us=[t], rel_err=1e-3))
  return {"device": "cpu", "timer": "wall", "rows": rows}


def _cells(line):
  """The cells of one Markdown table line (header, separator or row)."""
  assert line.startswith("|") and line.endswith("|"), line
  return line[1:-1].split("|")


@pytest.mark.parametrize("impls", [[], ["mosaic"], ["mosaic", "other"]])
def test_report_readme_table_is_well_formed(impls):
  [case] = [c for c in cases.all_cases() if c.name == "norm_matmul/rms/262144x512x512/fwd"]
  gemm = cases.limit_of(case)
  results = _results((gemm, "xla", 100.0), (case, "xla", 150.0),
                     *((case, i, 120.0) for i in impls))
  lines = report.readme_table(results, "fwd").splitlines()
  assert len(lines) == 3
  widths = {len(_cells(line)) for line in lines}
  assert widths == {5 + len(impls)}, lines
  assert all(c.strip() for c in _cells(lines[0])), lines[0]  # no empty header cell
  assert lines[2].startswith("| norm_matmul rms | 262144x512x512 | 100 | 150 (1.50×) |")


def test_report_names_results_it_cannot_read(tmp_path, capsys):
  """A train-step JSON (rows of components, not suite cases) raised KeyError 'case', and a
  merge of two devices' results a bare ValueError: both exit 2 with one message."""
  steps = tmp_path / "train-step.json"
  steps.write_text(json.dumps({"rows": [{"component": "step", "arm": "baseline"}]}))
  with pytest.raises(SystemExit) as e:
    report.main([str(steps)])
  assert e.value.code == 2 and "benchmarks.e2e --table" in capsys.readouterr().err
  [case] = [c for c in cases.all_cases() if c.name == "norm_matmul/rms/262144x512x512/fwd"]
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps(_results((case, "xla", 150.0))))
  other = _results((case, "xla", 160.0))
  other["device"] = "NVIDIA H200"
  b.write_text(json.dumps(other))
  with pytest.raises(SystemExit) as e:
    report.main([str(a), str(b), "--merge", str(tmp_path / "m.json")])
  assert e.value.code == 2 and "--merge: cannot merge results of different devices" in (
      capsys.readouterr().err)


def test_report_readme_without_rows_of_the_mode_is_an_error(tmp_path, capsys):
  [case] = [c for c in cases.all_cases() if c.name == "norm_matmul/rms/262144x512x512/fwd"]
  path = tmp_path / "fwd-only.json"
  path.write_text(json.dumps(_results((case, "xla", 150.0), (case, "mosaic", 120.0))))
  with pytest.raises(ValueError, match="no fwd\\+bwd rows"):
    report.readme_table(json.loads(path.read_text()), "fwd+bwd")
  with pytest.raises(SystemExit) as e:
    report.main([str(path), "--readme", "--mode", "fwd+bwd"])
  captured = capsys.readouterr()
  assert e.value.code == 2 and captured.out == ""
  assert "no fwd+bwd rows" in captured.err and "modes in the results: fwd" in captured.err
  report.main([str(path), "--readme"])  # the forward table is there
  assert "| norm_matmul rms | 262144x512x512 |" in capsys.readouterr().out


def test_write_to_the_same_folder_twice_writes_once(tmp_path):
  """`--results-dir $OUT` on the GPU machine names one folder twice (it raised SameFileError
  after the run, session 5); the results land there once, with the plot."""
  results = json.loads((ROOT / "benchmarks/results/nvidia-h200.json").read_text())
  results["rows"] = [r for r in results["rows"] if r["key"].endswith("262144x512x512")]
  assert results["rows"]
  written = run._write(results, "twice", [tmp_path, tmp_path / "."], plot=True)
  assert sorted(pathlib.Path(p).name for p in written) == ["twice.json", "twice.md", "twice.png"]
  assert json.loads((tmp_path / "twice.json").read_text())["rows"] == results["rows"]


def test_batched_wall_clock_rejects_empty_batches():
  from benchmarks import timing
  with pytest.raises(ValueError, match="iterations and batches"):
    timing.batched_wall_us(lambda: None, [()], iterations=0)


def test_batched_wall_clock_times_back_to_back_calls():
  from benchmarks import timing
  calls = []
  times = timing.batched_wall_us(lambda x: calls.append(x) or jnp.asarray(x), [(1,), (2,)],
                                 iterations=4, batches=2)
  assert len(times) == 2 and all(t > 0 for t in times)
  assert calls == [1] + [1, 2, 1, 2] * 2  # a warm-up call, then the rotation per batch


def test_rows_fall_back_to_wall_clock_when_cupti_cannot_attribute(monkeypatch):
  """A program whose kernels CUPTI cannot attribute to calls (a lax.cond on the GPU) is timed
  by the wall clock, and its row says so; other errors still mark the row as an error."""
  from benchmarks import run, timing
  timers = []

  def fake(fn, sets, iterations, timer, warmup=True):
    timers.append(timer)
    if timer == "cupti":
      raise timing.KernelOrderError("Kernel names are not consistent across iterations")
    return [2.0, 3.0, 4.0]

  monkeypatch.setattr(timing, "measure_us", fake)
  monkeypatch.setattr(timing, "batched_wall_us",
                      lambda fn, sets, iterations: timers.append("wall") or [2.0, 3.0, 4.0])
  ctx = run.Context(timer="cupti", iterations=3, kernel="mosaic", tiny=False, max_sets=1,
                    deadline=math.inf)
  rows = {"xla": {}}
  run._time_rows(rows, {"xla": None}, [()], ctx)
  assert timers == ["cupti", "wall"]
  assert rows["xla"]["time_us"] == 3.0 and "wall clock" in rows["xla"]["message"]
  assert rows["xla"]["timer"] == "wall"

  def broken(*args, **kwargs):
    raise RuntimeError("out of memory")

  monkeypatch.setattr(timing, "measure_us", broken)
  rows = {"xla": {}}
  run._time_rows(rows, {"xla": None}, [()], ctx)
  assert rows["xla"]["status"] == "error" and "out of memory" in rows["xla"]["message"]


def test_report_keeps_ratios_within_one_timer():
  """A wall-clock fallback row is not divided by CUPTI rows (nor they by it)."""
  from benchmarks import report
  base = dict(case="c", status="ok", limit_case="g")
  rows = [dict(base, impl="xla", time_us=100.0), dict(base, impl="mosaic", time_us=90.0,
                                                      timer="wall"),
          dict(case="g", impl="xla", status="ok", time_us=50.0, limit_case=None)]
  report.derive(rows)
  assert rows[0]["ratio_limit"] == 2.0
  assert rows[1]["ratio_xla"] is None and rows[1]["hidden"] is None
  assert rows[1]["ratio_limit"] is None


def _run_result(commit: str, rows: list[tuple[str, str, float]]) -> dict:
  return {"device": "H200", "date": f"d-{commit}", "git_commit": commit, "flags": {"only": commit},
          "wall_s": 1.0, "rows": [{"case": c, "impl": i, "time_us": t} for c, i, t in rows]}


def test_merge_keeps_every_run_behind_a_merged_part():
  """Merging a new run into an already merged file keeps the file's whole run list (it used to
  keep only the file's first run, losing every later re-run from ``merged_from``), and a later
  run's row replaces the earlier one of the same case and implementation."""
  first = report.merge([_run_result("a", [("x", "xla", 1.0), ("y", "xla", 2.0)]),
                        _run_result("b", [("y", "xla", 3.0)])])
  merged = report.merge([first, _run_result("c", [("x", "xla", 4.0)])])
  assert [r["git_commit"] for r in merged["merged_from"]] == ["a", "b", "c"]
  assert merged["git_commit"] == "a"
  assert {r["case"]: r["time_us"] for r in merged["rows"]} == {"x": 4.0, "y": 3.0}
  with pytest.raises(ValueError, match="different devices"):
    report.merge([first, dict(_run_result("d", []), device="H100")])


def test_merge_keeps_a_measured_row_over_a_later_skipped_one():
  """A later run that skipped a case (its time budget spent) leaves the earlier measurement;
  a skipped row still fills a case no earlier run measured."""
  later = _run_result("b", [("x", "xla", None), ("z", "xla", None)])
  for r in later["rows"]:
    r["status"] = "skipped"
  merged = report.merge([_run_result("a", [("x", "xla", 1.0)]), later])
  got = {r["case"]: (r["time_us"], r.get("status")) for r in merged["rows"]}
  assert got == {"x": (1.0, None), "z": (None, "skipped")}


# Found by a mutation test (each failed to notice its mutant before).

def test_hidden_share_is_of_xlas_excess_over_the_limit():
  status = "ok" if "ok" in report.TIMED else sorted(report.TIMED)[0]
  rows = [dict(case=c, impl=i, time_us=t, status=status, limit_case=lc)
          for c, i, t, lc in (("lim", "gemm", 50.0, None), ("c", "xla", 100.0, "lim"),
                              ("c", "k1", 75.0, "lim"), ("c", "k2", 50.0, "lim"))]
  report.derive(rows)
  hidden = {r["impl"]: r["hidden"] for r in rows if r["case"] == "c"}
  assert hidden["k1"] == pytest.approx(0.5) and hidden["k2"] == pytest.approx(1.0)
  assert hidden["xla"] is None


def test_wall_timer_rotates_the_input_sets():
  seen = []

  def fn(i):
    seen.append(i)
    return 0
  times = timing.measure_us(fn, [(0,), (1,), (2,)], 5, "wall")
  assert seen == [0, 0, 1, 2, 0, 1] and len(times) == 5  # a warm-up on set 0, then in turn


@pytest.mark.parametrize("rotate,sets", [(6000, 2), (12000, 3), (4000, 1)])
def test_input_sets_cover_the_rotation_bytes(monkeypatch, rotate, sets):
  """One pass over the rotated input sets reads at least ROTATE_BYTES (a ceiling, not a floor):
  inputs of 4000 bytes, the helpers around the sizing stubbed."""
  import types
  monkeypatch.setattr(run, "with_mode", lambda f, diff, mode: f)
  monkeypatch.setattr(run, "floor_us", lambda *a, **k: 1.0)
  monkeypatch.setattr(run, "_base_row",
                      lambda case, impl, **common: dict(case=case.name, impl=impl, **common))
  monkeypatch.setattr(run, "_time_rows", lambda rows, fns, sets, ctx: None)
  monkeypatch.setattr(run, "rel_err", lambda x: 0.0)
  monkeypatch.setattr(run, "ROTATE_BYTES", rotate)
  fn = jax.jit(lambda a: a * 2)
  prepared = types.SimpleNamespace(
      case=types.SimpleNamespace(name="c", mode="fwd"),
      prob=types.SimpleNamespace(impl_fn=lambda impl: fn, diff=None, flops_fwd=1, flops_bwd=0),
      make=lambda seed: (jnp.zeros((1000,), jnp.float32),), check=lambda out, *a: 0.0,
      fns={"xla": fn})
  ctx = types.SimpleNamespace(tolerance=0.02, max_sets=10, ceilings=None)
  rows = run._check_and_time(prepared, [prepared.make(0)], ctx)
  assert rows[0]["input_sets"] == sets


_TINY_CASE = ["--interpret", "--only", "rms_norm/64x128/fwd$", "--no-e2e", "--no-plot"]


def _not_run(*args, **kwargs):
  raise AssertionError("the command went on to measure")


def test_unwritable_results_folders_exit_before_any_case(tmp_path, monkeypatch):
  """A --results-dir that is a file (or under one) failed in a FileExistsError traceback after
  the first case had run (on a GPU, after the compiles); $OUT likewise."""
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  monkeypatch.setattr(run, "_run", _not_run)
  monkeypatch.delenv("OUT", raising=False)
  for folder in (blocker, blocker / "sub"):
    with pytest.raises(SystemExit, match=r"--results-dir: cannot write into .*a-file"):
      run.main([*_TINY_CASE, "--results-dir", str(folder)])
  monkeypatch.setenv("OUT", str(blocker))
  with pytest.raises(SystemExit, match=r"\$OUT: cannot write into"):
    run.main([*_TINY_CASE, "--results-dir", str(tmp_path / "results")])


@pytest.mark.parametrize("text, message", [("not json", "cannot read"),
                                           ('{"foo": 1}', "not a results JSON")])
def test_resume_from_a_json_it_cannot_use_is_one_line(tmp_path, monkeypatch, text, message):
  """--resume over a file of the same stem that is not the suite's JSON raised KeyError 'rows'
  (or a JSONDecodeError) in a traceback."""
  monkeypatch.setattr(run, "measure_ceilings", _not_run)
  monkeypatch.delenv("OUT", raising=False)
  flags = [*_TINY_CASE, "--results-dir", str(tmp_path), "--resume"]
  stem = run._stem(run.parse_args(flags), jax.devices()[0].device_kind)
  (tmp_path / f"{stem}.json").write_text(text)
  with pytest.raises(SystemExit, match=f"--resume: .*{message}"):
    run.main(flags)


def test_report_names_rows_that_lack_a_suite_key(tmp_path, capsys):
  """Rows with a "case" but without the other keys the tables read raised KeyError 'impl' from
  derive()."""
  path = tmp_path / "rows.json"
  path.write_text(json.dumps({"schema": 1, "rows": [{"case": "x"}]}))
  with pytest.raises(SystemExit) as e:
    report.main([str(path), "--readme"])
  assert e.value.code == 2 and "row 0 is not a suite case's: it lacks op" in (
      capsys.readouterr().err)


@pytest.mark.parametrize("flags, message", [
    (["--table", "{missing}"], "--table: cannot read"),
    (["--table", "{garbage}"], "--table: cannot read"),
    (["--table", "{suite}"], "is not a JSON of benchmarks.e2e (no 'arms'"),
    (["--tiny", "--samples", "0"], "--samples must be >= 1"),
    (["--tiny", "--loss-steps", "-1"], "--loss-steps must be >= 1"),
    (["--tiny", "--profile-iterations", "0"], "--profile-iterations must be >= 1"),
    (["--tiny", "--out", "{folder}"], "is a folder"),
    (["--tiny", "--out", "{garbage}/x.json"], "--out: cannot write into"),
])
def test_e2e_bad_arguments_are_one_line_before_any_compile(tmp_path, monkeypatch, capsys, flags,
                                                           message):
  """benchmarks.e2e: --table of a missing, non-JSON or suite JSON raised a traceback
  (FileNotFoundError, JSONDecodeError, KeyError 'arms'); --samples 0 and --loss-steps -1 failed
  in NumPy after the compiles and the timing; an unwritable --out after the first component."""
  paths = {"missing": tmp_path / "missing.json", "garbage": tmp_path / "garbage.json",
           "suite": tmp_path / "suite.json", "folder": tmp_path}
  paths["garbage"].write_text("not json")
  paths["suite"].write_text(json.dumps(_results()))
  monkeypatch.setattr(e2e, "run_harness", _not_run)
  with pytest.raises(SystemExit) as e:
    e2e.main([f.format(**paths) for f in flags])
  assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--only", "(["], "invalid regular expression"),
    (["--tiny", "--only", "rms_norm", "--impls", "foo"], "unknown implementation(s) ['foo']"),
    (["--tiny", "--only", "rms_norm", "--impls", ","], "unknown implementation(s) ['(none)']"),
    (["--tiny", "--only", "rms_norm", "--iterations", "0"], "--iterations must be >= 1"),
    (["--tiny", "--only", "rms_norm"], "$OUT: cannot write into"),
])
def test_breakdown_bad_arguments_are_one_line_before_any_case(tmp_path, monkeypatch, capsys,
                                                              flags, message):
  """benchmarks.breakdown: a bad regex raised re.error and an unknown implementation KeyError
  in tracebacks; --iterations 0 and an unwritable $OUT (after every case) were not checked."""
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  monkeypatch.setenv("OUT", str(blocker))
  monkeypatch.setattr(breakdown, "breakdown", _not_run)
  with pytest.raises(SystemExit) as e:
    breakdown.main(flags)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_breakdown_full_size_without_a_gpu_exits_with_a_hint(monkeypatch, capsys):
  """Full-size cases on a CPU allocated their inputs and exited 0 with every implementation
  FAILED (CUPTI runs on GPUs only)."""
  if jax.default_backend() == "gpu":
    pytest.skip("runs the case on a GPU")
  monkeypatch.setattr(breakdown, "breakdown", _not_run)
  with pytest.raises(SystemExit) as e:
    breakdown.main(["--only", "rms_norm/262144x2048/fwd$"])
  assert e.value.code == 2 and "need a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["run", "report", "e2e", "breakdown"])
def test_each_tools_usage_names_the_command_that_runs_it(tool):
  """Review finding: `e2e`'s and `breakdown`'s usage lines said `e2e.py` / `breakdown.py`,
  which are run as `python -m benchmarks.<tool>` (their module imports need the package)."""
  out = subprocess.run([sys.executable, "-m", f"benchmarks.{tool}", "--help"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith(f"usage: python -m benchmarks.{tool} "), out.stdout[:80]
