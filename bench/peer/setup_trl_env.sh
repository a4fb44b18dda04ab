#!/usr/bin/env bash
# Build `.venv-trl`: the TRL peer's own environment for bench/bench_vs_trl.py (TRL is a benchmark peer, never a
# dependency of the project). torch is installed first and pinned (the CPU wheel; an unpinned torch pulls a
# multi-GB CUDA build); transformers is pinned to the main env's version so both sides load the same model code;
# `pip install -e . --no-deps` lets the peer import our scorer (standard library only). Idempotent via a stamp.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python3.11}"
VENV="${VENV:-$ROOT/.venv-trl}"
TRL_VERSION="${TRL_VERSION:-1.16.0}"
TRANSFORMERS_VERSION="$("$ROOT/.venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
STAMP="$VENV/.dapo-trl-installed"
want="trl==$TRL_VERSION transformers==$TRANSFORMERS_VERSION $(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "setup_trl_env: $VENV is up to date."
  exit 0
fi
echo "setup_trl_env: building $VENV (trl $TRL_VERSION, transformers $TRANSFORMERS_VERSION)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" torch==2.13.0 pyarrow
"$VENV/bin/python" -m pip install -q --no-deps -e .
echo "$want" > "$STAMP"
echo "setup_trl_env: done"
