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

.PHONY: venv tools run test test-unit test-dist test-ray test-gpu gpu-check gpu-start helm-check bench clean

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

# Test files run on TEST_WORKERS processes, each file whole on one (its module fixtures, a Ray
# cluster or a spawned gloo group, are built once); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: venv tools
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-unit: venv tools
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests/unit $(PYTEST_ARGS)

test-dist: venv
	$(PY) -m pytest tests/dist $(PYTEST_ARGS)

test-ray: venv tools
	$(PY) -m pytest tests/ray $(PYTEST_ARGS)

# The GPU tier. Where nvidia-smi sees a GPU, torch must be able to use it (a CPU build or a
# driver too old fails here rather than skipping every test), and flash-attn is installed as its
# README says: after torch, without build isolation, so that it compiles against this torch
# (under isolation pip builds it against a torch of its own choosing, or finds none at all).
# RINGTRAIN_GPU_STRICT then turns a missing kernel into a failure (tests/gpu/support.py).
# Without a GPU the tests skip.
FLASH_ATTN_VERSION ?= 2.8.3.post2
FLASH_ATTN_MAX_JOBS ?= 4

test-gpu: venv
	@strict=0; \
	if nvidia-smi >/dev/null 2>&1; then \
		$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
			echo "test-gpu: nvidia-smi sees a GPU, but torch $$($(PY) -c 'import torch; print(torch.__version__, "built for CUDA", torch.version.cuda)') cannot use it: install torch $(TORCH_VERSION)'s CUDA build for this driver into $(VENV)" >&2; \
			exit 1; }; \
		$(PY) -c "import importlib.metadata as m, flash_attn.flash_attn_interface; assert m.version('flash-attn') == '$(FLASH_ATTN_VERSION)'" 2>/dev/null || { \
			echo "test-gpu: building flash-attn $(FLASH_ATTN_VERSION) against torch (this takes a while)"; \
			$(PIP) install -q packaging ninja psutil einops setuptools wheel && \
			MAX_JOBS=$(FLASH_ATTN_MAX_JOBS) $(PIP) install --no-build-isolation --no-deps --no-cache-dir --force-reinstall "flash-attn==$(FLASH_ATTN_VERSION)" && \
			$(PY) -c "import flash_attn.flash_attn_interface"; } || exit 1; \
		strict=1; \
	fi; \
	RINGTRAIN_GPU_STRICT=$$strict $(PY) -m pytest tests/gpu -m gpu $(PYTEST_ARGS)

# The first line of a GPU-only target: exit 2, naming the target, where nvidia-smi sees no GPU.
NEED_GPU = @nvidia-smi >/dev/null 2>&1 || { echo "$@: nvidia-smi sees no GPU here; run it on a machine with an NVIDIA GPU" >&2; exit 2; }

# The GPU tier in one command, on a machine with an NVIDIA GPU: the tests above, then the GPU
# benchmarks, each writing its JSON (device name, git commit) under bench/results/.
gpu-check: venv
	$(NEED_GPU)
	$(MAKE) test-gpu
	PYTHONPATH=platform $(PY) bench/attention.py
	PYTHONPATH=platform $(PY) bench/train.py --check

# The time to the first step on a GPU node, against torchrun side by side: one rank on the GPU
# (NCCL), and four CPU ranks with a core each (on the 2-core testbed they share two cores, and
# each Ray process's own start adds up there).
gpu-start: venv
	$(NEED_GPU)
	PYTHONPATH=platform $(PY) bench/startup.py --repeats 3 --ranks 1 --device cuda --out bench/results/startup-cuda-1rank.json
	PYTHONPATH=platform $(PY) bench/startup.py --repeats 3 --ranks 4 --device cpu --out bench/results/startup-gpu-node-cpu-4ranks.json

helm-check: venv tools
	$(PY) -m pytest tests/helm $(PYTEST_ARGS)

bench: venv
	PYTHONPATH=platform $(PY) bench/attention.py
	PYTHONPATH=platform $(PY) bench/checkpoint.py
	PYTHONPATH=platform $(PY) bench/planner_memory.py
	PYTHONPATH=platform $(PY) bench/probes.py
	PYTHONPATH=platform $(PY) bench/hf_load.py
	PYTHONPATH=platform $(PY) bench/recovery.py

clean:
	rm -rf $(VENV) runs .pytest_cache
