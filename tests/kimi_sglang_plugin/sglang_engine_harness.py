"""What the SGLang GPU engine tests share: the tiny K3 checkpoint SGLang's Marlin MXFP4 path can load,
one engine run in a subprocess (``sglang_engine_script.py``), its prompt logprobs and its log, and the
reference logprobs they are compared with.

The pure helpers (sizes check, checkpoint writer, logprob and log parsing) are tested on the CPU in
``test_engine_gpu.py``; :func:`run_engine` needs SGLang 0.5.17 on a GPU (``tools/gpu/session.sh sglang``).

Why a subprocess per engine: ``SGLANG_PLUGINS`` is read once per process (``load_plugins`` is
idempotent), the engine spawns its scheduler with the parent's environment, and the log that says
what ran is the subprocess's stderr.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from kimi_rl_glue.demo.sglang_rollout import ENGINE_FLAGS
from kimi_sglang_plugin.generate_outputs import prompt_logprobs, routed_experts  # noqa: F401 (re-exported for the lane)

if TYPE_CHECKING:
    import torch

HERE = os.path.dirname(__file__)
#: on the engine's PYTHONPATH: every process of it dumps its stacks on SIGUSR1 (see :func:`run_engine`)
FAULTHANDLER_SITE = os.path.join(HERE, "..", "..", "tools", "gpu", "faulthandler_site")

#: token ids scored by every engine test (vocab 1024 in the tiny checkpoints): 4 prompts, 127 scored positions.
#: The first two alone (17 positions) made the 1.5x bf16 bar a coin toss: the bf16 floor itself moved by 10 %
#: between two GPU runs of the same adapter (attention LoRA 1.59e-3 / 1.75e-3); the longer two
#: also take KDA past one 64-token chunk.
PROMPTS = [
    [5, 17, 99, 3, 250, 511, 42, 7, 900, 13, 64, 128],
    [1, 2, 3, 4, 1000, 77, 31],
    [(29 * i + 7) % 1021 + 1 for i in range(40)],
    [(61 * i + 2) % 1019 + 1 for i in range(72)],
]

#: Mxfp4MoEMethod.create_weights under --moe-runner-backend marlin (0.5.17 layers/quantization/mxfp4.py:395-399,
#: 0.5.23 :464-468) pads the experts' hidden width to a multiple of 256 and the per-rank intermediate
#: width to a multiple of 128, and FusedMoE._load_w13/_load_w2 pad only the TP-sharded dim
MARLIN_HIDDEN_ALIGN = 256
MARLIN_INTERMEDIATE_ALIGN = 128

#: SGLang's attention-residual Triton kernels (0.5.17 layers/attn_residual.py:29 ``_BLOCK_H = 1024``, "H = 7168 =
#: 7 x 1024") cover ``hidden_size // 1024`` blocks of 1024 with no mask and no remainder: below 1024 the combine
#: kernel gets a grid of 0 and the mixture is the uninitialised ``torch.empty`` buffer (on sm90, where the
#: SM100-only fast path is skipped; read from the kernels under Triton's CPU interpreter after a GPU run scored
#: logprobs uncorrelated with the reference at hidden 512)
ATTN_RES_BLOCK_H = 1024

#: tiny K3 sizes that meet all three (and keep the latent width apart from hidden_size)
SGLANG_TINY_K3_SIZES = {"hidden_size": 1024, "routed_expert_hidden_size": 256, "moe_intermediate_size": 128}

#: the indexer head counts DeepGEMM's paged MQA logits accepts on SM90 (``csrc/apis/attention.hpp:317`` in the
#: sgl-kernel of SGLang 0.5.17: a K3.1 prefill with other counts asserts); the release's 32 (inferred)
DEEPGEMM_SM90_INDEX_HEADS = (32, 64)


def sglang_config_problems(text_config: dict) -> list[str]:
    """Release-true readings of a K3 / K3.1 ``text_config`` that SGLang 0.5.17 takes differently from
    ``kimi_core.reference`` when the tiny sizes make them differ (the release has them equal), and sizes its
    kernels assume (the release meets them):

    * ``hidden_size`` a multiple of :data:`ATTN_RES_BLOCK_H` (attention residuals; 7168 = 7 x 1024);
    * KDA value heads: SGLang sizes them by ``v_head_dim`` (``models/kimi_k3.py:1247``, the MLA field),
      the reference by ``linear_attn_config.head_dim`` (128 and 128 in the release);
    * the DSA KV pool asserts ``index_head_dim == 128`` (``mem_cache/memory_pool.py:4368``; the release's), and
      DeepGEMM's indexer scores ``index_n_heads`` in :data:`DEEPGEMM_SM90_INDEX_HEADS` (the release's 32);
    * the LoRA memory pool sizes every layer's ``o_proj`` A buffer as ``num_attention_heads * v_head_dim``
      (``lora/utils.py get_hidden_dim``, no per-model override in ``kimi_k3.py``), KDA layers included, whose
      ``o_proj`` reads ``linear_attn_config.num_heads`` heads (96 and 96 in the release; otherwise
      ``chunked_sgmv_shrink`` asserts ``x.shape[-1] == K`` at a KDA ``o_proj``).
    """
    out = []
    if text_config.get("attn_res_block_size") and text_config["hidden_size"] % ATTN_RES_BLOCK_H:
        out.append(
            f"hidden_size {text_config['hidden_size']} is not a multiple of {ATTN_RES_BLOCK_H} (SGLang's "
            "attention-residual kernels mix only whole blocks of 1024 and leave the rest uninitialised)"
        )
    la = text_config.get("linear_attn_config") or {}
    if la and la.get("head_dim") != text_config.get("v_head_dim"):
        out.append(
            f"linear_attn_config.head_dim {la.get('head_dim')} != v_head_dim {text_config.get('v_head_dim')} "
            "(SGLang sizes KDA's value heads by v_head_dim)"
        )
    if la and la.get("num_heads") != text_config.get("num_attention_heads"):
        out.append(
            f"linear_attn_config.num_heads {la.get('num_heads')} != num_attention_heads "
            f"{text_config.get('num_attention_heads')} (SGLang's LoRA pool sizes KDA o_proj by the MLA heads)"
        )
    if text_config.get("index_head_dim") not in (None, 128):
        out.append(f"index_head_dim {text_config['index_head_dim']} != 128 (SGLang's DSA KV pool asserts 128)")
    if text_config.get("index_n_heads") not in (None, *DEEPGEMM_SM90_INDEX_HEADS):
        out.append(
            f"index_n_heads {text_config['index_n_heads']} not in {DEEPGEMM_SM90_INDEX_HEADS} (DeepGEMM's "
            "paged MQA logits, the DSA indexer's decode/prefill scores on SM90, asserts it)"
        )
    return out


def _sglang_fit(text_config: dict) -> None:
    """Set the sizes :func:`marlin_size_problems` and :func:`sglang_config_problems` name to ones that fit."""
    text_config.update(SGLANG_TINY_K3_SIZES)
    if text_config.get("linear_attn_config"):
        text_config["linear_attn_config"] = {
            **text_config["linear_attn_config"],
            "head_dim": text_config["v_head_dim"],
            "num_heads": text_config["num_attention_heads"],
        }
    if text_config.get("index_head_dim") is not None:
        text_config["index_head_dim"] = 128
    if text_config.get("index_n_heads") is not None:
        text_config["index_n_heads"] = DEEPGEMM_SM90_INDEX_HEADS[0]


#: the engine flags of every run: the miles-k3 demo's (only kernels the staged 0.5.17 has: no FA3, no sm100; the
#: K3 recipe's MoE runner) at the lane's sizes
ENGINE_KWARGS = {
    **ENGINE_FLAGS,
    "context_length": 512,
    "max_running_requests": 8,
    "mem_fraction_static": 0.3,
    "random_seed": 0,
}

#: the only index_topk SGLang 0.5.17 serves (sgl-kernel's fused DSA top-k, ``sgl_kernel/top_k.py:72``, and the
#: prefill index transform assert it; the plugin refuses another, ``kimi_k31.INDEX_TOPK_SERVED``), DeepSeek-V3.2's
SGL_KERNEL_INDEX_TOPK = 2048


def k31_engine() -> tuple[dict, dict]:
    """(engine kwargs, environment) a K3.1 engine (``index_topk`` 2048) needs on SGLang 0.5.17, which sets them only
    for the DeepSeek architectures it knows (``server_args.py`` / ``arg_groups/overrides.py``):

    * ``attention_backend="dsa"``: the triton and flashinfer backends cannot read the DSA KV pool
      (``DSATokenToKVPool`` has no ``get_v_head_dim``); ``page_size=64``: the pool asserts it;
    * ``dsa_prefill_backend`` / ``dsa_decode_backend`` ``"flashmla_sparse"``: SGLang's Hopper bf16 default decode
      is FA3, which the staged bundle does not carry (``flashmla_ops`` it does);
    * ``SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0``: a prefill whose keys fit under the threshold runs
      dense MHA instead of the indexer + sparse MLA (``dsa_backend.py:3323``), on SM90 through FA3
      (``_forward_standard_mha``), which is not staged; the default, 2048, would send every prompt of the lane
      there. 0 keeps every prefill on the indexer path (``index_topk >= T`` then selects every key). SGLang sets
      it to ``index_topk`` for its own DSA models, where dense MHA equals the sparse result.
    """
    kwargs = {
        "attention_backend": "dsa",
        "dsa_prefill_backend": "flashmla_sparse",
        "dsa_decode_backend": "flashmla_sparse",
        "page_size": 64,
    }
    env = {"SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}
    return kwargs, env


#: bar of every engine comparison: error vs the fp32 reference at most this times the bf16 reference's
BF16_RATIO = 1.5


def marlin_size_problems(text_config: dict, moe_tp: int = 1) -> list[str]:
    """Why SGLang's Marlin MXFP4 MoE cannot serve a K3 ``text_config`` (empty: it can).

    * experts' hidden (``routed_expert_hidden_size``, else ``hidden_size``) not a multiple of 256: the
      buffers are padded on a dim the per-expert loader does not pad, so loading fails ("The size of
      tensor a (128) must match the size of tensor b (64) at non-singleton dimension 1");
    * ``moe_intermediate_size / moe_tp`` not a multiple of 128: it loads, but the Marlin LoRA core then
      runs on the padded width and the LoRA buffers (unpadded) no longer line up.
    """
    out = []
    k = text_config.get("routed_expert_hidden_size") or text_config["hidden_size"]
    if k % MARLIN_HIDDEN_ALIGN:
        out.append(
            f"routed_expert_hidden_size {k} is not a multiple of {MARLIN_HIDDEN_ALIGN} "
            "(Marlin pads the experts' hidden width; the per-expert loader cannot)"
        )
    inter = text_config["moe_intermediate_size"] // moe_tp
    if inter % MARLIN_INTERMEDIATE_ALIGN:
        out.append(
            f"moe_intermediate_size/moe_tp {inter} is not a multiple of {MARLIN_INTERMEDIATE_ALIGN} "
            "(padded for Marlin; MoE LoRA buffers are not)"
        )
    return out


def write_tiny(model: str, out_dir: str, overrides: dict | None = None) -> tuple[str, list[str]]:
    """A tiny checkpoint of ``model`` (``k3``, ``k31`` MXFP4; ``k2`` INT4) that SGLang's Marlin path loads:
    ``kimi-rl make-tiny`` when its sizes allow it, else the same generator at
    :data:`SGLANG_TINY_K3_SIZES` with the readings of :func:`sglang_config_problems` made equal (K3 family only).
    ``overrides`` are set on the text config (e.g. ``index_topk``). Returns (path, the problems of make-tiny's
    sizes, empty when its sizes were used)."""
    from kimi_core.checkpoint.tiny import make_tiny, tiny_config, tiny_state_dict
    from kimi_core.checkpoint.writer import write_checkpoint

    cfg = tiny_config(model)
    text = cfg.get("text_config", cfg)
    problems = marlin_size_problems(text) + sglang_config_problems(text) if model in ("k3", "k31") else []
    if not problems and not overrides:
        return make_tiny(model, out_dir), []
    if problems:
        _sglang_fit(text)
    text.update(overrides or {})
    write_checkpoint(
        out_dir, tiny_state_dict(cfg, "mxfp4" if model in ("k3", "k31") else "int4"), cfg, max_shard_bytes=2 * 2**20
    )
    return out_dir, problems


def write_tiny_k3(out_dir: str) -> tuple[str, list[str]]:
    """:func:`write_tiny` of ``k3``."""
    return write_tiny("k3", out_dir)


def routing_flips(engine_rows: list, reference_rows: list, moe_layers: list[int]) -> tuple[int, int]:
    """``(differing, total)`` (token, MoE layer) expert sets between two ``[prompt][token][layer][k]`` routings."""
    diff = total = 0
    for e_p, r_p in zip(engine_rows, reference_rows):
        for e_t, r_t in zip(e_p, r_p):
            for layer in moe_layers:
                total += 1
                diff += sorted(e_t[layer]) != sorted(r_t[layer])
    return diff, total


_SERVER_ARG = re.compile(r"\b(attention_backend|moe_runner_backend|dtype|quantization)=('([^']*)'|None)")
_LOADED = re.compile(r"Load weight end\..*?type=(\w+)(?:, (quant=[^,]+))?")


def parse_engine_log(log: str) -> dict:
    """What an SGLang 0.5.17 engine log says ran: the resolved ``server_args`` (the engine logs
    ``server_args=ServerArgs(...)`` at start), the model class and quantization of "Load weight end",
    and whether the Kimi plugin registered or refused (its own log lines)."""
    out: dict = {
        "attention_backend": None,
        "moe_runner_backend": None,
        "dtype": None,
        "quantization": None,
        "model_class": None,
        "quant": None,
        "plugin_registered": False,
        "plugin_refused": None,
        "situ_moe_lora": False,
        "moe_front_unmerged": False,
    }
    line = next((ln for ln in log.splitlines() if "server_args=ServerArgs(" in ln), "")
    for key, _, value in _SERVER_ARG.findall(line):
        out.setdefault(key, None)
        if out[key] is None:
            out[key] = value or None
    m = _LOADED.search(log)
    if m:
        out["model_class"], out["quant"] = m.group(1), m.group(2)
    out["plugin_registered"] = bool(re.search(r"kimi_sglang_plugin: SGLang [\d.]+, registered", log))
    refused = re.search(r"kimi_sglang_plugin: (SGLang [^\n]*(?:not a release|differs)[^\n]*)", log)
    out["plugin_refused"] = refused.group(1) if refused else None
    out["situ_moe_lora"] = "MarlinLoraRunnerCore runs SiTU" in log
    out["moe_front_unmerged"] = "K3 MoE layers keep their front unmerged" in log
    return out


def run_engine(
    tmp,
    ckpt: str,
    plugins: str,
    engine_kwargs: dict | None = None,
    timeout: int | None = None,
    adapters: dict | None = None,
    tensor_versions: list | None = None,
    tag: str = "",
    routed: bool = False,
    env: dict | None = None,
    prompts: list | None = None,
) -> dict:
    """One offline ``sgl.Engine`` on ``ckpt`` with ``SGLANG_PLUGINS=plugins`` (``"none"``: stock SGLang),
    scoring ``prompts`` (default :data:`PROMPTS`) on the base model and with each of ``adapters``
    (``{name: PEFT dir}``, loaded by ``Engine.load_lora_adapter``), then loading ``tensor_versions`` through the
    plugin's sync payload
    (see ``sglang_engine_script.py``). Returns the script's JSON plus ``log`` (its stdout and stderr);
    the log is also written to ``$KIMI_TEST_OUT/sglang_<tag>.log`` when that is set. ``timeout``
    defaults to ``$KIMI_SGLANG_ENGINE_TIMEOUT`` or 180 s (raise it on a machine whose TVM-FFI cache is
    cold: the first prefill nvcc-builds the Marlin MoE kernel, ``tools/gpu/sglang_jit_prebuild.sh``). ``routed``: the
    base scoring also returns the experts SGLang chose (``res["routed"]``, see :func:`routed_experts`; off with
    ``KIMI_SGLANG_ROUTED=0``, then the tests compare with the reference's own routing). ``env``: set for the
    engine process on top of this one's (e.g. :func:`k31_engine`'s DSA threshold)."""
    timeout = timeout or int(os.environ.get("KIMI_SGLANG_ENGINE_TIMEOUT", "180"))
    routed = routed and os.environ.get("KIMI_SGLANG_ROUTED", "1") != "0"  # 0: no replay (diagnosis)
    kwargs = {**ENGINE_KWARGS, **({"enable_return_routed_experts": True} if routed else {}), **(engine_kwargs or {})}
    plan = {
        "ckpt": ckpt,
        "prompts": prompts or PROMPTS,
        "engine_kwargs": kwargs,
        "routed_experts": routed,
        "adapters": [{"name": n, "path": p} for n, p in (adapters or {}).items()],
        "score": list(adapters or {}),
        "tensor_versions": tensor_versions or [],
    }
    pp, out = tmp / "plan.json", tmp / "result.json"
    pp.write_text(json.dumps(plan))
    env = dict(os.environ, **(env or {}), SGLANG_PLUGINS=plugins)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (FAULTHANDLER_SITE, env.get("PYTHONPATH"))))
    log_path = os.path.join(os.environ.get("KIMI_TEST_OUT") or str(tmp), f"sglang_{tag or plugins}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    # the log is written as the engine runs, so a run killed from outside (the GPU call's time limit) still
    # leaves it; an engine past its timeout first dumps every process's stacks into it (SIGUSR1)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "sglang_engine_script.py"), str(pp), str(out)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(5)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"timeout after {timeout} s (every process's stacks at the end of the log)"
    with open(log_path, errors="replace") as f:
        log = f.read()
    assert rc == 0 and out.exists(), f"engine (SGLANG_PLUGINS={plugins}, {tag}) failed ({rc}):\n{log[-8000:]}"
    res = json.loads(out.read_text())
    res["log"] = log
    print(f"[SGLANG_PLUGINS={plugins} {tag}] engine start {res['start_s']:.1f}s, generate {res['generate_s']:.1f}s")
    return res


def reference_logprobs(
    ckpt: str,
    dtype,
    device: str,
    adapter=None,
    routed: list | None = None,
    routing_out: list | None = None,
    prompts: list | None = None,
) -> list[list[float]]:
    """``kimi_core.reference`` prompt logprobs of ``prompts`` (default :data:`PROMPTS`; one row per prompt, T-1
    values), with
    ``adapter`` (a PEFT directory or :class:`~kimi_core.lora.Adapter`) if given. ``routed``: an engine's
    routing per prompt (:func:`routed_experts`), replayed (each MoE layer uses those experts, gate weights from
    its own router: rollout routing replay); ``routing_out``: a list that receives the reference's own routing
    per prompt, in the same ``[T-1][layers][k]`` form."""
    import torch

    from kimi_core.reference import load_reference_model

    model = load_reference_model(ckpt, dtype=dtype, device=device)
    out = []
    with torch.no_grad():
        for i, p in enumerate(prompts or PROMPTS):
            ids = torch.tensor([p])
            r = None if routed is None else torch.tensor(routed[i][: len(p) - 1], dtype=torch.long).unsqueeze(0)
            out.append(
                model.logprobs(ids[:, :-1], ids[:, 1:], adapter=adapter, routed_experts=r)[0].float().cpu().tolist()
            )
            if routing_out is not None:
                routing_out.append(model.last_routed_experts()[0].tolist())
    return out


def flat_logprobs(rows) -> torch.Tensor:
    """Per-prompt logprob rows as one float64 vector."""
    import torch

    return torch.tensor([v for r in rows for v in r], dtype=torch.float64)


def engine_error(
    ckpt: str, engine_lps, adapter=None, routed: list | None = None, device: str = "cuda", prompts: list | None = None
) -> dict:
    """An engine's prompt logprobs of ``prompts`` (default :data:`PROMPTS`) against ``kimi_core.reference`` in
    fp32 (with ``adapter``, replaying the engine's ``routed`` experts when given), next to the bar's unit, the
    same reference run in bf16:
    ``{"err", "floor"}`` (relative RMS), ``{"max_abs", "floor_max_abs"}`` and the fp32 rows ``"fp32"``."""
    import torch

    from kimi_core.reference.replay import rel_rms_error

    f32 = flat_logprobs(reference_logprobs(ckpt, torch.float32, device, adapter, routed, prompts=prompts))
    b16 = flat_logprobs(reference_logprobs(ckpt, torch.bfloat16, device, adapter, routed, prompts=prompts))
    got = flat_logprobs(engine_lps)
    return {
        "err": rel_rms_error(f32, got),
        "floor": rel_rms_error(f32, b16),
        "fp32": f32,
        "max_abs": (got - f32).abs().max().item(),
        "floor_max_abs": (b16 - f32).abs().max().item(),
    }
