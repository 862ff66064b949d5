"""Patch ``lora_dir_prepare``: a LoRA directory handed to vLLM for one of our models is prepared by the
plugin before vLLM reads it (the row is :data:`ENTRY`).

A host that builds ``LoRARequest(name, id, path)`` itself (SkyRL's ``/skyrl/v1/load_lora_adapter``,
``vllm serve --lora-modules``, ``/v1/load_lora_adapter``) never goes through
:class:`~kimi_vllm_plugin.client.KimiLoraClient`. vLLM 0.26's ``PEFTHelper`` drops ``rank_pattern`` /
``alpha_pattern`` and scales every module by ``lora_alpha / r``, so a capacity-normalised adapter
(experts at rank ``r // top_k``) would be served with its experts ``top_k`` times too weak, with no error.
Wrapped ``WorkerLoRAManager._load_adapter`` runs, for a model built by one of our classes (the instance
carries :data:`CHECKPOINT_ATTR`, set by its ``__init__``), :func:`prepared_adapter_dir` first:

* not a local PEFT folder (an in-memory marker path, a tensorizer adapter): passed to vLLM untouched, unless
  its ``adapter_config.json`` has patterns that vLLM would ignore: then refused;
* a valid adapter that vLLM serves as PEFT means it (no patterns, per-expert 2-D expert keys): vLLM loads the
  host's own folder, after :func:`kimi_vllm_plugin.adapters.prepare_adapter` validated it;
* otherwise the prepared form (layout per-expert, per-module scaling folded into ``lora_B``) is written to a
  temporary folder, vLLM loads that, and the folder is removed once vLLM holds the tensors;
* an adapter the plugin cannot serve right raises :class:`~kimi_core.errors.AdapterRejected` naming the
  folder and the tensor. vLLM loads a new adapter before it evicts or replaces the old one, so the engine
  keeps serving what it served before.

**Folded once, never twice.** :func:`kimi_core.lora.fold_scaling.fold_pattern_scaling` (what
``prepare_adapter`` and the client run) empties ``rank_pattern`` / ``alpha_pattern`` and records the fold
under ``adapter_config["kimi_rl"]["folded_scaling"]``; a folder without patterns is never rescaled, so a
prepared folder passes unchanged. A folder that carries that record *and* patterns again is ambiguous
(re-folding would scale its experts twice) and is refused.

**Pattern-free folders with lower-rank modules** (SkyRL's export: ``r / r'`` and ``alpha / r`` already in
``lora_B``, ``lora_alpha = r``, ``rank_pattern = {}``): every vLLM release scales such a module by the global
``lora_alpha / r`` whatever its tensor rank; PEFT would not load the file. The folder was written for vLLM's
rule, so it is read by that rule (:func:`vllm_reading`) and validated as such, not refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import shutil
import tempfile

from kimi_core.errors import AdapterRejected
from kimi_core.patch_ledger import PatchEntry

__all__ = ["CHECKPOINT_ATTR", "ENTRY", "install", "mark_model", "prepared_adapter_dir", "vllm_reading"]

logger = logging.getLogger(__name__)

#: instance attribute our model classes set to their checkpoint path; its presence scopes the patch
CHECKPOINT_ATTR = "_kimi_checkpoint"

ENTRY = PatchEntry(
    name="lora_dir_prepare",
    target="vllm.lora.worker_manager.WorkerLoRAManager._load_adapter",
    host="vllm",
    versions=">=0.26,<0.35",
    why="a host that hands vLLM a PEFT folder itself (LoRARequest with a path) bypasses the client's "
    "prepare_adapter; vLLM 0.26's PEFTHelper ignores rank_pattern / alpha_pattern and scales every module by "
    "lora_alpha / r, so capacity-normalised experts (rank r // top_k) are served top_k times too weak, silently; "
    "no release reads shared-outer / 3-D Kimi expert layouts or refuses kv_b_proj LoRA",
    how="wrap WorkerLoRAManager._load_adapter (LRUCacheWorkerLoRAManager inherits it): when the manager's model "
    "carries _kimi_checkpoint (set by our classes' __init__), validate the folder with prepare_adapter, load a "
    "temporary prepared copy when the layout or scaling must change, the host's folder otherwise; "
    "AdapterRejected before vLLM evicts anything. Installed from our model classes' __init__, idempotent; "
    "other models call the original unchanged. Target read in vLLM 0.26.0, 0.30.0, 0.32.0, 0.33.0 and 0.34.0: the same "
    "signature, reads self._adapter_manager.model and self.lora_config.max_lora_rank, LoRARequest a msgspec "
    "Struct (0.34 also refuses LoRA on modules that share a LoRA suffix but are not LoRA layers: none of ours)",
    upstream="none yet: vLLM has no adapter-preparation hook per model class; vLLM 0.32 reads the patterns "
    "(vllm/lora/peft_helper.py get_rank_and_scaling) but not the Kimi expert layouts",
    remove_when="every supported vLLM release applies rank_pattern / alpha_pattern and every host stages "
    "adapters through kimi_vllm_plugin.adapters.prepare_adapter",
    expect="signature:(self, lora_request: vllm.lora.request.LoRARequest) -> vllm.lora.lora_model.LoRAModel",
)

_WRAPPED_FLAG = "_kimi_lora_dir_prepare"


def mark_model(model, vllm_config) -> None:
    """Record the served checkpoint on ``model``: the patch then prepares its adapters.

    The value is the checkpoint folder, or (a hub id, no local folder) the HF config dict vLLM parsed.
    """
    ckpt = str(vllm_config.model_config.model)
    setattr(model, CHECKPOINT_ATTR, ckpt if os.path.isdir(ckpt) else vllm_config.model_config.hf_config.to_dict())


def install() -> None:
    """Wrap ``WorkerLoRAManager._load_adapter`` once per process (checked against :data:`ENTRY` first).

    :raises kimi_core.errors.PatchTargetError: the target is not what the ledger recorded.
    """
    import vllm.lora.worker_manager as wm

    from kimi_core.patch_ledger import check_patch

    current = wm.WorkerLoRAManager._load_adapter
    if getattr(current, _WRAPPED_FLAG, False):
        return
    check_patch(ENTRY, target_obj=current)

    @functools.wraps(current)
    def _load_adapter(self, lora_request):
        model = getattr(getattr(self, "_adapter_manager", None), "model", None)
        ckpt = getattr(model, CHECKPOINT_ATTR, None)
        if ckpt is None:
            return current(self, lora_request)
        with _prepared_request(lora_request, ckpt, self.lora_config.max_lora_rank) as req:
            return current(self, req)

    setattr(_load_adapter, _WRAPPED_FLAG, True)
    wm.WorkerLoRAManager._load_adapter = _load_adapter


@contextlib.contextmanager
def _prepared_request(lora_request, checkpoint, max_lora_rank: int):
    """``lora_request`` itself, or a copy pointing at a prepared temporary folder (removed on exit)."""
    import msgspec

    path = _local_dir(lora_request.lora_path)
    if path is None:
        yield lora_request
        return
    tensorizer = getattr(lora_request, "tensorizer_config_dict", None)  # vLLM 0.26 only
    stage = tempfile.mkdtemp(prefix="kimi-lora-")
    try:
        prepared = prepared_adapter_dir(
            path,
            _kimi_config(checkpoint),
            max_lora_rank=max_lora_rank,
            out_dir=os.path.join(stage, "adapter"),
            tensors_readable=not tensorizer,
            name=lora_request.lora_name,
        )
        if prepared is None:
            yield lora_request
        else:
            logger.info("kimi_vllm_plugin: LoRA %r from %s served in its prepared form", lora_request.lora_name, path)
            yield msgspec.structs.replace(lora_request, lora_path=prepared, is_3d_lora_weight=False)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _local_dir(lora_path: str) -> str | None:
    """The local folder vLLM would read for ``lora_path`` (its own resolution), or None when there is none."""
    try:
        from vllm.lora.utils import get_adapter_absolute_path

        path = get_adapter_absolute_path(lora_path)
    except Exception:  # noqa: BLE001 - a name vLLM cannot resolve to a folder is not ours to prepare
        return None
    return path if os.path.isfile(os.path.join(path, "adapter_config.json")) else None


def _kimi_config(checkpoint):
    """The :class:`kimi_core.config.KimiConfig` of a :data:`CHECKPOINT_ATTR` value (folder or HF config dict)."""
    from kimi_core.config import ConfigError, KimiConfig

    try:
        if isinstance(checkpoint, dict):
            return KimiConfig.from_hf(checkpoint, where="the served model's HF config")
        return _folder_config(checkpoint)
    except (ConfigError, OSError) as e:
        raise AdapterRejected(f"cannot read the served Kimi model's config to check its LoRA adapters: {e}") from None


@functools.lru_cache(maxsize=8)
def _folder_config(checkpoint: str):
    from kimi_core.config import load_config

    return load_config(checkpoint)


def prepared_adapter_dir(
    path: str,
    config,
    *,
    max_lora_rank: int | None,
    out_dir: str,
    tensors_readable: bool = True,
    name: str | None = None,
) -> str | None:
    """Validate the PEFT folder ``path`` for model ``config``; the folder vLLM should load instead, or None.

    :param config: the served model's :class:`kimi_core.config.KimiConfig`.
    :param max_lora_rank: the engine's ``max_lora_rank``.
    :param out_dir: where the prepared form is written when one is needed (the caller removes it).
    :param tensors_readable: False when vLLM reads the tensors from elsewhere (a tensorizer adapter).
    :returns: None when vLLM serves ``path`` as it is (validated), else ``out_dir`` holding the prepared form.
    :raises AdapterRejected: naming ``path`` (and the tensor): invalid, or not servable right.
    """
    from kimi_core.lora import Adapter
    from kimi_core.lora.adapter import SAFETENSORS_NAME
    from kimi_core.lora.config import META_KEY
    from kimi_core.lora.fold_scaling import has_patterns
    from kimi_vllm_plugin.adapters import prepare_adapter

    where = f"kimi_vllm_plugin: LoRA {name!r} from {path}" if name else path
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    patterns = has_patterns(cfg)
    if patterns and (cfg.get(META_KEY) or {}).get("folded_scaling"):
        raise AdapterRejected(
            f"{where}: adapter_config.json records a scaling fold ({META_KEY}.folded_scaling) and still has "
            f"rank_pattern / alpha_pattern; folding again would scale those modules twice: expected empty patterns"
        )
    if not tensors_readable or not os.path.isfile(os.path.join(path, SAFETENSORS_NAME)):
        if patterns:
            raise AdapterRejected(
                f"{where}: rank_pattern / alpha_pattern need a per-module scaling fold, which needs the tensors in "
                f"{SAFETENSORS_NAME}; expected a safetensors PEFT folder (or one prepared by "
                f"kimi_vllm_plugin.adapters.prepare_adapter)"
            )
        return None
    try:
        original = Adapter.load(path)
    except Exception as e:  # noqa: BLE001 - any unreadable adapter is one refusal naming the folder
        raise AdapterRejected(f"{where}: {e}") from None
    readable = vllm_reading(original)
    try:
        prepared = prepare_adapter(readable, config, max_lora_rank=max_lora_rank)
    except AdapterRejected as e:
        raise AdapterRejected(f"{where} (engine max_lora_rank {max_lora_rank}): {e}") from None
    if _same_tensors(prepared, original):  # every module keeps the scaling vLLM's reading of the file gives
        return None
    prepared.save(out_dir)
    return out_dir


def _same_tensors(a, b) -> bool:
    """True when ``a`` holds exactly ``b``'s tensor objects under the same names (nothing rewritten)."""
    return a.tensors.keys() == b.tensors.keys() and all(a.tensors[k] is b.tensors[k] for k in a.tensors)


