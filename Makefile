# The two commands of the README. Both create .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: train test setup lint test-vllm-cpu

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on local disk (an unpinned torch pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## make train: the main job on the embedded CPU default (prepare -> base model -> DAPO -> evaluate)
train: $(STAMP)
	$(BIN)/dapo train --config configs/tiny_cpu.yaml $(ARGS)

## make test: the whole test suite (vllm-cpu tests run in their own environment: make test-vllm-cpu)
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) test-vllm-cpu

lint: $(STAMP)
	$(BIN)/ruff check dapo_core tasks flows tests bench

## make test-vllm-cpu: the vLLM rollout engine on the vllm-cpu build, in its own env (.venv-vllm)
test-vllm-cpu:
	bash infra/setup_vllm_cpu_env.sh
	OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest tests/vllm_cpu -m vllm_cpu $(PYTEST_ARGS)
