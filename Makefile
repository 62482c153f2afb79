# The README's commands. Every target sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TRACKERS_STAMP := $(VENV)/.installed-trackers
TOOLS_STAMP := $(VENV)/.tools
TORCH_VERSION ?= 2.13.0
JOB ?= jobs/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: venv venv-test trackers tools run test test-unit test-dist test-ray test-gpu gpu-check gpu-start gpu-wheels helm-check chaos-records bench clean

venv: $(STAMP)

# Debian packages the tests use, as command:package: promtool checks the chart's alert rules and
# the dashboards' PromQL, prometheus scrapes a real run, chromium renders the run report in a
# browser test, shellcheck lints infra/local-stack.sh. policy-rc.d keeps the prometheus package
# from starting a service on install: tests start their own, on free ports. Without a tool its
# checks skip, or fail where CI is set (tests/tools.py). The stamp also depends on this Makefile,
# so a tool added to the list is installed on machines that ran `make tools` before.
TOOLS := promtool:prometheus prometheus:prometheus chromium:chromium shellcheck:shellcheck

tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): $(TEST_STAMP) Makefile
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

# What running needs (make run): ringtrain and its dependencies, pip's progress shown (the first
# install downloads about a GiB). The test extras (pytest, moto, mlflow, wandb, playwright,
# triton, ...) come with the test targets only.
#
# pip compiles what it installs one file after another; the venv's modules are compiled
# afterwards on every core instead (a venv with the test extras: 26,000 modules, 72 CPU-s). They
# must be compiled: where PYTHONDONTWRITEBYTECODE is set no process writes its own. A module that
# does not compile (a package's test fixture) is passed over, as pip passes over it.
COMPILE_VENV = $(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, and only when none is present: an unpinned torch pulls the CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --no-compile --progress-bar on "torch==$(TORCH_VERSION)"
	$(PIP) install --no-compile --progress-bar on -e .
	$(COMPILE_VENV)
	touch $(STAMP)

venv-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) install --no-compile -q -e ".[test]"
	$(COMPILE_VENV)
	touch $(TEST_STAMP)

run: venv
	$(VENV)/bin/ringtrain run $(JOB)

# The experiment trackers' clients (MLflow, W&B), which `make run` leaves out (docs/monitoring.md):
# a job with telemetry.mlflow or telemetry.wandb set needs them.
trackers: $(TRACKERS_STAMP)

$(TRACKERS_STAMP): $(STAMP)
	$(PIP) install --no-compile -q -e ".[mlflow,wandb]"
	$(COMPILE_VENV)
	touch $(TRACKERS_STAMP)

# Test files run on TEST_WORKERS processes, each file whole on one (its module fixtures, a Ray
# cluster or a spawned gloo group, are built once); TEST_WORKERS=0 runs them in this process.
# Files are handed out in path order (--no-loadscope-reorder): xdist's default order, most tests
# first, leaves the Ray tier's files (few tests, the longest) to the end, where the last of them
# runs on one worker while the other has nothing left; in path order the many short files of
# tests/unit come last and even out the two workers' finish.
TEST_WORKERS ?= 2
TEST_ORDER = --dist loadfile --no-loadscope-reorder
# The checkout's own modules compiled before the tests: every process they start (a run's Ray
# workers, gloo ranks, CLI calls) imports them, and where PYTHONDONTWRITEBYTECODE is set no
# process writes the .pyc it compiled, so each would compile them again (about 0.4 s of CPU a
# process, some 15% of a tiny run's wall time on two cores).
COMPILE_CHECKOUT = $(PY) -m compileall -q -j 0 platform tests bench jobs

test: venv-test tools
	$(COMPILE_CHECKOUT)
	$(PY) -m pytest -n $(TEST_WORKERS) $(TEST_ORDER) --durations=15 $(PYTEST_ARGS)

test-unit: venv-test tools
	$(COMPILE_CHECKOUT)
	$(PY) -m pytest -n $(TEST_WORKERS) $(TEST_ORDER) tests/unit $(PYTEST_ARGS)

test-dist: venv-test
	$(COMPILE_CHECKOUT)
	$(PY) -m pytest tests/dist $(PYTEST_ARGS)

test-ray: venv-test tools
	$(COMPILE_CHECKOUT)
	$(PY) -m pytest tests/ray $(PYTEST_ARGS)

