#!/usr/bin/env bash
# One device-tool call on a lent GPU machine: the engine tests on CUDA, then
# bench/gpu_decode.py on the Llama-3.2-1B and Llama-3.1-8B presets (random weights,
# nothing downloaded). The machine has torch, triton and transformers but no package
# registry and no kvserve install, so everything runs from this source tree.
#
#   run(command="COMMIT=<short sha> bash bench/gpu_session.sh", timeout_s=600)
#
# COMMIT is optional: the copy sent to the machine may have no .git, so say which
# commit it is. ONLY="quant_8b forward_1b" runs just those stages (the stages
# together outlast one call's 600 s: a second call takes the rest). Results land in $OUT (at most 8 files come back): summary.txt,
# tests.log, forward_1b.log, bench_<preset>.log, gpu_decode_<preset>.json and
# step_overhead_1b.log. Each stage has its own time limit, so a hang in one still
# leaves the others' results, all inside the tool's 600 s. Overrides: TESTS (test paths), TESTS_S (their limit), RUNS ("preset:
# seconds" pairs), BENCH_ARGS (flags for every bench run, e.g. "--attention-backend
# torch"). A CPU dry run of the mechanics:
#   RUNS=llama-tiny:120 BENCH_ARGS="--prompt-len 64 --decode-tokens 8" TESTS=tests/bench \
#     OUT=/tmp/out bash bench/gpu_session.sh
set -u
OUT=${OUT:-/tmp/kvserve-gpu-session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Nothing outside the machine can be reached: fail fast instead of waiting on it.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 KVSERVE_CACHE=/tmp/kvserve-cache
# Real kernels on the GPU (tests/conftest.py turns the interpreter on when unset).
export TRITON_INTERPRET=0
export KVSERVE_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

# stage NAME SECONDS CMD...: log to $OUT/NAME.log, one line per stage in summary.txt.
stage() {
  local name=$1 limit=$2 start rc
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{
  echo "commit $KVSERVE_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c 'import sys, torch, transformers; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available()); print("transformers", transformers.__version__)'
  $PY -c 'import triton; print("triton", triton.__version__)'
} >>"$OUT/summary.txt" 2>&1

# Not `slow`: those need the default model, which comes from a package registry. A
# module whose imports are missing there (fastapi, httpx?) fails alone, not the stage.
# Issue 23: tests/engine/parallel runs tensor parallelism over gloo there too; the
# bench stages below are TP=1 through the model code that shards (at one rank its
# row-parallel and vocabulary-parallel layers are plain Linear and Embedding), so
# their figures are the "unchanged at TP=1" check. Multi-GPU TP waits for a machine
# with several GPUs.
stage tests "${TESTS_S:-140}" $PY -m pytest -q -p no:cacheprovider --maxfail=10 \
  --continue-on-collection-errors \
  -m "not slow" ${TESTS:-tests/engine tests/bench tests/server/test_engine_process.py}
for run in ${RUNS:-llama-3.2-1b:140 llama-3.1-8b:190}; do
  preset=${run%%:*}
  stage "bench_$preset" "${run##*:}" $PY bench/gpu_decode.py --preset "$preset" \
    --json "$OUT/gpu_decode_$preset.json" ${BENCH_ARGS:-}
done

# Issue 4's denominator: one decode step of the 1B shape at 256 running requests, and
# the scheduler's share of it, synchronous and then with async scheduling (the host
# work overlapped with the device). Its JSON is printed into the log (8 files come
# back).
stage step_overhead_1b "${STEP_S:-110}" $PY bench/step_overhead.py \
  --model preset:llama-3.2-1b --load-format random --running 256 --steps 20 \
  --async-scheduling both

# Issue 18: the 1B shape's batch-1 decode eager (no CUDA graphs), with CUDA graphs
# (today's default), and with the Inductor-compiled forward pass as well (mixed steps
# compiled; decode graphs still capture the eager forward: see engine/compiled_model.py).
# Issue 20: and with --quantization int8 / int4 (weight-only; on CUDA the weights are
# still expanded per call, so these are the figures a fused kernel has to beat).
# One stage, one log (forward_1b.log): at most 8 files come back. Last, as the
# stages together can outlast the tool's 600 s (trim RUNS to make room).
stage forward_1b "${FORWARD_S:-180}" bash -c 'for mode in "--enforce-eager" \
    "--compile off" "--compile wait" "--compile off --quantization int8" \
    "--compile off --quantization int4"; do echo "== $mode"; '"$PY"' bench/gpu_decode.py \
    --preset llama-3.2-1b --transformers off --prompt-len 256 --decode-tokens 64 \
    --split-decode-tokens 8 --repeats 2 $mode | grep -E "\"(tok_s|step_ms|median_s)\""
  done'

# Issue 20 on the 8B shape: batch-1 decode tok/s and MBU with bf16 weights, then
# fp8 (e4m3 weights and per-token activations through torch._scaled_mm), int8 and
# int4 (weight-only), then an fp8 KV cache at a 4k context (the bytes it halves are
# the context's, so the prompt is long). One log, quant_8b.log.
stage quant_8b "${QUANT_S:-300}" bash -c 'for mode in "" "--quantization fp8" \
    "--quantization int8" "--quantization int4" "--prompt-len 4096 --kv-cache-dtype auto" \
    "--prompt-len 4096 --kv-cache-dtype fp8"; do echo "== $mode"; '"$PY"' bench/gpu_decode.py \
    --preset llama-3.1-8b --transformers off --prompt-len 512 --decode-tokens 64 \
    --split-decode-tokens 64 --repeats 2 $mode | grep -E "\"(tok_s|step_ms|median_s|mbu)\""
  done'

# Issue 22 on CUDA: output tok/s of 16 requests over 4 rank-16 adapters (the BGMV
# Triton kernels) against 16 base-model requests on the same engine, and on one
# without --enable-lora; the 1B shape, random weights and random adapters (decode
# steps replay CUDA graphs captured with and without the adapters' product).
stage lora_1b "${LORA_S:-150}" $PY bench/lora_overhead.py --model preset:llama-3.2-1b \
  --load-format random --compile off --rounds 2

[ -f "$OUT/tests.log" ] && tail -n 3 "$OUT/tests.log" >>"$OUT/summary.txt"
$PY bench/gpu_summary.py "$OUT"/gpu_decode_*.json | tee -a "$OUT/summary.txt"
