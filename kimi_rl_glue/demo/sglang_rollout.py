"""Rollouts from a GPU SGLang engine through ``kimi_sglang_plugin`` (the ``miles-k3`` recipe), and the adapter
sync into it as tensors (CUDA IPC when the trainer's tensors are on the GPU).

One offline ``sglang.Engine`` (its scheduler runs in a child process) serving the 4-bit K3 / K3.1 checkpoint with
LoRA on (``--experts-shared-outer-loras``, the seeds' K3 layout) and ``enable_return_routed_experts``, so each
sample carries the experts SGLang routed its tokens to: the trainer replays them (R3, as miles does). Each step
samples ``n`` responses per prompt at temperature 1 with ``top_logprobs_num`` candidates (score centering needs
them). Adapter versions arrive as ``load_lora_adapter_from_tensors`` payloads (:class:`SglangTensorSync`, the
sync protocol of :mod:`kimi_core.sync`): SGLang's ``MultiprocessingSerializer`` pickles CUDA tensors as CUDA-IPC
handles, so a trainer on the same GPU hands the engine its bucket without a host copy; every version is verified
against its manifest before it is loaded, and a refused version leaves the last good one serving.

GPU only: SGLang's K3 kernels (KDA, attention residuals, Marlin MXFP4 MoE) have no CPU path.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from kimi_core.sync import AdapterManifest, AdapterSyncError
from kimi_rl_glue.demo.rollout import GPU_MEMORY_SHARE, Sample

__all__ = ["SglangRollout", "SglangTensorSync", "TensorVersion", "samples_from_outputs", "ENGINE_FLAGS"]

#: engine flags of the recipe on one GPU with SGLang 0.5.17: no FA3, no sm100 kernels (the GPU lane's
#: ``tests/kimi_sglang_plugin/sglang_engine_harness.ENGINE_KWARGS`` are these at its sizes)
ENGINE_FLAGS = dict(
    attention_backend="triton",
    mm_attention_backend="triton_attn",
    moe_runner_backend="marlin",
    sampling_backend="pytorch",
    grammar_backend="none",
    disable_cuda_graph=True,
    enable_multimodal=False,
    skip_tokenizer_init=True,
    disable_radix_cache=True,
    dtype="bfloat16",
    tp_size=1,
    log_level="info",
)


def samples_from_outputs(
    outs: list[dict], prompts: list[list[int]], n: int, topk: int, routing: tuple[int, int] | None
) -> list[Sample]:
    """``Sample`` s of ``Engine.generate`` answers for ``prompts`` each repeated ``n`` times (``outs`` in that
    order: prompt 0's ``n`` answers, then prompt 1's, ...). ``routing = (num_hidden_layers, k)`` reads each
    answer's routed experts ``[P + M - 1][layers][k]`` into ``Sample.routed``."""
    from kimi_sglang_plugin.generate_outputs import output_logprobs, routed_experts

    if len(outs) != len(prompts) * n:
        raise ValueError(f"SGLang returned {len(outs)} answers for {len(prompts)} prompts x n={n}")
    samples = []
    for i, o in enumerate(outs):
        g = i // n
        toks, lp, ids, tlp = output_logprobs(o["meta_info"], topk)
        routed = None
        if routing is not None:
            routed = routed_experts(o["meta_info"], len(prompts[g]) + len(toks) - 1, *routing)
        samples.append(Sample(list(prompts[g]), toks, lp, ids, tlp, g, routed=routed))
    return samples


@dataclass
class TensorVersion:
    """One adapter version as sent: the ``load_lora_adapter_from_tensors`` payload, its manifest and the sync
    timings."""

    name: str
    payload: object  # kimi_sglang_plugin.sync.LoraSyncPayload
    manifest: AdapterManifest
    extra: dict = field(default_factory=dict)