# The GPU tier. Where nvidia-smi sees a GPU, torch must be able to use it (a CPU build or a
# driver too old fails here rather than skipping every test), and RINGTRAIN_GPU_STRICT then turns
# a missing kernel or package into a failure (tests/gpu/support.py), except a package
# RINGTRAIN_GPU_LEFT_OUT names as left out on purpose: its tests are reported as not run, naming
# it. Without a GPU the tests skip. Which Python runs the tier:
# - PYTHON_ENV unset: .venv, set up as for every target, and flash-attn installed as its README
#   says: after torch, without build isolation, so that it compiles against this torch (under
#   isolation pip builds it against a torch of its own choosing, or finds none at all).
# - PYTHON_ENV=system: $(PYTHON) as it is, a GPU node's or a container's CUDA PyTorch; no .venv,
#   and no network. What that Python lacks of $(GPU_REQUIREMENTS) is installed with pip
#   --no-index --no-deps from the wheel folder WHEELS (`make gpu-wheels` on a connected machine)
#   into $(GPU_SITE), which leads PYTHONPATH. flash-attn is not built there (the SDPA kernels
#   serve) and Ray is not carried.
PYTHON_ENV ?=
WHEELS ?=
GPU_REQUIREMENTS ?= infra/gpu-tier.txt
GPU_SITE ?= .ringtrain-cache/gpu-site/$(shell $(PYTHON) -c 'import sys; print(sys.implementation.cache_tag)' 2>/dev/null)
GPU_CHECK_ARGS ?=
FLASH_ATTN_VERSION ?= 2.8.3.post2
FLASH_ATTN_MAX_JOBS ?= 4

ifneq ($(filter-out system,$(PYTHON_ENV)),)
ifneq ($(filter test-gpu gpu-check,$(MAKECMDGOALS)),)
$(error PYTHON_ENV=$(PYTHON_ENV): leave PYTHON_ENV unset for .venv, or set PYTHON_ENV=system for $(PYTHON) as it is)
endif
endif

ifeq ($(PYTHON_ENV),system)
GPU_DEPS :=
GPU_PY = $(PYTHON)
GPU_PATH = $(abspath $(GPU_SITE)):$(CURDIR)/platform
GPU_LEFT_OUT := flash-attn ray
GPU_TORCH_FIX = set PYTHON to the Python that has the CUDA build of torch for this driver
else
GPU_DEPS := venv-test
GPU_PY = $(PY)
GPU_PATH = $(CURDIR)/platform
GPU_LEFT_OUT :=
GPU_TORCH_FIX = install torch $(TORCH_VERSION)'s CUDA build for this driver into $(VENV)
endif

# PYTHON_ENV=system: torch must be there; then what $(GPU_REQUIREMENTS) lists and $(PYTHON) lacks
# (bench/gpu_check.py --missing; at any version it counts as there) comes from WHEELS, never the
# network: --no-index, and pip's config files and PIP_FIND_LINKS set aside. A Python without pip
# runs pip from its wheel in the folder.
define GPU_SYSTEM_SETUP
$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" || { \
	echo "$@: PYTHON_ENV=system runs $(PYTHON) as it is, and it has no torch: $(GPU_TORCH_FIX)" >&2; exit 2; }; \
missing=$$(PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) bench/gpu_check.py --missing $(GPU_REQUIREMENTS)) || exit 2; \
if [ -n "$$missing" ]; then \
	if [ -z "$(WHEELS)" ]; then \
		echo "$@: $(PYTHON) lacks" $$missing "(of $(GPU_REQUIREMENTS)), and no WHEELS folder was given to install them from." \
			"On a connected machine run 'make gpu-wheels DEST=<dir> PY=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')'," \
			"bring <dir> here, then run 'make $@ PYTHON_ENV=system WHEELS=<dir>'" >&2; \
		exit 2; \
	fi; \
	test -d "$(WHEELS)" || { echo "$@: WHEELS=$(WHEELS) is not a folder" >&2; exit 2; }; \
	echo "$@: installing into $(GPU_SITE) from $(WHEELS), no index:" $$missing; \
	if $(PYTHON) -m pip --version >/dev/null 2>&1; then pip="$(PYTHON) -m pip"; \
	else pip="$(PYTHON) $$(ls -d $(WHEELS)/pip-*.whl 2>/dev/null | tail -n 1)/pip"; fi; \
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $$pip install -q --disable-pip-version-check \
		--no-index --find-links "$(WHEELS)" --no-deps --target "$(GPU_SITE)" $$missing || exit 1; \
	missing=$$(PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) bench/gpu_check.py --missing $(GPU_REQUIREMENTS)); \
	test -z "$$missing" || { echo "$@: still missing after installing from $(WHEELS):" $$missing >&2; exit 1; }; \
fi;
endef

