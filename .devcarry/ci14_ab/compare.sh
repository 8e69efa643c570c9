#!/bin/bash
# The jaxprs of the kernel paths ("triton"/"mosaic" names, and implementation=None at measured
# shapes) from main's tree (.devcarry/b/main) and this branch's, then a diff. Run from the
# worktree root with OUT set. Prints IDENTICAL or the first differing lines.
set -e
mkdir -p "$OUT"
mode=${1:-gpu}
PYTHONPATH=$PWD/.devcarry/b/main python3 .devcarry/ci14_ab/jaxprs.py "$OUT/main.txt" "$mode"
PYTHONPATH=$PWD python3 .devcarry/ci14_ab/jaxprs.py "$OUT/ci14.txt" "$mode"
if cmp -s "$OUT/main.txt" "$OUT/ci14.txt"; then echo IDENTICAL; else
  diff "$OUT/main.txt" "$OUT/ci14.txt" | head -40; echo DIFFERENT; fi
grep -c "^ERROR\|ERROR " "$OUT/ci14.txt" || true
