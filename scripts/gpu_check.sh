#!/usr/bin/env bash
# `make gpu-check`: every test marked `gpu`, then the benchmarks, on a CUDA machine.
# Logs and CSVs go under $OUT (default ./gpu_check_out). Stages (all on by default):
#   TESTS=1  pytest -m gpu over tests/ (kernels, engine equivalences, demo under graphs)
#   LAYER=1  benchmarks/moe_lora_layer.py (TUNE=1 first re-tunes the fused MoE launch configs, TUNE_ARGS
#            e.g. "--lora-only --ms 1,8,32,128,512": keep the tiles, re-pick the LoRA paths)
#   DECODE=1 benchmarks/decode.py (DECODE_ARGS, e.g. "--model all --conc 1,8,64,256"); then once more per
#            ';'-separated flag set of DECODE_VARIANTS, e.g. "--async-scheduling;--no-overlap-lora";
#            DECODE_ROUNDS=N runs that sequence N times (logs decode[_vI]_rK.log): settings decode.py cannot
#            A/B in one process (module-level ones, e.g. --no-overlap-lora) alternate, so drift
#            between runs shows up instead of passing for a difference
#   DENSE=0  benchmarks/lora_linear.py (DENSE_ARGS, e.g. "--ts 64,256 --shapes qkv,o --modes split,planned
#            --variants off,1ad_r16,8ad_r16"): the dense LoRA linear's paths per call
#   DELTA=0  benchmarks/moe_lora_delta.py (DELTA_ARGS, e.g. "--ms 64,256 --shape dsv2_lite"): the routed-expert
#            LoRA delta kernels alone against their bytes bound
#   HOST=0   benchmarks/host_overhead.py --device cuda (HOST_ARGS): the host phases of a decode step
#   PROFILE=0 benchmarks/decode_profile.py (PROFILE_ARGS): host phases, graph replay, top kernels
#   PREFILL=0 benchmarks/prefill.py (PREFILL_ARGS, e.g. "--layers 12 --profile"): whole-engine prefill tokens/s and
#            % of the matmul peak at 512 / 2048 / 8192-token prompts, no LoRA / 1 / 8 adapters; --profile: where
#            a prefill step goes
#   SERVE=0  benchmarks/serve.py against benchmarks/serve_model.py's model directory (SERVE_MODEL_ARGS, default
#            "--shape qwen3_30b --layers 8 --adapters 0"; served with --load-format dummy and SERVE_SERVER_ARGS),
#            one run per ';'-separated --structured-fraction of SERVE_STRUCTURED (default "0;0.25": what JSON-mode
#            requests cost the load beside them), SERVE_ARGS e.g. "--num-prompts 128 --request-rate inf"; needs
#            the server's packages (fastapi, uvicorn, httpx: carry their wheels), skipped without them
#   AB=0     a same-run A/B against another commit, prepared here by `scripts/ab_base.sh COMMIT` (.ab_base/,
#            carried to the device): the LAYER bench (BENCH_ARGS) and, with DENSE=1, the DENSE one (DENSE_ARGS),
#            run from .ab_base and from this tree in alternation, AB_ROUNDS times (default 2): *_base_rK / *_rK;
#            AB_DECODE=1 alternates decode.py (DECODE_ARGS) the same way, for a change with no EngineConfig
#            switch for decode.py --ab (e.g. a kernel swapped inside a layer; with LAYER=0 DECODE=0 for that alone)
#   PACK=1   at the end, every log and CSV into $OUT/gpu_check.tgz (the device returns at most 8 files), and
#            $OUT/summary.txt (the tail of each log) beside it
# Exit status: non-zero if any stage failed; every stage runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
echo "commit ${COMMIT:-unknown (pass COMMIT=...)}" | tee -a "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  skip=""  # the server tests import fastapi at collection; GPU images often lack it (and they have no gpu tests)
  "$PY" -c "import fastapi" 2>/dev/null || skip="--ignore=tests/server"
  "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs $skip ${TEST_ARGS:-tests/} 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [ "${TUNE:-0}" = 1 ]; then
  "$PY" benchmarks/tune_fused_moe.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" || rc=1
