#!/usr/bin/env bash
# Start llama.cpp's llama-server for the CPU comparison.
# usage: bench/peers/llama_server.sh PORT GGUF [extra llama-server flags...]
# LLAMA_SERVER=path/to/llama-server (default: llama-server on PATH).
# 2 threads (this machine has 2 cores), continuous batching, and LLAMA_SLOTS slots
# (default 32; 64 matches kvserve's --max-num-seqs for the high-concurrency workload)
# over one KV pool of 32768 tokens that the slots share (-kvu, as kvserve's paged
# pool is shared): a 4096-token prompt fits (a slot's own 1024 tokens would not).
set -euo pipefail
port=$1; gguf=$2; shift 2
exec "${LLAMA_SERVER:-llama-server}" -m "$gguf" --host 127.0.0.1 --port "$port" \
  -t 2 -tb 2 --parallel "${LLAMA_SLOTS:-32}" -kvu -cb -c 32768 -b 2048 -ub 512 \
  --alias SmolLM2-135M-Instruct "$@"
