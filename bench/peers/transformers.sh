#!/usr/bin/env bash
# Start `transformers serve` (continuous batching, bf16, CPU) on a local model directory,
# offline, through bench/peers/transformers_serve.py (which only adds `ignore_eos`).
# usage: bench/peers/transformers.sh PORT MODEL_DIR [extra transformers serve flags...]
# TRANSFORMERS_CB=0 serves without continuous batching (one `generate` per request).
# Clients must send "model": MODEL_DIR (the server is pinned to it; its /v1/models
# lists only models in the Hugging Face cache, so it names none here).
set -euo pipefail
port=$1; model=$2; shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
export HF_HUB_OFFLINE=1
# /v1/models scans the hub cache and answers 500 when the folder does not exist.
export HF_HUB_CACHE=${HF_HUB_CACHE:-${TMPDIR:-/tmp}/kvserve-compare-empty-hf-hub}
mkdir -p "$HF_HUB_CACHE"
# KV cache of 1024 blocks x 32 tokens (the default sizes it by memory share: 8 GB here)
# and the same per-step token budget as kvserve's --max-num-batched-tokens.
cb_args=(--continuous-batching --cb-block-size 32 --cb-num-blocks 1024 --cb-max-batch-tokens 1024)
[[ "${TRANSFORMERS_CB:-1}" == 0 ]] && cb_args=(--no-continuous-batching)
exec "$py" "$root/bench/peers/transformers_serve.py" --host 127.0.0.1 --port "$port" \
  --device cpu --dtype bfloat16 "${cb_args[@]}" \
  --log-level warning "$@" "$model"
