# The README's commands. Every target sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
JOB ?= jobs/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: venv run test test-unit test-dist test-ray test-gpu bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, and only when none is present: an unpinned torch pulls the CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

run: venv
	$(VENV)/bin/ringtrain run $(JOB)

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-dist: venv
	$(PY) -m pytest tests/dist $(PYTEST_ARGS)

test-ray: venv
	$(PY) -m pytest tests/ray $(PYTEST_ARGS)

test-gpu: venv
	$(PY) -m pytest tests/gpu $(PYTEST_ARGS)

bench: venv
	PYTHONPATH=platform $(PY) bench/attention.py

clean:
	rm -rf $(VENV) runs .pytest_cache