# Sets strict=1 where nvidia-smi sees a GPU, after checking that torch can use it.
define GPU_CUDA_CHECK
strict=0; \
if nvidia-smi >/dev/null 2>&1; then \
	$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
		echo "$@: nvidia-smi sees a GPU, but torch $$($(GPU_PY) -c 'import torch; print(torch.__version__, "built for CUDA", torch.version.cuda)') cannot use it: $(GPU_TORCH_FIX)" >&2; \
		exit 1; }; \
	strict=1; \
fi;
endef

define GPU_FLASH_ATTN
if [ $$strict = 1 ]; then \
	$(PY) -c "import importlib.metadata as m, flash_attn.flash_attn_interface; assert m.version('flash-attn') == '$(FLASH_ATTN_VERSION)'" 2>/dev/null || { \
		echo "$@: building flash-attn $(FLASH_ATTN_VERSION) against torch (this takes a while)"; \
		$(PIP) install -q packaging ninja psutil einops setuptools wheel && \
		MAX_JOBS=$(FLASH_ATTN_MAX_JOBS) $(PIP) install --no-build-isolation --no-deps --no-cache-dir --force-reinstall "flash-attn==$(FLASH_ATTN_VERSION)" && \
		$(PY) -c "import flash_attn.flash_attn_interface"; } || exit 1; \
fi;
endef

ifeq ($(PYTHON_ENV),system)
GPU_PREPARE = $(GPU_SYSTEM_SETUP) $(GPU_CUDA_CHECK)
else
GPU_PREPARE = $(GPU_CUDA_CHECK) $(GPU_FLASH_ATTN)
endif
GPU_ENV = RINGTRAIN_GPU_STRICT=$$strict RINGTRAIN_GPU_LEFT_OUT="$(GPU_LEFT_OUT)" PYTHONPATH=$(GPU_PATH)$${PYTHONPATH:+:$$PYTHONPATH}

test-gpu: $(GPU_DEPS)
	@$(GPU_PREPARE) \
	$(GPU_ENV) $(GPU_PY) -m pytest tests/gpu -m gpu $(PYTEST_ARGS)

# The first line of a GPU-only target: exit 2, naming the target, where nvidia-smi sees no GPU.
NEED_GPU = @nvidia-smi >/dev/null 2>&1 || { echo "$@: nvidia-smi sees no GPU here; run it on a machine with an NVIDIA GPU" >&2; exit 2; }

