"""``kimi-rl demo`` (``make demo``): LoRA RL on a tiny Kimi model, rollouts from vLLM through ``kimi_vllm_plugin``.

:mod:`.command` (the command: setup, step-0 comparison, summary), :mod:`.loop` (the RL loop), :mod:`.recipes`
(what each ``--recipe`` trains), :mod:`.rollout` (the vLLM engine), :mod:`.trainer` / :mod:`.megatron_trainer`
(the trainers), :mod:`.task` (the verifiable task). Nothing is imported here, so ``kimi_rl_glue.demo.recipes``
loads without the engine plugins (``kimi-rl --help`` runs with the glue alone).
"""
