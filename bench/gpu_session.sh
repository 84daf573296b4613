#!/usr/bin/env bash
# One device-tool call on a lent GPU machine: the engine tests on CUDA, then
# bench/gpu_decode.py on the Llama-3.2-1B and Llama-3.1-8B presets (random weights,
# nothing downloaded). The machine has torch, triton and transformers but no package
# registry and no kvserve install, so everything runs from this source tree, and the
# packages kvserve needs that its image lacks (xgrammar, pydantic, fastapi, ...: the
# engine does not import without xgrammar) travel as wheels. Here, first:
#
#   bash bench/gpu_wheels.sh      # .whl/, 15 MB, git-ignored
#   run(command="COMMIT=<short sha> bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# A session has 15 minutes of device time, the machine's start (1-2 min) included,
# and one call at most 600 s. The default stages fit one call (~530 s of limits):
# tests, bench_llama-3.2-1b, bench_llama-3.1-8b, forward_1b. The rest, in this order
# of value, is the next call's or the next GPU session's:
#   ONLY="quant_8b step_overhead_1b lora_1b"      (~560 s of limits)
# (while the machine is warm, ~30 s after a call, a second call needs no start).
# COMMIT is optional: the copy sent to the machine may have no .git, so say which
# commit it is. Results land in $OUT (at most 8 files come back): summary.txt,
# tests.log, bench_<preset>.log, gpu_decode_<preset>.json, forward_1b.log (then
# quant_8b.log, step_overhead_1b.log, lora_1b.log). Each stage has its own time limit,
# so a hang in one still leaves the others' results. Overrides: ONLY (stages), TESTS
# (test paths), TESTS_S (their limit), RUNS ("preset:seconds" pairs), BENCH_ARGS (flags
# for every bench run, e.g. "--attention-backend torch"), WHEELS (the wheels' folder).
# A CPU dry run of the mechanics, importing as the machine's image would
# (bench/gpu_image_check.py refuses what the image lacks; wheels for this Python):
#   PYVER=3.11 WHEELS=/tmp/whl bash bench/gpu_wheels.sh
#   PYTHON=".venv/bin/python bench/gpu_image_check.py --site /tmp/kvserve-site" \
#     WHEELS=/tmp/whl PRESET_1B=llama-tiny PRESET_8B=llama-tiny TESTS=tests/bench \
#     ONLY="tests bench_llama-tiny forward_1b quant_8b step_overhead_1b lora_1b" \
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
# The wheels bench/gpu_wheels.sh fetched (carried in .whl), installed for this run only.
WHEELS=${WHEELS:-.whl}
SITE=/tmp/kvserve-site
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl >>"$OUT/summary.txt" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:$SITE"
else
  echo "no wheels in $WHEELS: run bench/gpu_wheels.sh here and carry .whl" >>"$OUT/summary.txt"
fi

# The shapes the stages measure (a dry run on CPU names llama-tiny for both).
PRESET_1B=${PRESET_1B:-llama-3.2-1b} PRESET_8B=${PRESET_8B:-llama-3.1-8b}
RUNS=${RUNS:-$PRESET_1B:100 $PRESET_8B:150}
# The first call's stages (see above), unless ONLY names others.
ONLY=${ONLY:-tests $(for run in $RUNS; do printf 'bench_%s ' "${run%%:*}"; done)forward_1b}
echo "stages: $ONLY" >>"$OUT/summary.txt"

# stage NAME SECONDS CMD...: log to $OUT/NAME.log, one line per stage in summary.txt.
stage() {
  local name=$1 limit=$2 start rc
  shift 2
  if [[ " $ONLY " != *" $name "* ]]; then return; fi
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
  # What every stage imports: a missing package shows here, once, not in each log.
  $PY -c 'import engine.engine, server.app, bench.gpu_decode; print("kvserve imports")'
} >>"$OUT/summary.txt" 2>&1

