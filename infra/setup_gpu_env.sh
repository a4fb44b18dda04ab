#!/usr/bin/env bash
# Build the GPU environment (default .venv-gpu) on a linux x86_64 machine with NVIDIA GPUs and Python 3.11 or
# 3.12: CUDA torch, vLLM, DeepSpeed and the rest of the project, at the pins of requirements-gpu.txt, which
# `make gpu-pins` (part of `make check`) proves mutually consistent for CPython 3.12.
#
#   infra/setup_gpu_env.sh                  (or VENV=/path PY=python3.12 infra/setup_gpu_env.sh)
#
# DeepSpeed builds its CUDA ops on first use (DS_BUILD_OPS=0); set DS_BUILD_OPS=1 to build them now.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv-gpu}"
PY="${PY:-$(command -v python3.12 || command -v python3.11 || true)}"
if [[ -z "$PY" ]]; then
  echo "setup_gpu_env: no python3.12 or python3.11 on PATH; install one or set PY=/path/to/python." >&2
  exit 2
fi
if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "setup_gpu_env: requirements-gpu.txt pins wheels for linux x86_64; this machine is $(uname -m)." >&2
  exit 2
fi
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first, at the set's pin, so DeepSpeed's source build finds it.
"$VENV/bin/pip" install -q -c requirements-gpu.txt torch
DS_BUILD_OPS="${DS_BUILD_OPS:-0}" "$VENV/bin/pip" install -q -c requirements-gpu.txt --no-build-isolation deepspeed
"$VENV/bin/pip" install -q -c requirements-gpu.txt -e '.[gpu]'
"$VENV/bin/python" -c "import torch, vllm, transformers; print('setup_gpu_env: torch', torch.__version__, \
'cuda', torch.version.cuda, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
