"""The README's promises: its Python examples run, CI runs exactly its test command, and a bound
it ties to a test is that test's."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
CI = README.parent / ".ci" / "run"


def _blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run():
  blocks = _blocks("python")
  assert len(blocks) >= 2
  namespace = {}
  for block in blocks:  # later blocks reuse names from earlier ones, as a reader would
    exec(compile(block, str(README), "exec"), namespace)


def test_ci_runs_the_readme_test_command():
  test_command = next(b.strip() for b in _blocks("bash") if "pytest" in b)
  ci_lines = [line.strip() for line in CI.read_text().splitlines()]
  assert test_command in ci_lines


def test_fna_scale_gradient_error_is_the_logs_and_under_the_tests_bound():
  """README's error of flash_norm_attention's array-scale gradients: a review measured a case
  above the "~2.5e-4" README said, so README now cites a sweep's worst case and the bound the
  test asserts. The bound it names is the test's TOL, above the measured worst, and both
  numbers are the linked log's."""
  text = " ".join(README.read_text().split())
  found = re.search(r"reached (\S+) of the sum of their magnitudes .*? and (\S+) of \|sum\| "
                    r"\+ sqrt\(Σ term²\), which `(\w+)` bounds at (\S+), .*?\]\((\S+\.md)\)",
                    text)
  assert found, "README's sentence on the array scales' gradient error"
  of_terms, of_test_measure, test, bound, log = found.groups()
  source = (README.parent / "tests" / "test_flash_norm_attention_kernel.py").read_text()
  assert f"def {test}(" in source
  assert float(bound) == float(re.search(r"^TOL = (\S+)$", source, re.M)[1])
  assert float(of_test_measure) < float(bound)
  result = " ".join((README.parent / log).read_text().split())
  assert f"({of_terms} of them)" in result and f"({of_test_measure} of it)" in result


def _names(block):
  """(names a block binds, names it reads) at any depth."""
  import ast
  bound, read = set(), set()
  for node in ast.walk(ast.parse(block)):
    if isinstance(node, ast.Name):
      (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    elif isinstance(node, ast.alias):
      bound.add((node.asname or node.name).split(".")[0])
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      bound.add(node.name)
  return bound, read


def _device_blocks(blocks):
  """The blocks that ask for the device count, and the earlier blocks that bind a name they (or
  a block so kept) read, in order."""
  keep = [("device_count" in b) for b in blocks]
  needed = set()
  for i in reversed(range(len(blocks))):
    bound, read = _names(blocks[i])
    keep[i] = keep[i] or bool(bound & needed)
    if keep[i]:
      needed = (needed - bound) | read
  return [b for b, k in zip(blocks, keep) if k]


def test_readme_python_examples_run_on_two_devices():
  """The README's sharding example on a machine of 2 devices (review 9): it split a jagged batch
  of B = 3 samples over jax.device_count() shards, so it ran only on 1 or 3 devices and raised
  "num_shards must be a positive divisor of the batch B = 3" on 2, 4 or 8 GPUs. In a
  subprocess: the device count is fixed when JAX starts. The blocks that ask for the device
  count and those that bind the names they use: a block that uses neither (the one-device
  training and interpret-kernel example) runs in test_readme_python_examples_run (on 2 devices
  here it took about half of this test's time)."""
  import os
  import subprocess
  import sys
  blocks = _device_blocks(_blocks("python"))
  assert any("shard_rows" in b for b in blocks)
  script = "\n".join(blocks) + "\nassert jax.device_count() == 2\n"
  # Keeps the suite's other XLA flags (tests/conftest.py's fast CPU compiles): replacing them
  # compiled the examples at XLA's full LLVM optimization (12 s for the test, now 9.6 s).
  flags = os.environ.get("XLA_FLAGS", "")
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2".strip(),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(README.parent))
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def test_readme_counts_this_files_tests():
  """The install section names this file as its one-file example with a count of its tests; a
  review found "3 tests" after a fourth had been added (the two-device examples). Every test
  here is one case (none is parametrized), so the count is the number of test functions."""
  said = re.search(r"tests/test_readme\.py`, (\d+) tests", README.read_text())
  assert said, "README no longer names tests/test_readme.py's test count"
  tests = [name for name in globals() if name.startswith("test_")]
  assert int(said.group(1)) == len(tests), (said.group(0), tests)
