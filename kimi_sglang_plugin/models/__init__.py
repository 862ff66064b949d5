"""Model classes of the Kimi SGLang plugin, one module per architecture, with their configs beside them.

Also the ``SGLANG_EXTERNAL_MODEL_PACKAGE`` fallback: ``SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models``
makes SGLang's registry import each module here and read its ``EntryClass``.
"""
