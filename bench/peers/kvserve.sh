#!/usr/bin/env bash
# Start kvserve on the default model (or $MODEL) for the CPU comparison.
# usage: bench/peers/kvserve.sh PORT [extra kvserve serve flags...]
# KVSERVE_SRC=DIR runs the kvserve found in DIR (e.g. a `git archive HEAD` export)
# instead of the installed one, so the measured code is exactly one commit.
set -euo pipefail
port=$1; shift
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
if [[ -n "${KVSERVE_SRC:-}" ]]; then
  cd "$KVSERVE_SRC"
  export PYTHONPATH="$KVSERVE_SRC${PYTHONPATH:+:$PYTHONPATH}"
fi
model_args=()
[[ -n "${MODEL:-}" ]] && model_args=(--model "$MODEL")
exec "$py" -c 'import sys; from server.cli import main; sys.argv[0] = "kvserve"; sys.exit(main())' \
  serve "${model_args[@]}" --host 127.0.0.1 --port "$port" \
  --dtype bfloat16 --max-num-seqs 32 --max-num-batched-tokens 1024 "$@"