class SglangTensorSync:
    """The miles-k3 loop's transport (:class:`kimi_core.sync.AdapterTransport`).

    ``publish(adapter, k)`` prepares the adapter for SGLang with the preparation the installed plugins offer
    for host ``sglang`` (:func:`kimi_rl_glue.plugins.adapter_preparation`: ``kimi_sglang_plugin.adapters``),
    flattens it into one checksummed bucket where the trainer holds it (:func:`kimi_sglang_plugin.sync.build_payload`)
    and records the version's :class:`~kimi_core.sync.AdapterManifest`. ``receive(k)`` refuses any version but the
    last published, verifies the bucket SGLang will open against the manifest (block sums on the bucket's device)
    and hands the payload over; SGLang's serializer sends a GPU bucket as CUDA-IPC handles. The bucket stays alive
    until the next version is published.
    """

    def __init__(self, config, base_name: str = "policy"):
        self.config, self.base_name = config, base_name
        self._last: tuple[int, TensorVersion] | None = None  # (version, what was sent): only the latest is held

    def publish(self, adapter, version: int) -> tuple[str, dict]:
        from kimi_rl_glue.plugins import adapter_preparation
        from kimi_sglang_plugin.sync import RankLayout, build_payload

        t = time.perf_counter()
        served = adapter_preparation("sglang")(adapter, self.config)
        name = f"{self.base_name}-v{version}"
        payload = build_payload(
            name, served.tensors, served.adapter_config, self.config, RankLayout(1, 1, 0), filter_experts=False
        )
        manifest = AdapterManifest.of(version, served.adapter_config, payload.buckets[:1])
        timings = {"build_s": time.perf_counter() - t}
        self._last = (version, TensorVersion(name, payload, manifest, {"sync_timings": timings}))
        return name, {"bytes": sum(b.nbytes for b in payload.buckets)}

    def receive(self, version: int, sent: str | None = None) -> TensorVersion:
        if self._last is None or self._last[0] != version:
            held = "none" if self._last is None else self._last[0]
            raise AdapterSyncError(f"adapter version {version} was not published (the last published is {held})")
        tv = self._last[1]
        tv.manifest.expect_version(version, tv.name)
        t = time.perf_counter()
        tv.manifest.verify([b.buffer for b in tv.payload.buckets[:1]], f"SGLang payload {tv.name}")
        tv.extra["sync_timings"]["verify_s"] = time.perf_counter() - t
        return tv


@dataclass
class _Current:
    lora_name: str | None = None


class _Client:
    """What the loop reads of the adapter state: ``current.lora_name`` (``None``: the base model)."""

    def __init__(self):
        self.current = _Current()


class SglangRollout:
    """:param ckpt: the 4-bit K3 / K3.1 checkpoint; :param max_lora_rank: engine's max rank;
    :param lora_target_modules: ``--lora-target-modules`` (``kimi_sglang_plugin.mapping.lora_target_modules``);
    :param routing: return the routed experts of every sample (R3)."""

    def __init__(
        self,
        ckpt: str,
        max_lora_rank: int,
        lora_target_modules: list[str],
        topk: int = 8,
        seed: int = 0,
        max_model_len: int = 256,
        max_num_seqs: int = 64,
        routing: bool = True,
        device: str = "cuda",
    ):
        if device != "cuda":
            raise ValueError(
                f"--device {device}: the miles-k3 recipe serves with SGLang's GPU kernels "
                "(KDA, attention residuals, Marlin MXFP4 MoE), which have no CPU path; use --device cuda"
            )
        os.environ.setdefault("SGLANG_PLUGINS", "kimi")
        import sglang as sgl

        from kimi_core.config import load_config

        self.config = load_config(ckpt)
        t0 = time.time()
        self.engine = sgl.Engine(
            model_path=ckpt,
            **ENGINE_FLAGS,
            context_length=max_model_len,
            max_running_requests=max_num_seqs,
            mem_fraction_static=GPU_MEMORY_SHARE,
            random_seed=seed,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            lora_target_modules=list(lora_target_modules),
            experts_shared_outer_loras=True,
            max_loras_per_batch=2,
            enable_return_routed_experts=routing,
        )
        self.start_s = time.time() - t0
        self.label = "sglang"
        self.client = _Client()
        self.topk = topk
        self.routing = (self.config.num_hidden_layers, self.config.num_experts_per_tok) if routing else None

    def load_adapter(self, version: TensorVersion):
        """Load ``version`` into the live engine; raises ``AdapterSyncError`` when SGLang refuses it (the
        previous version keeps serving)."""
        from kimi_sglang_plugin.sync import StockSGLangBackend

        t = time.perf_counter()
        ans = StockSGLangBackend(engine=self.engine).load(version.payload, unload_first=False)
        version.extra.setdefault("sync_timings", {})["load_s"] = time.perf_counter() - t
        if not getattr(ans, "success", True):
            raise AdapterSyncError(f"SGLang refused adapter {version.name}: {getattr(ans, 'error_message', ans)}")
        previous = self.client.current.lora_name
        self.client.current = _Current(version.name)
        if previous is not None:
            try:
                self.engine.unload_lora_adapter(previous)
            except Exception:  # noqa: BLE001 - unloading the replaced version is best effort
                pass
        return self.client.current

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, step: int) -> list[Sample]:
        # a dead scheduler makes SGLang kill the engine's process tree (its SIGQUIT handler), so a failed engine
        # raises out of generate, which the loop reports with the adapter it was serving
        ids = [list(p) for p in prompts for _ in range(n)]
        kw = {"lora_path": [self.client.current.lora_name] * len(ids)} if self.client.current.lora_name else {}
        if self.routing is not None:
            kw["return_routed_experts"] = True
        # ignore_eos alone makes every answer max_tokens long; min_new_tokens needs the tokenizer's EOS, which an
        # engine started with skip_tokenizer_init has not (SGLang refuses the request)
        outs = self.engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "top_p": 1.0},
            return_logprob=True,
            top_logprobs_num=self.topk,
            **kw,
        )
        return samples_from_outputs(outs, prompts, n, self.topk, self.routing)

    def close(self) -> None:
        self.engine.shutdown()
