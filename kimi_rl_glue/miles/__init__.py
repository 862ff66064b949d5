"""miles adapter: model registration, LoRA provider, losses, reward, filters, routing-replay helper and data,
behind miles' own flags.

Nothing here imports miles at module import; functions that need miles import it inside.

| miles flag | value |
| --- | --- |
| ``--custom-megatron-init-path`` | ``kimi_rl_glue.miles.init`` (function re-exported here; = ``kimi_rl_glue.miles.init.init``) |
| ``--lora-provider-path`` | ``kimi_rl_glue.miles.lora_provider`` |
| ``--loss-type custom_loss --custom-loss-function-path`` | ``kimi_rl_glue.miles.losses.score_centering_loss`` or ``kimi_rl_glue.miles.losses.dapo_loss`` |
| ``--custom-rm-path`` | ``kimi_rl_glue.miles.reward.math_rm`` (add ``--group-rm`` freely: it also takes a list) |
| ``--dynamic-sampling-filter-path`` | ``kimi_rl_glue.miles.filters.reward_nonzero_std`` |
| ``--custom-config-path`` | YAML with the loss settings our losses read from ``args`` (see ``docs/losses.md``) |
| ``--prompt-data`` / ``--eval-prompt-data aime`` | files written by ``kimi-rl prepare-data`` (``--input-key prompt --label-key label``) |
"""

# miles' load_function resolves "kimi_rl_glue.miles.init" as getattr(kimi_rl_glue.miles, "init"): the
# function, not the submodule. init.py imports nothing heavy at module level.
from kimi_rl_glue.miles.init import init

__all__ = ["init"]
