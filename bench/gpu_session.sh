#!/usr/bin/env bash
# One device-tool call on a lent GPU machine: the CUDA paths' tests, then batch-1
# decode of the 1B and 8B presets (random weights, nothing downloaded) beside
# transformers, then the 1B forward-pass modes, then the rest as time allows. The
# machine has torch, triton and transformers but no package registry and no kvserve
# install, so everything runs from this source tree, and the packages kvserve needs
# that its image lacks (xgrammar, pydantic, fastapi, ...) travel as wheels. Here:
#
#   bash bench/gpu_wheels.sh      # .whl/, 15 MB, git-ignored
#   run(command="COMMIT=<short sha> bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# A session has 15 minutes of device time, the machine's start (1-2 min) included,
# and one call at most 600 s. The stages, in order of value, share one deadline
# (DEADLINE_S=570 s from this script's start): each gets min(its limit, time left
# - 20 s), one that would get less than its minimum is not started, and the
# summary names it for the next call. The stages and limits (s), what no call has
# measured yet first (the first call, 2026-11-28: bench/results/gpu_h100_2026-11-28.md):
#
#   tests 150            the CUDA paths' test files in 8 processes (Triton attention,
#                        KV store, CUDA graphs, fp8 cache, LoRA and fused-MoE
#                        kernels, parity in float32, the second KV tier's
#                        device-to-host copies)
#   families 120         every model family through the engine on CUDA (Triton
#                        windows, soft-caps, sinks, fused-MoE kernels, CUDA graphs),
#                        float32 parity with transformers; log in families.log
#   moe_kernels 60       the fused-MoE Triton GEMMs at a Qwen3-30B-A3B layer
#   latent_kernels 45    DeepSeek-V3's latent attention kernels: decode GB/s, a
#                        prompt chunk absorbed against expanded
#   profile_1b 90        the 1B batch-1 step under torch.profiler, sync and async:
#                        GPU busy time, the host's share, the costliest kernels
#   step_overhead_1b 110 a step at 256 running, scheduler share, sync and async
#   ------------------   (575 s of limits, past the 550 s a call has: a stage that
#                        ends early gives its time to the next; what follows runs
#                        only if the above ended early)
#   quant_8b 300         8B: bf16, fp8, int8, int4 weights; fp8 KV cache at 4k context
#   forward_1b 150       1B batch-1 decode: eager, CUDA graphs, int8, int4, compiled
#   lora_1b 150          16 requests over 4 adapters against the base model
#   bench_1b 90          bench/gpu_decode.py, Llama-3.2-1B shape: batch-1 tok/s, MBU
#                        against the copy bandwidth measured in the run, TTFT of 1,024
#                        tokens, the 1,024 + 512 split, transformers in the same run
#   bench_8b 140         the same, Llama-3.1-8B shape
#
# Not a stage yet: prefill/decode disaggregation on CUDA (engine/kv_transfer/). The
# prefill side registers its KV cache, device memory there, with Mooncake's
# transfer engine, which needs its CUDA build (`mooncake-transfer-engine`, not in
# the image and not among the wheels carried: kvserve refuses to start without it
# there). A session that carries it: tests/engine/test_pd_disaggregation.py's two
# engines with device cuda, then bench/pd_disaggregation.py's workload on one GPU
# split into two instances (--kv-cache-memory halves); RDMA waits for two hosts.
#
# The device tool cuts a command at timeout_s, or sooner when less device time is left
# (a failed start or a fall-back to another GPU kind costs 1-2 minutes of it): read
# status's budget_left_s first and, if a cold start will leave under ~600 s, pass
# DEADLINE_S=<what is left - 30>. A cut loses nothing written so far.
# A later call (the machine stays warm ~30 s) or the next session: ONLY="quant_8b
# step_overhead_1b lora_1b" (or what summary.txt's "next call" line says).
# COMMIT is optional: the copy sent to the machine may have no .git, so say which
# commit it is. Four files come back in $OUT: summary.txt (read it first),
# results.json (every run's JSON, copied in as each phase ends, so a cut run keeps
# what it measured), tests.log, stages.log. Overrides: ONLY, LIMITS ("stage:s ..."),
# DEADLINE_S, TESTS, BENCH_ARGS (e.g. "--attention-backend torch"), PRESET_1B,
# PRESET_8B, WHEELS. The stages themselves: bench/gpu_session.py.
#
# The whole script on this CPU, tiny shapes, importing as the GPU image would (the
# wheels' list taken as installed; nothing downloaded), every stage must end ok:
#   make gpu-dry-run      (KVSERVE_GPU_DRY_RUN=1 bash bench/gpu_session.sh)
set -u
KVSERVE_SESSION_START=${KVSERVE_SESSION_START:-$(date +%s)}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve-gpu-session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export OUT KVSERVE_SESSION_START PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# Nothing outside the machine can be reached: fail fast instead of waiting on it.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export KVSERVE_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ "${KVSERVE_GPU_DRY_RUN:-0}" = 1 ]; then
  # Triton through its CPU interpreter (tests/conftest.py would set it too).
  export TRITON_INTERPRET=1
else
  # Real kernels on the GPU; a cache of our own (the machine is bare anyway).
  export TRITON_INTERPRET=0 KVSERVE_CACHE=/tmp/kvserve-cache
  # The wheels bench/gpu_wheels.sh fetched (carried in .whl), for this run only.
  WHEELS=${WHEELS:-.whl}
  SITE=/tmp/kvserve-site
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl >>"$OUT/stages.log" 2>&1 \
      && export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    echo "no wheels in $WHEELS: run bench/gpu_wheels.sh here and carry .whl" >>"$OUT/stages.log"
  fi
fi
export PYTHON="$PY"
exec $PY bench/gpu_session.py
