"""An adapter as SGLang serves it: per-module scaling folded, ``target_modules`` in SGLang's names.

SGLang (0.5.17 ``lora/lora.py:71``, ``lora/lora_config.py``; 0.5.23 the same) scales every LoRA
module of an adapter by one ``lora_alpha / r``: it reads neither ``rank_pattern`` / ``alpha_pattern``
nor ``use_rslora``. A capacity-normalised expert adapter (experts at rank ``r // top_k``, their
scaling through the patterns) would be served with the experts ``top_k`` times too weak and no error
(vLLM has the same limitation, see ``kimi_core.lora.fold_scaling``). And its LoRA pool accepts an
adapter only if the adapter's normalised ``target_modules`` are a subset of the engine's
(``LoRAMemoryPool.can_support``): our HF leaves ``w1`` / ``w3`` / ``w2`` are not SGLang names, so the
adapter would be refused as "incompatible" with no word on why.

:func:`prepare_adapter` returns the form every checked SGLang serves as the PEFT adapter means it:
every module at the adapter's one rank ``r`` (smaller ranks zero-padded: exact), expert factors in a layout
SGLang reads (numbered ``per_expert``, ``per_expert_3d`` and ``shared_outer`` kept; vLLM's ``stacked``
converted to ``per_expert_3d``), each
module's scaling folded into its ``lora_B`` (patterns and rsLoRA gone), and ``target_modules`` the
``--lora-target-modules`` values of the modules it holds (:func:`kimi_sglang_plugin.mapping.lora_target_modules`).
A module SGLang cannot give LoRA (KDA's fused projections, the DSA indexer's ``wk``) is refused with
its tensor name, never silently left out. Every refusal is a :class:`kimi_core.errors.AdapterRejected`
naming the adapter folder, the tensor or field, and what was expected.
"""

from __future__ import annotations

import os

from kimi_core.errors import AdapterRejected

__all__ = ["prepare_adapter", "check_served_config", "adapter_leaves", "UNSERVED_KDA_LEAVES"]

#: leaves of K3 KDA layers that SGLang fuses (``fused_qkvg_proj``, ``f``/``b``/``g`` gates) and gives no LoRA
UNSERVED_KDA_LEAVES = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj")


def _leaf(name: str) -> str:
    """Module leaf of a PEFT tensor name (``...layers.3.self_attn.o_proj.lora_A.weight`` -> ``o_proj``)."""
    return name.split(".lora_", 1)[0].rsplit(".", 1)[-1]


def adapter_leaves(tensor_names) -> dict[str, str]:
    """``{module leaf: first tensor name}`` of PEFT tensor names (``...<leaf>.lora_A.weight``)."""
    out: dict[str, str] = {}
    for n in tensor_names:
        if ".lora_" in n:
            out.setdefault(_leaf(n), n)
    return out


def _kda_layer_leaf(name: str, leaf: str, config) -> bool:
    from kimi_sglang_plugin.mapping import layer_index

    layer = layer_index(name)
    return layer is not None and leaf in UNSERVED_KDA_LEAVES and config.is_kda_layer(layer)


def _pad_to_rank(ad):
    """Zero-pad every module's factors to the config's ``r`` (``lora_A [..., r_m, in] -> [..., r, in]``,
    ``lora_B [..., out, r_m] -> [..., out, r]``): the delta is unchanged, and SGLang, which sizes each
    module's pool slot by the adapter's one ``r`` (its buffers are ``max_lora_rank`` wide anyway), gets
    factors of the rank it expects. Used after :func:`fold_pattern_scaling`, which leaves ``r`` the largest rank."""
    import torch

    r = int(ad.adapter_config["r"])
    out = ad.copy()
    for name, t in ad.tensors.items():
        if name.endswith(".lora_A.weight") and t.shape[-2] < r:
            pad = torch.zeros(*t.shape[:-2], r - t.shape[-2], t.shape[-1], dtype=t.dtype)
            out.tensors[name] = torch.cat([t, pad], dim=-2)
        elif name.endswith(".lora_B.weight") and t.shape[-1] < r:
            pad = torch.zeros(*t.shape[:-1], r - t.shape[-1], dtype=t.dtype)
            out.tensors[name] = torch.cat([t, pad], dim=-1)
    return out


