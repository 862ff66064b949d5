"""Kimi K2.x / K3 / K3.1 for SGLang 0.5.17 and 0.5.23 with MoE LoRA, as a ``sglang.srt.plugins`` plugin.

Switch it on with the installed entry point ``kimi = "kimi_sglang_plugin:register"`` (select it
with ``SGLANG_PLUGINS=kimi``); SGLang calls it in every process it starts (launcher, engine,
schedulers, detokenizer). ``SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models`` is the
fallback path: importing that package applies the same patches. Nothing is imported at the top of
this package. ``docs/sglang.md`` is the user guide; the files:

* ``registration.py``: :func:`register` and the architecture -> class table ``MODEL_CLASSES``;
* ``host_support.py``: the SGLang releases checked, as data, and the refusal stand-ins for the others;
* ``patches/``: the ledger of every SGLang patch, one file per patch;
* ``models/``: the K3.1 model class and its config;
* ``mapping.py``: HF <-> SGLang parameter and LoRA module names;
* ``adapters.py``: ``prepare_adapter(adapter, config)``, the adapter as SGLang serves it;
* ``moe_lora.py``: MoE LoRA on MXFP4 + SiTU experts;
* ``generate_outputs.py``: ``Engine.generate`` answers read into lists and tensors;
* ``sync.py``: adapters sent to a running engine as tensors.
"""

__all__ = ["register"]


def register() -> None:
    """``sglang.srt.plugins`` entry point; see :func:`kimi_sglang_plugin.registration.register`."""
    from kimi_sglang_plugin.registration import register as _register

    _register()
