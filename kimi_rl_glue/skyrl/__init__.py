"""SkyRL adapter: our policy losses in SkyRL's ``PolicyLossRegistry``, an entry point for
``trainer.override_entrypoint=kimi_rl_glue.skyrl.main``, and the Kimi K2.x recipe's config.

| file | role |
| --- | --- |
| ``losses.py`` | ``kimi_dapo`` / ``kimi_grpo`` with SkyRL's loss signature (plain tensors, no SkyRL import) |
| ``registry.py`` | ``register_skyrl_losses()``: idempotent registration into the real (or a given) registry |
| ``recipe.py`` | ``K2xRecipe``: fake_int4_qat, normalize_moe_lora, language_model_only, merge_lora=false as overrides |
| ``config.py`` | our config extension: ``trainer.algorithm.overlong_*``, ``trainer.policy.model.kimi.expert_weights`` |
| ``main.py`` | ``main()``: extended config, registration, Ray, the DAPO reward shaping |

SkyRL needs Python >= 3.12 and is imported only inside functions.
"""