fi
if [ "${AB:-0}" = 1 ]; then
  if [ ! -f .ab_base/COMMIT ]; then
    echo "AB=1: no .ab_base/ (run scripts/ab_base.sh COMMIT here and carry .ab_base)" | tee "$OUT/ab.log"; rc=1
  else
    echo "A/B: base $(cat .ab_base/COMMIT) vs this tree (${COMMIT:-unknown})" | tee "$OUT/ab.log"
    for ((r = 1; r <= ${AB_ROUNDS:-2}; r++)); do
      for side in base head; do
        root="$PWD"; sfx="_r$r"
        [ $side = base ] && root="$PWD/.ab_base" && sfx="_base_r$r"
        if [ "${LAYER:-1}" = 1 ]; then
          PYTHONPATH="$root" "$PY" "$root/benchmarks/moe_lora_layer.py" "$OUT/moe_lora_layer$sfx.csv" ${BENCH_ARGS:-} \
            > "$OUT/moe_lora_layer$sfx.log" 2>&1 || rc=1
        fi
        if [ "${DENSE:-0}" = 1 ]; then
          PYTHONPATH="$root" "$PY" "$root/benchmarks/lora_linear.py" "$OUT/lora_linear$sfx.csv" ${DENSE_ARGS:-} \
            > "$OUT/lora_linear$sfx.log" 2>&1 || rc=1
        fi
        if [ "${AB_DECODE:-0}" = 1 ]; then
          PYTHONPATH="$root" "$PY" "$root/benchmarks/decode.py" "$OUT/decode_ab$sfx.csv" ${DECODE_ARGS:-} \
            > "$OUT/decode_ab$sfx.log" 2>&1 || rc=1
        fi
      done
    done
  fi
elif [ "${LAYER:-1}" = 1 ]; then
  "$PY" benchmarks/moe_lora_layer.py "$OUT/moe_lora_layer.csv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/moe_lora_layer.log" || rc=1
fi
if [ "${DECODE:-1}" = 1 ]; then
  IFS=';' read -ra variants <<< "${DECODE_VARIANTS:-}"
  rounds="${DECODE_ROUNDS:-1}"
  for ((r = 1; r <= rounds; r++)); do
    sfx=""
    [ "$rounds" = 1 ] || sfx="_r$r"
    "$PY" benchmarks/decode.py "$OUT/decode$sfx.csv" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode$sfx.log" || rc=1
    for i in "${!variants[@]}"; do
      echo "# decode.py ${DECODE_ARGS:-} ${variants[$i]}" | tee "$OUT/decode_v$i$sfx.log"
      "$PY" benchmarks/decode.py "$OUT/decode_v$i$sfx.csv" ${DECODE_ARGS:-} ${variants[$i]} 2>&1 \
        | tee -a "$OUT/decode_v$i$sfx.log" || rc=1
    done
  done
fi
if [ "${DENSE:-0}" = 1 ] && [ "${AB:-0}" != 1 ]; then
  "$PY" benchmarks/lora_linear.py "$OUT/lora_linear.csv" ${DENSE_ARGS:-} 2>&1 | tee "$OUT/lora_linear.log" || rc=1
fi
if [ "${DELTA:-0}" = 1 ]; then
  "$PY" benchmarks/moe_lora_delta.py "$OUT/moe_lora_delta.csv" ${DELTA_ARGS:-} 2>&1 | tee "$OUT/moe_lora_delta.log" || rc=1
fi
if [ "${HOST:-0}" = 1 ]; then
  "$PY" benchmarks/host_overhead.py --device cuda ${HOST_ARGS:-} 2>&1 | tee "$OUT/host_overhead.log" || rc=1
fi
if [ "${PROFILE:-0}" = 1 ]; then
  "$PY" benchmarks/decode_profile.py "$OUT/decode_profile.txt" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/decode_profile.log" || rc=1
fi
if [ "${PREFILL:-0}" = 1 ]; then
  "$PY" benchmarks/prefill.py "$OUT/prefill.csv" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.log" || rc=1
fi
if [ "${SERVE:-0}" = 1 ]; then
  if ! "$PY" -c "import fastapi, uvicorn, httpx" 2>/dev/null; then
    echo "SERVE=1: fastapi / uvicorn / httpx not importable: skipped" | tee "$OUT/serve.log"; rc=1
  else
    assets="$(mktemp -d)"
    model="$assets/model"  # serve_model.py writes OUT/model (and OUT/adapters)
    "$PY" benchmarks/serve_model.py "$assets" ${SERVE_MODEL_ARGS:---shape qwen3_30b --layers 8 --adapters 0} \
      > "$OUT/serve_model.log" 2>&1 || rc=1
    IFS=';' read -ra fractions <<< "${SERVE_STRUCTURED:-0;0.25}"
    for f in "${fractions[@]}"; do
      "$PY" benchmarks/serve.py --model "$model" --structured-fraction "$f" --json "$OUT/serve_s$f.json" \
        ${SERVE_ARGS:-} -- --load-format dummy ${SERVE_SERVER_ARGS:-} 2>&1 | tee "$OUT/serve_s$f.log" || rc=1
    done
    rm -rf "$assets"
  fi
fi
if [ "${PACK:-1}" = 1 ]; then
  (cd "$OUT" && for f in *.log; do [ -f "$f" ] && { echo "== $f"; tail -n 25 "$f"; }; done) > "$OUT/summary.txt" 2>/dev/null
  files=$(cd "$OUT" && ls | grep -v -x -e gpu_check.tgz -e summary.txt -e gpu.txt || true)
  if [ -n "$files" ]; then
    (cd "$OUT" && tar czf gpu_check.tgz $files && rm -rf $files)
  fi
  echo "packed $OUT/gpu_check.tgz; $OUT/summary.txt holds each log's tail"
fi
exit $rc
