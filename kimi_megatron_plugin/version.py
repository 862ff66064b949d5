"""Supported megatron-core range and the one loud check of it.

The CPU lane runs megatron-core 0.16.1 (the newest wheel for Python 3.11); the GPU lane runs
0.19.2 (Python >= 3.12). The plugin keeps one code path for both and refuses anything outside
``[0.16.1, 0.20)`` because it subclasses ``MLASelfAttention``, ``MoELayer`` and ``TransformerLayer``
and relies on their constructor signatures.
"""

from __future__ import annotations

from packaging.version import Version

from kimi_core.errors import KimiError

MIN_MCORE = Version("0.16.1")
MAX_MCORE_EXCLUSIVE = Version("0.20.0")


class UnsupportedMegatronError(KimiError, ImportError):
    """megatron-core is missing or outside the supported range."""


def mcore_version() -> Version:
    """The installed megatron-core version; raises :class:`UnsupportedMegatronError` if it is absent."""
    try:
        from megatron.core.package_info import __version__
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedMegatronError(
            "kimi_megatron_plugin needs megatron-core: pip install 'kimi-rl-plugins[megatron]' "
            "(megatron-core==0.16.1 on Python 3.11, 0.19.2 on Python 3.12)") from e
    return Version(__version__)


def check_mcore_version(version: Version | str | None = None) -> Version:
    """Raise unless megatron-core is in ``[0.16.1, 0.20)``; returns the checked version."""
    v = Version(str(version)) if version is not None else mcore_version()
    if not (MIN_MCORE <= v < MAX_MCORE_EXCLUSIVE):
        raise UnsupportedMegatronError(
            f"kimi_megatron_plugin supports megatron-core >= {MIN_MCORE} and < {MAX_MCORE_EXCLUSIVE} "
            f"(0.16.1 CPU lane, 0.19.x GPU lane); found {v}. Install megatron-core==0.16.1 (Python 3.11) "
            "or megatron-core==0.19.2 (Python 3.12).")
    return v
