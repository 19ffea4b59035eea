#!/usr/bin/env bash
# Downloads the Python packages the GPU machine lacks (pytest-xdist: the GPU suite runs
# over several processes) (it has torch, triton, transformers,
# numpy, jinja2, tokenizers, safetensors, prometheus-client, httpx, pytest) as wheels for
# CPython 3.12 / x86-64 into .whl/ (git-ignored), to carry there and install with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl \
  pyzmq msgspec setproctitle starlette uvicorn gguf pytest-asyncio pytest-xdist execnet \
  xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
ls .whl
