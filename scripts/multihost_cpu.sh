#!/usr/bin/env bash
# Multi-host check on one CPU machine: examples/train_kunlun.py as 2 processes of 4 CPU devices
# each (--multi-host, Gloo collectives) trains 4 steps with checkpoints, resumes to 6, and must
# end where one process of 8 CPU devices training 6 steps straight does (final line's loss,
# log-loss and AUC within float32 rounding).
# About 2 minutes of CPU. Usage: scripts/multihost_cpu.sh [port]
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
port="${1:-12357}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
common=(examples/train_kunlun.py --devices 8 --model-parallel 2 --batch-size 16 --max-seq-len 8
        --eval-every 2 --dtype float32 --implementation xla)
two_processes() {  # extra flags for both processes; logs $tmp/p0.log, $tmp/p1.log
  for i in 0 1; do
    XLA_FLAGS=--xla_force_host_platform_device_count=4 "$python" "${common[@]}" --multi-host \
      --coordinator-address "localhost:$port" --num-processes 2 --process-id "$i" \
      --checkpoint-dir "$tmp/ckpt" "$@" > "$tmp/p$i.log" 2>&1 &
  done
  wait
  port=$((port + 1))
}
XLA_FLAGS=--xla_force_host_platform_device_count=8 "$python" "${common[@]}" --steps 6 \
  > "$tmp/one.log" 2>&1 &
two_processes --steps 4
two_processes --steps 6 --resume
wait
status=0
for i in 0 1; do
  grep -q "start_step=4 " "$tmp/p$i.log" || { echo "process $i did not resume at step 4"; status=1; }
  # Gloo's all-reduce may add in another order than one process: equal to float32 rounding.
  "$python" - "$tmp/one.log" "$tmp/p$i.log" <<'PY' || { tail -n 20 "$tmp/p$i.log"; status=1; }
import math, sys
def final(path):
  line = [l for l in open(path) if l.startswith("final:")][-1]
  return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
want, got = final(sys.argv[1]), final(sys.argv[2])
tolerance = {"train_loss": 1e-5, "val_logloss": 1e-5, "val_auc": 1e-4, "steps": 0}
bad = {k: (got[k], want[k]) for k, tol in tolerance.items()
       if not math.isclose(got[k], want[k], rel_tol=tol, abs_tol=tol)}
print(f"{sys.argv[2]}: {'differs ' + str(bad) if bad else 'ok'} (one process: {want})")
sys.exit(1 if bad else 0)
PY
done
[ "$status" = 0 ] && echo "multi-host ok"
exit "$status"
