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
