#!/usr/bin/env bash
# The packages kvserve imports that the GPU machine's image lacks (its list:
# /work/.library/device/KINDS.md), downloaded here as wheels for its Python into .whl/
# (git-ignored), so that bench/gpu_session.sh can install them there with no registry:
#
#   bash bench/gpu_wheels.sh            # once, here
#   run(command="COMMIT=<sha> bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# Without them the engine does not import there: xgrammar (the sampler's grammar masks)
# is missing, and pydantic, fastapi, uvicorn, pyzmq, gguf, llguidance with it; nor do
# the tests collect without openai (tests/server/conftest.py imports it) or run the
# structured outputs' without jsonschema.
# The list and its versions: bench/gpu_wheels.txt. PYVER=3.11 WHEELS=DIR fetches the
# same set for this machine's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$WHEELS"
platforms=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pip's --no-deps: each dependency the image lacks is named in bench/gpu_wheels.txt
# (the image has torch, transformers, triton, numpy, anyio, click, h11, httpx,
# msgpack, tqdm, pyyaml, requests, annotated-doc, prometheus-client).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp "${platforms[@]}" -d "$WHEELS" -r bench/gpu_wheels.txt
ls -l "$WHEELS"
du -sh "$WHEELS"
