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
# The versions are those the suite passes with here. PYVER=3.11 WHEELS=DIR fetches the
# same set for this machine's Python (bench/gpu_image_check.py's dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$WHEELS"
platforms=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pip's --no-deps: each dependency the image lacks is named here (the image has torch,
# transformers, triton, numpy, anyio, click, h11, httpx, msgpack, tqdm, pyyaml,
# requests, annotated-doc, prometheus-client; typing-extensions is brought for
# pydantic's >= 4.16, shadowing the image's, which is backward compatible).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp "${platforms[@]}" -d "$WHEELS" \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 httpx-sse==0.4.3 \
  pyzmq==27.3.0 gguf==0.19.0 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1 \
  truststore==0.10.5 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
ls -l "$WHEELS"
du -sh "$WHEELS"
