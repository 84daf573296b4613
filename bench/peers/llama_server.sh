#!/usr/bin/env bash
# Start llama.cpp's llama-server for the CPU comparison.
# usage: bench/peers/llama_server.sh PORT GGUF [extra llama-server flags...]
# LLAMA_SERVER=path/to/llama-server (default: llama-server on PATH).
# 32 slots with continuous batching, 2 threads (this machine has 2 cores), and a
# context of 32 x 1024 tokens so every slot holds a 512-token prefix + suffix + output.
# Prompts longer than a slot's 1024 tokens need `-kvu` (one KV pool the slots share;
# llama.cpp's attention then spans the whole pool, slower with many requests: c ran
# at 75 tok/s with it against 124 without).
set -euo pipefail
port=$1; gguf=$2; shift 2
exec "${LLAMA_SERVER:-llama-server}" -m "$gguf" --host 127.0.0.1 --port "$port" \
  -t 2 -tb 2 --parallel 32 -cb -c 32768 -b 2048 -ub 512 --alias SmolLM2-135M-Instruct \
  "$@"
