"""The Kimi model on Megatron-Core: block spec, layers, routed experts, pipeline packing and the model provider.

======================  =======================================================================================
module                  role
======================  =======================================================================================
``spec``                per-layer ``ModuleSpec`` of this pipeline stage (``get_block_spec``, miles' ``get_spec``)
``layers``              norms, MLA core attention, ``KimiMLA``, the K3.1 indexer, ``KimiKDA``
``mlp``                 dense GLU MLP, shared experts, ``KimiRouter``, ``KimiMoELayer`` (latent MoE)
``experts``             ``KimiExperts``: ``w4a16`` (packed 4-bit buffers), ``qat`` (fake-quant masters), ``dense``
``attn_res``            K3's attention-residual layer and output norm
``parameters``          the compute device and megatron's tensor-parallel parameter attributes
``pipeline``            the attention-residual bank packed into one ``[S, B, (N+1)*H]`` tensor between stages
``provider``            ``KimiConfig`` -> ``MLATransformerConfig``; ``build_model``, ``KimiModelProvider``
======================  =======================================================================================

Importing any of them checks the megatron-core release first (:func:`kimi_megatron_plugin.host_support.
check_mcore_version`), so a wrong install fails here, naming the release found and what to install.
"""

from kimi_megatron_plugin.host_support import check_mcore_version

check_mcore_version()
