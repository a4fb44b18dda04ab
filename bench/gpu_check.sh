#!/usr/bin/env bash
# GPU check of the compute layer: the one script run on the lent GPU machine (`bash bench/gpu_check.sh`
# from the repo root). It prints device facts, installs carried wheels (DeepSpeed and its missing pure-Python
# deps, prepared in build/gpu_wheels/ — see bench/GPU_RESULTS.md) into a temp dir, runs the GPU tests
# (tests/gpu, marker `gpu`) and leaves a log, the JSON results and a JUnit XML under $OUT/.
#
# Env: OUT (output folder; a temp dir when unset), PYTHON (default python3), GPU_CHECK_WHEELS (default
# build/gpu_wheels; set to "" to skip installing wheels), PYTEST_TIMEOUT (seconds for the pytest run, 330).
# Extra arguments go to pytest (e.g. `-k throughput`). CPU dry run here: OUT=/tmp/gpu_dry PYTHON=.venv/bin/python GPU_CHECK_WHEELS= DAPO_GPU_TESTS_ON_CPU=1 bash bench/gpu_check.sh
set -uo pipefail

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS-build/gpu_wheels}"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1

{
echo "=== dapo gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) ($(uname -srm))"
echo "=== git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') (working tree as sent, may be uncommitted)"

echo "=== nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
else
  echo "nvidia-smi not found (CPU dry run?)"
fi
nproc; free -g 2>/dev/null | head -2

SITE=""
if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE="$(mktemp -d /tmp/dapo_site.XXXX)"
  echo "=== installing carried wheels into $SITE:"; ls -1 "$WHEELS"/*.whl
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl; then
    echo "wheels installed"
  else
    echo "WARNING: wheel install failed; the DeepSpeed test will skip"; SITE=""
  fi
else
  echo "=== no carried wheels (${WHEELS:-none}); the DeepSpeed test will skip unless deepspeed is installed"
fi
export PYTHONPATH=".${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
if "$PYTHON" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
fi
echo "=== PYTHONPATH=$PYTHONPATH"

echo "=== versions"
"$PYTHON" - <<'EOF'
import importlib, platform
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", "SMs", p.multi_processor_count, "cc", f"{p.major}.{p.minor}")
    print("nccl", torch.cuda.nccl.version())
for name in ("transformers", "tokenizers", "safetensors", "numpy", "pyarrow", "tqdm", "pytest", "pydantic", "hjson"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING", type(e).__name__, e)
try:
    import deepspeed
    print("deepspeed", deepspeed.__version__, "from", deepspeed.__file__)
except Exception as e:  # noqa: BLE001
    print("deepspeed NOT importable:", type(e).__name__, str(e)[:300])
EOF

echo "=== pytest tests/gpu -m gpu"
DAPO_GPU_RESULTS="$OUT/gpu_results.json" timeout "${PYTEST_TIMEOUT:-330}" \
  "$PYTHON" -m pytest tests/gpu -m gpu -q -rA -p no:cacheprovider --durations=15 \
  --junitxml="$OUT/junit.xml" -o junit_logging=system-out "$@"
rc=$?
echo "=== pytest exit code: $rc"

echo "=== results JSON"
{ cat "$OUT/gpu_results.json" && echo; } 2>/dev/null || echo "(none written)"
echo "=== done $(date -u +%Y-%m-%dT%H:%M:%SZ)"
exit $rc
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