# Not `slow`: those need the default model, which comes from a package registry. A
# test module whose imports are missing there fails alone, a conftest's stops the
# whole collection (tests/server/conftest.py imports openai: the wheels bring it).
# Issue 23: tests/engine/parallel runs tensor parallelism over gloo there too; the
# bench stages below are TP=1 through the model code that shards (at one rank its
# row-parallel and vocabulary-parallel layers are plain Linear and Embedding), so
# their figures are the "unchanged at TP=1" check. Multi-GPU TP waits for a machine
# with several GPUs.
# The files that test CUDA paths first (kernels, CUDA graphs, the engine over them),
# in case the stage's limit cuts the rest; pytest collects each file once.
CUDA_FIRST="tests/engine/attention tests/engine/test_decode_graphs.py
  tests/engine/lora/test_triton_lora.py tests/engine/test_parity.py tests/engine/test_engine.py
  tests/engine/test_kv_fp8.py tests/engine/test_fp8_weights.py tests/engine/test_quantization.py
  tests/engine/test_structured_outputs.py tests/engine/spec_decode"
# -v: a line per test as it ends, so a stage cut at its limit still says how far it got.
stage tests "${TESTS_S:-140}" $PY -m pytest -v --tb=short -p no:cacheprovider --maxfail=10 \
  --continue-on-collection-errors \
  -m "not slow" ${TESTS:-$CUDA_FIRST tests/engine tests/bench tests/server/test_engine_process.py}
for run in $RUNS; do
  preset=${run%%:*}
  stage "bench_$preset" "${run##*:}" $PY bench/gpu_decode.py --preset "$preset" \
    --json "$OUT/gpu_decode_$preset.json" ${BENCH_ARGS:-}
done

# Issue 4's denominator: one decode step of the 1B shape at 256 running requests, and
# the scheduler's share of it, synchronous and then with async scheduling (the host
# work overlapped with the device). Its JSON is printed into the log (8 files come
# back).
stage step_overhead_1b "${STEP_S:-110}" $PY bench/step_overhead.py \
  --model "preset:$PRESET_1B" --load-format random --running 256 --steps 20 \
  --async-scheduling both

# Issue 18: the 1B shape's batch-1 decode eager (no CUDA graphs), with CUDA graphs
# (today's default), and with the Inductor-compiled forward pass as well (mixed steps
# compiled; decode graphs still capture the eager forward: see engine/compiled_model.py).
# Issue 20: and with --quantization int8 / int4 (weight-only; on CUDA the weights are
# still expanded per call, so these are the figures a fused kernel has to beat).
# One stage, one log (forward_1b.log): at most 8 files come back. The last of the
# first call's stages.
stage forward_1b "${FORWARD_S:-150}" bash -c 'for mode in "--enforce-eager" \
    "--compile off" "--compile wait" "--compile off --quantization int8" \
    "--compile off --quantization int4"; do echo "== $mode"; '"$PY"' bench/gpu_decode.py \
    --preset '"$PRESET_1B"' --transformers off --prompt-len 256 --decode-tokens 64 \
    --split-decode-tokens 8 --repeats 2 $mode | grep -E "\"(tok_s|step_ms|median_s)\""
  done'

# Issue 20 on the 8B shape: batch-1 decode tok/s and MBU with bf16 weights, then
# fp8 (e4m3 weights and per-token activations through torch._scaled_mm), int8 and
# int4 (weight-only), then an fp8 KV cache at a 4k context (the bytes it halves are
# the context's, so the prompt is long). One log, quant_8b.log.
stage quant_8b "${QUANT_S:-300}" bash -c 'for mode in "" "--quantization fp8" \
    "--quantization int8" "--quantization int4" "--prompt-len 4096 --kv-cache-dtype auto" \
    "--prompt-len 4096 --kv-cache-dtype fp8"; do echo "== $mode"; '"$PY"' bench/gpu_decode.py \
    --preset '"$PRESET_8B"' --transformers off --prompt-len 512 --decode-tokens 64 \
    --split-decode-tokens 64 --repeats 2 $mode | grep -E "\"(tok_s|step_ms|median_s|mbu)\""
  done'

# Issue 22 on CUDA: output tok/s of 16 requests over 4 rank-16 adapters (the BGMV
# Triton kernels) against 16 base-model requests on the same engine, and on one
# without --enable-lora; the 1B shape, random weights and random adapters (decode
# steps replay CUDA graphs captured with and without the adapters' product).
stage lora_1b "${LORA_S:-150}" $PY bench/lora_overhead.py --model "preset:$PRESET_1B" \
  --load-format random --compile off --rounds 2

[ -f "$OUT/tests.log" ] && tail -n 3 "$OUT/tests.log" >>"$OUT/summary.txt"
$PY bench/gpu_summary.py "$OUT"/gpu_decode_*.json | tee -a "$OUT/summary.txt"
