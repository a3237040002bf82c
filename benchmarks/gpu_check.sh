#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): KV commit vs its write floor, the attention backends at a
# full Wan-1.3B window vs the H200 floors, and the causal Wan2.1-T2V-1.3B (Self-Forcing policy, random
# weights, 480x832) rollout through the engine with the Wan VAE: denoise / commit / VAE decode / overhead,
# the umT5-XXL text encode when the time guard allows, end-to-end frames/s, Matrix-Game 2.0, and last (e)
# wan_batch: the same Wan-1.3B with its VAE, one engine serving B = 8, 4, 2, 1 sessions per tick (players
# per H200 at 16 fps); one JSON. A full run's guard usually has no time left for (e): run it alone with
# `bash benchmarks/gpu_check.sh --sections wan_batch --out benchmarks/results/gpu_check_wan_batch.json`.
# Usage: bash benchmarks/gpu_check.sh [--smoke] [--out PATH] [--budget-s S] [--world-backend auto|xla|cudnn]
#        [--sections commit,attend,world,matrix_game,wan_batch,dreamzero]
# (f) dreamzero: DreamZero-DROID robot inference calls (random bf16 weights) next to the release's ~3 s on two
# H100s; run it alone: `bash benchmarks/gpu_check.sh --sections dreamzero --out benchmarks/results/gpu_check_dreamzero.json`.
# The script's own time guard ends it before the 290 s timeout below; the JSON is rewritten after
# every section, so even a killed run leaves what it measured.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # `-m benchmarks.gpu_check` from any directory

out="$root/benchmarks/results/gpu_check.json"
previous=""
explicit_out=0
for arg in "$@"; do
  if [[ "$previous" == "--out" ]]; then
    out="$arg"; explicit_out=1
  elif [[ "$arg" == --out=* ]]; then
    out="${arg#--out=}"; explicit_out=1
  elif [[ "$arg" == "--smoke" && $explicit_out -eq 0 ]]; then
    out="$root/benchmarks/results/gpu_check_smoke.json"
  fi
  previous="$arg"
done

status=0
timeout 290 "${PYTHON:-python}" -m benchmarks.gpu_check "$@" || status=$?
if [[ $status -eq 124 ]]; then
  echo "gpu_check: killed by the 290 s timeout; partial results (\"complete\": false) in $out" >&2
fi
echo "gpu_check JSON: $out"
exit "$status"
