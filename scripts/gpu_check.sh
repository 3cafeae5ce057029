#!/usr/bin/env bash
# `make gpu-check`: the kernel tests marked `gpu`, then the MoE-LoRA layer benchmark, on a CUDA
# machine. Logs and CSVs go under $OUT (default ./gpu_check_out). TUNE=1 first re-tunes the fused
# MoE launch configs (writes moelora/kernels/configs/fused_moe_<gpu>.json and a copy under $OUT).
# Exit status: non-zero if any stage failed; every stage runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rc=0
"$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$OUT/kernel_tests.log" || rc=1
if [ "${TUNE:-0}" = 1 ]; then
  "$PY" benchmarks/tune_fused_moe.py 2>&1 | tee "$OUT/tune.log" || rc=1
fi
"$PY" benchmarks/moe_lora_layer.py "$OUT/moe_lora_layer.csv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/moe_lora_layer.log" || rc=1
exit $rc
