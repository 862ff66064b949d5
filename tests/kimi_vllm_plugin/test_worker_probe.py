"""``worker_probe.moe_method_names`` reads vLLM's LoRA-wrapped MoE method by attribute names: fail here
(on the installed vLLM) when upstream renames them, instead of in the GPU lane's path check."""

import inspect


def test_modular_method_attributes_exist_in_vllm():
    from vllm.model_executor.layers.fused_moe.fused_moe_modular_method import FusedMoEModularMethod
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

    init = inspect.getsource(FusedMoEModularMethod.__init__)
    assert "self.old_quant_method = old_quant_method" in init and "self.moe_kernel = moe_kernel" in init
    assert isinstance(inspect.getattr_static(FusedMoEKernel, "fused_experts"), property)