def vllm_reading(adapter):
    """``adapter`` with vLLM's reading of a pattern-free config made explicit, or ``adapter`` itself.

    Without patterns vLLM scales every module by the global ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)
    whatever its tensor rank. Each 2-D module whose ``lora_A`` rank ``r_m`` differs from ``r`` gets
    ``rank_pattern[m] = r_m`` and ``alpha_pattern[m] = a_m`` with ``a_m / r_m = lora_alpha / r``, so the PEFT
    rule gives the scaling vLLM applies. Unchanged when patterns exist or every rank equals ``r``.
    """
    from kimi_core.lora.fold_scaling import PEFT_PREFIX, has_patterns

    cfg = adapter.adapter_config
    if has_patterns(cfg):
        return adapter
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    rs = bool(cfg.get("use_rslora"))
    ranks, alphas = {}, {}
    for tname, t in adapter.tensors.items():
        if not tname.endswith(".lora_A.weight") or t.dim() != 2 or int(t.shape[0]) == r:
            continue
        module = tname[: -len(".lora_A.weight")]
        module = module[len(PEFT_PREFIX) :] if module.startswith(PEFT_PREFIX) else module
        r_m = int(t.shape[0])
        key = re.escape(module)
        ranks[key] = r_m
        alphas[key] = alpha * (math.sqrt(r_m / r) if rs else r_m / r)
    if not ranks:
        return adapter
    out = adapter.copy()
    out.adapter_config.update(rank_pattern=ranks, alpha_pattern=alphas)
    return out
