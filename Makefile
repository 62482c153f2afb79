# The README's commands. Every target sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TOOLS_STAMP := $(VENV)/.tools
TORCH_VERSION ?= 2.13.0
JOB ?= jobs/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: venv tools run test test-unit test-dist test-ray test-gpu helm-check bench clean

venv: $(STAMP)

# Debian packages the tests use: promtool checks the chart's alert rules (policy-rc.d keeps the
# package from starting a Prometheus service on install: tests start their own, on free ports);
# chromium renders the run report in a browser test.
tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): $(STAMP)
	@if ! command -v promtool >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
			rm -f /usr/sbin/policy-rc.d; \
		else \
			echo "promtool missing: run 'sudo apt-get install prometheus' (the alert-rule tests need it)"; exit 1; \
		fi; \
	fi
	@if ! command -v chromium >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
		else \
			echo "chromium missing: run 'sudo apt-get install chromium' (the report's browser test needs it)"; exit 1; \
		fi; \
	fi
	touch $(TOOLS_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, and only when none is present: an unpinned torch pulls the CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

run: venv
	$(VENV)/bin/ringtrain run $(JOB)

test: venv tools
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-dist: venv
	$(PY) -m pytest tests/dist $(PYTEST_ARGS)

test-ray: venv
	$(PY) -m pytest tests/ray $(PYTEST_ARGS)

test-gpu: venv
	$(PY) -m pytest tests/gpu $(PYTEST_ARGS)

helm-check: venv tools
	$(PY) -m pytest tests/helm $(PYTEST_ARGS)

bench: venv
	PYTHONPATH=platform $(PY) bench/attention.py
	PYTHONPATH=platform $(PY) bench/checkpoint.py
	PYTHONPATH=platform $(PY) bench/planner_memory.py
	PYTHONPATH=platform $(PY) bench/recovery.py

clean:
	rm -rf $(VENV) runs .pytest_cache
