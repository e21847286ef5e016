# Two commands do all set-up on a fresh machine:
#   make quickstart   the pipeline end to end on the embedded defaults (CPU, local store, local MLflow)
#   make test         lint, type check and the test suite
# Both create .venv when it is missing: torch first (constraints.txt pins the CPU build that lies on
# these machines), then the project with that constraint so nothing pulls a CUDA build.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export DO_NOT_TRACK := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install quickstart test lint typecheck pytest clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/verl-flow run configs/quickstart.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
