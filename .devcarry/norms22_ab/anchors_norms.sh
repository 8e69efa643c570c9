#!/usr/bin/env bash
# Torch anchors of the standalone norms at the suite's shapes (anchors_norms.py), on the GPU
# machine, from the checkout root, with .anchors/ staged (../shared/anchors/stage.sh) and carried:
#
#   bash .devcarry/norms22_ab/anchors_norms.sh [--budget-s N] [--join FILE]... [-- FLAGS]
#
# FLAGS go to anchors_torch.py (e.g. --select 'x32768', --impls inductor). Writes to $OUT
# (default .anchors/out_norms): anchors_norms.jsonl, anchors_norms_summary.md, logs.
set -u
A=.anchors
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s)
BUDGET=${ANCHORS_BUDGET_S:-300}
JOIN=() EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) BUDGET=$2; shift 2 ;;
    --join) JOIN+=("$2"); shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "anchors_norms.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -f "$A/anchors_torch.py" ] || { echo "anchors_norms.sh: $A/anchors_torch.py missing: stage it" \
  "(../shared/anchors/stage.sh) and carry .anchors" >&2; exit 2; }
PY=${PYTHON:-python3}
export OUT=${OUT:-$A/out_norms}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$A/cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$A/cache/triton}
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
rm -rf "$A/site"
for w in "$A"/whl/liger_kernel-*.whl; do
  [ -f "$w" ] && "$PY" -m zipfile -e "$w" "$A/site"
done
HARD=$(( BUDGET - ($(date +%s) - T0) - 15 ))
SOFT=$(( HARD - 35 ))
[ "$SOFT" -ge 10 ] || { echo "anchors_norms.sh: budget too small" >&2; exit 2; }
echo "anchors_norms: hard limit ${HARD}s, no new case after ${SOFT}s, out $OUT"
timeout -k 5 "$HARD" "$PY" -u "$HERE/anchors_norms.py" --budget-s "$SOFT" \
  --out "$OUT/anchors_norms.jsonl" --prewarm-log "$OUT/anchors_norms_prewarm.log" \
  ${EXTRA[@]+"${EXTRA[@]}"} > "$OUT/anchors_norms.log" 2>&1
rc=$?
echo "anchors_norms.py: exit $rc after $(( $(date +%s) - T0 ))s"
tail -n 4 "$OUT/anchors_norms.log"
"$PY" "$A/summarize.py" "$OUT/anchors_norms.jsonl" ${JOIN[@]+"${JOIN[@]}"} \
  > "$OUT/anchors_norms_summary.md" 2>&1
cat "$OUT/anchors_norms_summary.md"
exit $rc
