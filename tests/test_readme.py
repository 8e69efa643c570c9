"""The README's promises: its Python examples run, and CI runs exactly its test command."""

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
