# Two commands do all set-up on a fresh machine:
#   make quickstart   the pipeline end to end on the embedded defaults (CPU, local store, local MLflow)
#   make test         lint, type check and the test suite
# Both create .venv when it is missing: torch first with pip (constraints.txt pins the CPU build that
# lies on these machines), then the project with uv under that constraint, so nothing pulls a CUDA build.

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
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install quickstart test lint typecheck pytest clean bwrap

# bubblewrap runs untrusted code (reward scorer 'code', the python tool: verl_core/sandbox.py). As root
# (CI) Debian's package is installed when bwrap is missing; anyone else is told how, and the sandbox
# tests skip saying why.
bwrap:
	@command -v bwrap >/dev/null || if [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; \
	else \
		echo "note: bwrap (bubblewrap) is missing, so code execution (reward scorer 'code', the python tool)"; \
		echo "      will refuse to run: as root, apt-get install -y bubblewrap (or set sandbox.allow_weak_sandbox=true)"; \
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

quickstart: $(BASE)
	$(VENV)/bin/verl-flow run configs/quickstart.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) bwrap
	$(PY) -m pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
