#!/usr/bin/env bash
# Multi-host check on one CPU machine: examples/train_kunlun.py as 2 processes of 4 CPU devices
# each (--multi-host, Gloo collectives) trains 4 steps with checkpoints, resumes to 6, and must
# print the same final line as one process of 8 CPU devices training 6 steps straight.
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
want="$(grep '^final:' "$tmp/one.log" | sed 's/ step_ms=.*//; s/ examples_per_s=.*//')"
status=0
for i in 0 1; do
  got="$(grep '^final:' "$tmp/p$i.log" | sed 's/ step_ms=.*//; s/ examples_per_s=.*//')"
  grep -q "start_step=4 " "$tmp/p$i.log" || { echo "process $i did not resume at step 4"; status=1; }
  if [ -z "$want" ] || [ "$got" != "$want" ]; then
    echo "process $i: '$got' != one process: '$want'"; tail -n 20 "$tmp/p$i.log"; status=1
  fi
done
[ "$status" = 0 ] && echo "multi-host ok: $want"
exit "$status"