# The GPU tier in one command and an 8-minute box (bench/gpu_check.py): the timing-sensitive
# tests, the rest of tests/gpu, bench/attention.py and bench/attention_launches.py at short
# blocks, bench/train.py's Trainer with its snapshot variant, and bench/max_context.py under a
# memory cap, each within its budget, streamed to runs/gpu-check-<time>/ as they run, then one
# summary. The benches write their JSON (device name, git commit) under bench/results/.
# GPU_CHECK_ARGS passes flags on, e.g. GPU_CHECK_ARGS="--only tests --budget tests=300" or
# "--only train_baselines,nccl_abort" (the parts outside the box).
gpu-check: $(GPU_DEPS)
	$(NEED_GPU)
	@$(GPU_PREPARE) \
	$(GPU_ENV) $(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# The wheel folder for PYTHON_ENV=system on a node without network, made on a connected machine:
# a wheel of every line of $(GPU_REQUIREMENTS) for the node's CPython (PY, default 3.12; not this
# machine's) on x86_64 Linux with glibc 2.28 or newer (manylinux or pure Python), the lines marked
# "sdist" built into wheels, and ringtrain's own wheel. The builds run under build isolation, so
# that they need nothing of this machine's Python and bake in none of it (DeepSpeed records the
# torch it was built with; DS_BUILD_OPS=0 leaves its ops to be JIT-built on the node); ringtrain's
# from a copy of the checkout, which an in-tree build would leave a build/ folder in (and later
# wheels would carry modules deleted since). pip then checks that the folder alone holds every
# pin for that Python.
GPU_WHEELS_PY = $(if $(filter command line,$(origin PY)),$(PY),3.12)
GPU_WHEELS_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
GPU_WHEELS_TARGET = --python-version $(GPU_WHEELS_PY) --implementation cp $(addprefix --platform ,$(GPU_WHEELS_PLATFORMS)) --only-binary=:all:

gpu-wheels:
	@test -n "$(DEST)" || { echo "$@: set DEST=<folder> for the wheels (and PY=<the GPU node's Python x.y>, default 3.12)" >&2; exit 2; }
	@case "$(GPU_WHEELS_PY)" in 3.[0-9]|3.[0-9][0-9]) ;; *) echo "$@: PY=$(GPU_WHEELS_PY): give the GPU node's Python version as x.y, e.g. PY=3.12" >&2; exit 2;; esac
	@binary=$$(grep -v '#[[:space:]]*sdist' $(GPU_REQUIREMENTS) | sed 's/#.*//'); \
	source=$$(grep '#[[:space:]]*sdist' $(GPU_REQUIREMENTS) | sed 's/#.*//'); \
	mkdir -p "$(DEST)" && \
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps $(GPU_WHEELS_TARGET) -d "$(DEST)" $$binary && \
	for req in $$source; do \
		DS_BUILD_OPS=0 $(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps -w "$(DEST)" "$$req" || exit 1; \
	done && \
	src=$$(mktemp -d) && cp -R pyproject.toml README.md platform "$$src" && rm -rf "$$src"/platform/*.egg-info && \
	$(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps -w "$(DEST)" "$$src"; built=$$?; rm -rf "$$src"; \
	test $$built = 0 && \
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(PYTHON) -m pip download -q --disable-pip-version-check --no-index \
		--find-links "$(DEST)" --no-deps $(GPU_WHEELS_TARGET) -d "$(DEST)" -r $(GPU_REQUIREMENTS) ringtrain && \
	echo "$@: $$(ls "$(DEST)"/*.whl | wc -l) wheels ($$(du -sh "$(DEST)" | cut -f1)) for CPython $(GPU_WHEELS_PY) in $(DEST);" \
		"on the GPU node: make gpu-check PYTHON_ENV=system WHEELS=<that folder>"

# The time to the first step on a GPU node, against torchrun side by side: one rank on the GPU
# (NCCL), and four CPU ranks with a core each (on the 2-core testbed they share two cores, and
# each Ray process's own start adds up there).
gpu-start: venv
	$(NEED_GPU)
	PYTHONPATH=platform $(PY) bench/startup.py --repeats 3 --ranks 1 --device cuda --out bench/results/startup-cuda-1rank.json
	PYTHONPATH=platform $(PY) bench/startup.py --repeats 3 --ranks 4 --device cpu --out bench/results/startup-gpu-node-cpu-4ranks.json

helm-check: venv-test tools
	$(PY) -m pytest tests/helm $(PYTEST_ARGS)

# The Ray tier's chaos runs, kept under tests/chaos_records/ for the unit tier to replay on the
# simulated cluster (tests/chaos_replay.py): run after a change to what the Controller decides.
CHAOS_TESTS := tests/ray/test_elastic.py tests/ray/test_recovery_retry.py tests/ray/test_stragglers.py tests/ray/test_hangs_sdc.py
chaos-records: venv-test tools
	RINGTRAIN_KEEP_CHAOS_RUNS=$(CURDIR)/tests/chaos_records $(PY) -m pytest $(CHAOS_TESTS) $(PYTEST_ARGS)

# The benches that measure on CPU; the GPU's are make gpu-check's parts.
bench: venv
	PYTHONPATH=platform $(PY) bench/checkpoint.py
	PYTHONPATH=platform $(PY) bench/planner_memory.py
	PYTHONPATH=platform $(PY) bench/probes.py
	PYTHONPATH=platform $(PY) bench/hf_load.py
	PYTHONPATH=platform $(PY) bench/recovery.py

clean:
	rm -rf $(VENV) runs .pytest_cache
