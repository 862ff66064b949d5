"""A tensor-payload adapter whose sha256 does not match is refused, not fatal.

SGLang's ``BaseTpWorker.load_lora_adapter_from_tensors`` (0.5.17 ``managers/tp_worker.py:235``, 0.5.23 ``:217``)
checks ``expected_checksums`` and, on a mismatch, raises ``RuntimeError("[LORA-CHECK] ... MISMATCH ...")``.
Nothing above it catches that: the scheduler process exits and the whole engine goes down (an adapter with one
flipped byte is enough). For an RL trainer a corrupt
or torn payload must cost one refused version, never the rollout engine.

The hook turns exactly that error into the result SGLang already returns for every other bad adapter:
``LoRAUpdateOutput(success=False, error_message=...)`` from ``LoRAManager.create_lora_update_result``. The
tokenizer manager then does not register the adapter, and the last good version keeps serving.
"""

from __future__ import annotations

import logging

from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, HookPatch

#: this patch's ledger row
ENTRY = HookPatch(
    name="checksum_refusal",
    target="sglang.srt.managers.tp_worker.BaseTpWorker.load_lora_adapter_from_tensors",
    host=HOST,
    hook="around",
    fn=f"{__name__}:refuse_checksum_mismatch",
    why="with expected_checksums, a tensor whose sha256 differs raises RuntimeError('[LORA-CHECK] ... "
    "MISMATCH') out of the worker, which nothing catches: the scheduler exits and the engine goes "
    "down on one flipped byte, instead of refusing one version",
    how="AROUND: that RuntimeError becomes LoRAManager.create_lora_update_result(success=False, message), "
    "the result of any other bad adapter; the tokenizer manager does not register it and the last "
    "good adapter keeps serving. Other errors propagate unchanged",
    upstream="not filed yet",
    remove_when="load_lora_adapter_from_tensors returns a failed LoRAUpdateOutput on a checksum mismatch",
    versions=BOTH,
)

logger = logging.getLogger(__name__)

#: the prefix of SGLang's checksum error (both releases)
LORA_CHECK = "[LORA-CHECK]"


def refuse_checksum_mismatch(original, worker, recv_req, *args, **kwargs):
    """AROUND ``BaseTpWorker.load_lora_adapter_from_tensors(self, recv_req)``: a ``[LORA-CHECK]`` mismatch
    becomes a failed ``LoRAUpdateOutput`` naming the adapter and the tensors; other errors propagate."""
    try:
        return original(worker, recv_req, *args, **kwargs)
    except RuntimeError as e:
        if LORA_CHECK not in str(e):
            raise
        name = getattr(recv_req, "lora_name", "?")
        message = (
            f"kimi_sglang_plugin: adapter {name!r} refused, its tensors do not match the sha256 the sender "
            f"computed ({e}); the engine keeps serving the adapters it had"
        )
        logger.error(message)
        return worker.model_runner.lora_manager.create_lora_update_result(success=False, error_message=message)
