"""Functions the engine tests run inside vLLM's worker through ``LLM.apply_model`` (pickled by name,
so they must live in an importable module, not in the ``__main__`` script)."""


def model_info(model) -> dict:
    """Runs in the worker: class names and parameter counts of the built model (towers included)."""
    params = dict(model.named_parameters())
    towers = {n: type(getattr(model, n, None)).__name__ for n in ("vision_tower", "mm_projector") if hasattr(model, n)}
    lm = getattr(model, "language_model", None)
    return {
        "model_class": type(model).__name__,
        "text_class": type(lm).__name__ if lm is not None else None,
        "towers": towers,
        "num_params": len(params),
        "tower_params": sorted(n for n in params if n.startswith(("vision_tower", "mm_projector"))),
        "lora_classes": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("WithLoRA")}),
        # the MoE quant method, wherever the release keeps it (0.26: on FusedMoE(...)'s RoutedExperts)
        "moe_methods": sorted(
            {
                n
                for m in model.modules()
                if "MoE" in type(qm := getattr(m, "quant_method", None)).__name__
                for n in moe_method_names(qm)
            }
        ),
        "punica": sorted(
            {type(getattr(m, "punica_wrapper", None)).__name__ for m in model.modules() if hasattr(m, "punica_wrapper")}
        ),
        # vLLM's LoRA manager: its multimodal path (get_mm_mapping) and the module prefixes it keeps wrappers for
        "lora_mm": getattr(getattr(model, "lora_manager", None), "supports_mm", None),
        "lora_wrappers": sorted(getattr(getattr(model, "lora_manager", None), "punica_wrapper_mapping", {})),
        # a vLLM class in the model's MRO that declares supports_lora itself (a host's patch of vLLM's class)
        "vllm_bases_with_lora": sorted(
            c.__name__ for c in type(model).__mro__ if c.__module__.startswith("vllm.") and "supports_lora" in vars(c)
        ),
    }


def moe_method_names(quant_method) -> list[str]:
    """The class names a served MoE quant method stands for. With LoRA, vLLM 0.26 swaps the quant method
    for a ``FusedMoEModularMethod`` that keeps the original as ``old_quant_method`` and runs the experts
    of ``moe_kernel.fused_experts`` (``MarlinExperts`` for WNA16 Marlin): all three are named."""
    names = [type(quant_method).__name__]
    inner = getattr(quant_method, "old_quant_method", None)
    if inner is not None:
        names.append(type(inner).__name__)
    experts = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
    if experts is not None:
        names.append(type(experts).__name__)
    return names


#: environment flag: every process of the engine reads adapter_config.json as vLLM 0.26 does
PEFT_WITHOUT_PATTERNS_ENV = "KIMI_TEST_PEFT_WITHOUT_PATTERNS"


def drop_peft_patterns() -> None:
    """vLLM 0.26's reading of ``adapter_config.json`` in this process: ``PEFTHelper`` gets no ``rank_pattern`` /
    ``alpha_pattern`` (0.26 has no such fields and filters them out), so every module is scaled by
    ``lora_alpha / r``. Lets the CPU engine (0.32) show what a 0.26 host serves."""
    from vllm.lora.peft_helper import PEFTHelper

    if getattr(PEFTHelper, "_kimi_test_without_patterns", False):
        return
    read = PEFTHelper.from_dict.__func__

    def from_dict(cls, config_dict: dict):
        return read(cls, {k: v for k, v in config_dict.items() if k not in ("rank_pattern", "alpha_pattern")})

    PEFTHelper.from_dict = classmethod(from_dict)
    PEFTHelper._kimi_test_without_patterns = True


def peft_reads_patterns(model) -> bool:
    """Runs in the worker: whether its ``PEFTHelper`` keeps a ``rank_pattern`` (False under :func:`drop_peft_patterns`)."""
    from vllm.lora.peft_helper import PEFTHelper

    h = PEFTHelper.from_dict({"r": 16, "lora_alpha": 32, "target_modules": ["x_proj"], "rank_pattern": {"x_proj": 4}})
    return bool(h.rank_pattern)
