"""Functions the engine tests run inside vLLM's worker through ``LLM.apply_model`` (pickled by name,
so they must live in an importable module, not in the ``__main__`` script)."""


def model_info(model) -> dict:
    """Runs in the worker: class names and parameter counts of the built model (towers included)."""
    params = dict(model.named_parameters())
    towers = {n: type(getattr(model, n, None)).__name__ for n in ("vision_tower", "mm_projector") if hasattr(model, n)}
    lm = getattr(model, "language_model", None)
    return {"model_class": type(model).__name__, "text_class": type(lm).__name__ if lm is not None else None,
            "towers": towers, "num_params": len(params),
            "tower_params": sorted(n for n in params if n.startswith(("vision_tower", "mm_projector"))),
            "lora_classes": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("WithLoRA")}),
            # the MoE quant method, wherever the release keeps it (0.26: on FusedMoE(...)'s RoutedExperts)
            "moe_methods": sorted({type(qm).__name__ for m in model.modules()
                                   if "MoE" in type(qm := getattr(m, "quant_method", None)).__name__}),
            "punica": sorted({type(getattr(m, "punica_wrapper", None)).__name__ for m in model.modules()
                              if hasattr(m, "punica_wrapper")})}