def prepare_adapter(adapter, config, *, max_lora_rank: int | None = None, out_dir: str | os.PathLike | None = None):
    """The SGLang-served form of ``adapter`` for model ``config``; see the module docstring.

    :param adapter: a PEFT folder (HF / PEFT tensor names), a :class:`kimi_core.lora.Adapter`, or
        ``{"adapter_config": dict, "tensors": {name: tensor}}``.
    :param config: the model's :class:`kimi_core.config.KimiConfig`.
    :param max_lora_rank: the engine's ``--max-lora-rank``; SGLang serves every module at the adapter's one rank
        ``r``, so an ``r`` above it is refused (None: no bound).
    :param out_dir: when given, the result is also written there as a PEFT folder, atomically (a new folder
        swapped in, :meth:`kimi_core.lora.Adapter.save_replacing`), and its ``source`` names that folder.
    :returns: a new :class:`kimi_core.lora.Adapter`; the input is not modified.
    :raises kimi_core.errors.AdapterRejected: an adapter that does not load, a module SGLang gives no LoRA, a
        layout it cannot take, or a rank above ``max_lora_rank`` (folder, tensor and what was expected named).

    Example::

        from kimi_core.config import load_config
        prepare_adapter("ckpt/adapter-v3", load_config("ckpt/model"), out_dir="ckpt/adapter-v3.sglang")
    """
    from kimi_core.lora import Adapter, AdapterConfigError, AdapterError

    try:
        if isinstance(adapter, (str, os.PathLike)):
            adapter = Adapter.load(adapter)
        elif not isinstance(adapter, Adapter):
            adapter = Adapter(dict(adapter["tensors"]), adapter["adapter_config"], adapter.get("source", "<memory>"))
        served = _prepare(adapter, config)
    except (AdapterError, AdapterConfigError) as e:
        raise AdapterRejected(str(e)) from e
    r = int(served.adapter_config["r"])
    if max_lora_rank is not None and r > max_lora_rank:
        raise AdapterRejected(
            f"{adapter.source}: adapter_config r={r} is above the engine's --max-lora-rank {max_lora_rank} "
            "(SGLang serves every module at the adapter's one rank r)"
        )
    if out_dir is not None:
        served.source = served.save_replacing(out_dir)
    return served


def _prepare(adapter, config):
    from kimi_core.lora import convert_layout
    from kimi_core.lora.config import scaling_for
    from kimi_core.lora.fold_scaling import fold_pattern_scaling
    from kimi_core.lora.layouts import decompose, detect_layout
    from kimi_sglang_plugin.mapping import LORA_TARGET_NAMES, lora_target_modules

    where = getattr(adapter, "source", None) or "<adapter>"
    for n in adapter.tensors:
        if ".lora_" not in n:
            continue
        leaf = _leaf(n)
        if _kda_layer_leaf(n, leaf, config):
            raise AdapterRejected(
                f"{where}: {n}: SGLang fuses KDA's {leaf} into fused_qkvg_proj / its gates and "
                "gives it no LoRA; train KDA layers without it (exclude_modules) or serve with vLLM"
            )
        if leaf not in LORA_TARGET_NAMES and leaf not in ("gate_up_proj",):
            raise AdapterRejected(
                f"{where}: {n}: SGLang has no LoRA for module {leaf!r} (served: {sorted(LORA_TARGET_NAMES)})"
            )
    ad = adapter
    has_routed_experts = any(".experts." in n and ".shared_experts." not in n for n in ad.tensors)
    if has_routed_experts:
        layout = detect_layout(decompose(ad.tensors, config, ad.adapter_config, where))
        if layout == "stacked":  # vLLM's form; SGLang reads numbered experts and the 3-D forms as they are
            ad = convert_layout(ad, config, "per_expert_3d")
    ad = _pad_to_rank(fold_pattern_scaling(ad))
    cfg = ad.adapter_config
    if cfg.get("use_rslora"):  # SGLang scales by lora_alpha / r: the alpha that gives the rsLoRA scaling
        ad.adapter_config = {
            **cfg,
            "use_rslora": False,
            "lora_alpha": scaling_for(cfg, int(cfg["r"]), float(cfg["lora_alpha"])) * int(cfg["r"]),
        }
    leaves = [leaf for leaf in adapter_leaves(ad.tensors) if leaf != "gate_up_proj"]
    if has_routed_experts:
        leaves += ["w1", "w2"]
    ad = ad.copy()
    ad.adapter_config = {**ad.adapter_config, "target_modules": lora_target_modules(sorted(set(leaves)))}
    return ad


def check_served_config(adapter_config: dict, where: str = "adapter_config") -> None:
    """Refuse an adapter config SGLang would misread or refuse without a reason: per-module scaling it
    ignores (``rank_pattern`` / ``alpha_pattern`` / ``use_rslora``) or ``target_modules`` that are not
    ``--lora-target-modules`` names (``"all-linear"`` / ``"all"`` pass). :func:`prepare_adapter` output passes.

    :raises AdapterRejected: naming the field and the fix.
    """
    from kimi_sglang_plugin.mapping import LORA_TARGET_NAMES

    for key in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(key):
            raise AdapterRejected(
                f"{where}: {key} is set; SGLang scales every module by lora_alpha / r and would serve "
                "those modules with the wrong scaling: pass the adapter through "
                "kimi_sglang_plugin.adapters.prepare_adapter first"
            )
    if adapter_config.get("use_rslora"):
        raise AdapterRejected(
            f"{where}: use_rslora is set; SGLang ignores it (scaling lora_alpha / r): "
            "pass the adapter through kimi_sglang_plugin.adapters.prepare_adapter first"
        )
    targets = adapter_config.get("target_modules")
    if isinstance(targets, str):
        return
    # what SGLang normalises and accepts: the flag values and the HF leaves it maps (gate_proj -> gate_up_proj),
    # but not our expert leaves, which have no SGLang name of their own
    accepted = (set(LORA_TARGET_NAMES) - {"w1", "w2", "w3"}) | set(LORA_TARGET_NAMES.values())
    bad = sorted(set(targets or ()) - accepted)
    if bad:
        raise AdapterRejected(
            f"{where}: target_modules {bad} are not SGLang --lora-target-modules names; its LoRA pool "
            "would refuse the adapter as incompatible: pass it through "
            "kimi_sglang_plugin.adapters.prepare_adapter first"
        )
