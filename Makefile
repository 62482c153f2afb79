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

# Debian packages the tests use, as command:package: promtool checks the chart's alert rules and
# the dashboards' PromQL, prometheus scrapes a real run, chromium renders the run report in a
# browser test, shellcheck lints infra/local-stack.sh. policy-rc.d keeps the prometheus package
# from starting a service on install: tests start their own, on free ports. Without a tool its
# checks skip, or fail where CI is set (tests/tools.py). The stamp also depends on this Makefile,
# so a tool added to the list is installed on machines that ran `make tools` before.
TOOLS := promtool:prometheus prometheus:prometheus chromium:chromium shellcheck:shellcheck

tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): $(STAMP) Makefile
	@missing=""; \
	for tool in $(TOOLS); do \
		command -v "$${tool%%:*}" >/dev/null || missing="$$missing $${tool#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "missing tools: run 'sudo apt-get install --no-install-recommends$$missing' (tests/tools.py says which checks need them)"; exit 1; \
		fi; \
		printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
		status=$$?; rm -f /usr/sbin/policy-rc.d; exit $$status; \
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

test-unit: venv tools
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-dist: venv
	$(PY) -m pytest tests/dist $(PYTEST_ARGS)

test-ray: venv tools
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
