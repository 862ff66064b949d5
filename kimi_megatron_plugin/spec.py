"""The documented miles entry point: ``--spec kimi_megatron_plugin.spec get_spec``.

The block spec itself lives in :mod:`kimi_megatron_plugin.models.spec`; this module keeps the spelling users
type in launch scripts stable across refactors of the package layout.
"""

from kimi_megatron_plugin.models.spec import get_block_spec, get_spec, layer_spec

__all__ = ["get_spec", "get_block_spec", "layer_spec"]
