"""The configuration module a Kimi K2 checkpoint ships for ``trust_remote_code`` hosts.

Kimi K2 releases say ``"model_type": "kimi_k2"``, which transformers does not know; they load through
``config.json``'s ``auto_map`` (``AutoConfig`` -> a DeepSeek-V3 config class in a ``.py`` file beside it), and every
host passes ``trust_remote_code=True`` for them (SkyRL's ``get_tokenizer`` and ``AutoConfig`` calls, vLLM's engine
args, Megatron-Bridge's ``AutoBridge.from_hf_pretrained``). ``transformers.AutoTokenizer`` reads the model's config
first, so without the module even the tokenizer of a ``kimi-rl make-tiny`` folder fails to load.
:func:`write_remote_config` writes that module; :data:`AUTO_MAP` is the ``config.json`` entry naming it.
"""

from __future__ import annotations

import os

__all__ = ["AUTO_MAP", "MODULE_FILE", "write_remote_config"]

#: file name of the module, beside ``config.json``
MODULE_FILE = "configuration_kimi_k2.py"

#: ``config.json``'s ``auto_map`` for a K2 checkpoint
AUTO_MAP = {"AutoConfig": "configuration_kimi_k2.KimiK2Config"}

_SOURCE = '''"""Kimi K2 configuration: DeepSeek-V3's, under model_type kimi_k2 (written by kimi-rl make-tiny)."""

from transformers import DeepseekV3Config


class KimiK2Config(DeepseekV3Config):
    model_type = "kimi_k2"
'''


def write_remote_config(directory: str) -> str:
    """Write :data:`MODULE_FILE` into ``directory`` (atomically); returns its path."""
    from kimi_core.checkpoint.writer import atomic_write_text

    path = os.path.join(directory, MODULE_FILE)
    atomic_write_text(path, _SOURCE)
    return path
