"""The seeds' loops on one GPU (``-m gpu``, the H200; ``bash tools/gpu/session.sh skyrl_demo`` /
``miles_demo``), each ``kimi-rl demo --device cuda --size small`` with every real part on the GPU
(:func:`demo_gpu_run.run_demo_on_gpu` asserts the engine's own log lines of its GPU path, the trainer on cuda,
the reward rise and the step-0 bound, and keeps the run's files in ``$KIMI_TEST_OUT``):

* ``skyrl-k2`` (seed 003; vLLM 0.26.0 + megatron-core 0.19.2): the GPU vLLM serves the small K2.x INT4 checkpoint
  through ``kimi_vllm_plugin`` (Marlin WNA16 MoE, fused MoE LoRA); the Megatron trainer trains on the same GPU
  from verified BF16 masters with fake-INT4 QAT experts and capacity-normalised expert LoRA, GRPO + token TIS,
  the adapter hot-loaded from disk each step.
* ``miles-k3`` (seeds 000 / 001; SGLang 0.5.17 + megatron-core 0.19.2): SGLang serves the small K3 MXFP4
  checkpoint through ``kimi_sglang_plugin`` (its log must show the plugin registered, the Marlin MoE runner
  with the plugin's SiTU LoRA core and K3's MoE front kept unmerged); the trainer computes the MXFP4 experts
  from their packed bytes (W4A16) with shared-outer expert LoRA and score centering, replaying the engine's
  routed experts (R3); each adapter version goes into the live engine as tensors.
"""

from __future__ import annotations

import pytest
import torch
from demo_gpu_run import run_demo_on_gpu

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

#: what vLLM 0.26's log says when the GPU path of a LoRA-enabled INT4 K2 engine runs
VLLM_GPU_PATH_LINES = (
    "CompressedTensorsWNA16MarlinMoEMethod",
    "Using fused MoE LoRA implementation",
    "PunicaWrapperGPU",
)
#: what SGLang's log says when the plugin's GPU path of a LoRA-enabled K3 engine runs
SGLANG_GPU_PATH_LINES = (
    "kimi_sglang_plugin: SGLang",
    "MarlinLoraRunnerCore runs SiTU",
    "K3 MoE layers keep their front unmerged",
)


def test_skyrl_recipe_on_one_gpu(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    run_demo_on_gpu("skyrl-k2", tmp_path / "skyrl", "skyrl_demo_gpu", VLLM_GPU_PATH_LINES, "qat")


def test_miles_recipe_on_one_gpu(tmp_path):
    pytest.importorskip("sglang")
    pytest.importorskip("megatron.core")
    run_demo_on_gpu("miles-k3", tmp_path / "miles", "miles_demo_gpu", SGLANG_GPU_PATH_LINES, "w4a16")
