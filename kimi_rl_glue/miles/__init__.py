"""miles adapter: our losses, reward, filters, routing-replay helper and data, behind miles' own flags.

Nothing here imports miles at module import; functions that need miles import it inside.

| miles flag | value |
| --- | --- |
| ``--loss-type custom_loss --custom-loss-function-path`` | ``kimi_rl_glue.miles.losses.score_centering_loss`` or ``kimi_rl_glue.miles.losses.dapo_loss`` |
| ``--custom-rm-path`` | ``kimi_rl_glue.miles.reward.math_rm`` (add ``--group-rm`` freely: it also takes a list) |
| ``--dynamic-sampling-filter-path`` | ``kimi_rl_glue.miles.filters.reward_nonzero_std`` |
| ``--custom-config-path`` | YAML with the loss settings our losses read from ``args`` (see ``docs/losses.md``) |
| ``--prompt-data`` / ``--eval-prompt-data aime`` | files written by ``kimi-rl prepare-data`` (``--input-key prompt --label-key label``) |
"""
