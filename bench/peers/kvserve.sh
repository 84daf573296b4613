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
# kvserve's defaults (dtype auto: bf16 where the CPU has native bf16), except that
# the forward pass is compiled before the server answers (--compile wait) instead of
# in the background while it serves eagerly: the same compiled path, but none of the
# timed requests runs before it is ready.
src=${KVSERVE_SRC:-$root}
# Where the CLI lives in that tree: trees from before kvserve was one installed
# package (issue 51) name it by its old top-level name.
if [[ -f $src/server/entrypoints/cli.py ]]; then entry=kvserve.server.entrypoints.cli
elif [[ -d $src/kvserve ]]; then entry=kvserve.server.cli
else entry=server.cli; fi
exec "$py" -c "import sys; from $entry import main; sys.argv[0] = 'kvserve'; sys.exit(main())" \
  serve "${model_args[@]}" --host 127.0.0.1 --port "$port" --compile wait "$@"
