"""Which megatron-core and Megatron-Bridge releases the plugin runs on, as data, and the one check of them.

One :class:`HostSupport` row per host distribution: the releases the plugin accepts (a PEP 440 specifier),
the releases the test lanes run, why the range is what it is and what to install. The model modules
(:mod:`kimi_megatron_plugin.models`) call :func:`check_mcore_version` when they are imported, so a wrong
install fails at the first import with the release found, the releases supported and what to install
(:class:`kimi_core.errors.PluginError`). The patch ledger (:mod:`kimi_megatron_plugin.patches`) records
its rows against the same ranges.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kimi_core.errors import PluginError

__all__ = [
    "HostSupport",
    "refusal_class",
    "MEGATRON_CORE",
    "MEGATRON_BRIDGE",
    "HOSTS",
    "mcore_version",
    "check_mcore_version",
    "host_release",
]


@dataclass(frozen=True)
class HostSupport:
    """The supported releases of one host distribution.

    :param distribution: the distribution name (``"megatron-core"``).
    :param releases: PEP 440 specifier of the releases the plugin accepts.
    :param tested: the releases the test lanes run, with the Python they run on.
    :param why: what pins the range.
    :param install: what to install instead.
    """

    distribution: str
    releases: str
    tested: tuple[str, ...]
    why: str
    install: str

    def accepts(self, release: Version | str) -> bool:
        return Version(str(release)) in SpecifierSet(self.releases)

    def refusal(self, found: str) -> str:
        """The one message for a missing or unsupported release: found, supported, what to install."""
        return (
            f"kimi_megatron_plugin supports {self.distribution} {self.releases} (tested: {', '.join(self.tested)}); "
            f"found {found}. {self.install}"
        )


_REFUSALS: dict[tuple[str, str], type] = {}


def refusal_class(name: str, host: HostSupport, found: str) -> type:
    """A stand-in class called ``name`` for a node where ``host`` is missing: resolving a registered
    ``"module:Class"`` string still works, and constructing the class raises one :class:`PluginError`
    (release found, releases supported, what to install). The same class object is returned for one ``name``."""
    key = (name, host.distribution)
    if key not in _REFUSALS:
        message = host.refusal(found)

        def __init__(self, *args, **kwargs):
            raise PluginError(f"{name}: {message}")

        _REFUSALS[key] = type(
            name, (), {"__init__": __init__, "__doc__": f"Refusal stand-in: {message}", "__module__": __name__}
        )
    return _REFUSALS[key]


MEGATRON_CORE = HostSupport(
    distribution="megatron-core",
    releases=">=0.16.1,<0.20",
    tested=("0.16.1 on Python 3.11", "0.19.2 on Python 3.12"),
    why="the layers subclass MLASelfAttention, MoELayer and TransformerLayer and rely on their constructor "
    "signatures; 0.16.1 is the newest wheel for Python 3.11",
    install="Install 'kimi-megatron-plugin[megatron]': megatron-core==0.16.1 (Python 3.11) or "
    "megatron-core==0.19.2 (Python 3.12).",
)

MEGATRON_BRIDGE = HostSupport(
    distribution="megatron-bridge",
    releases=">=0.6.0,<=0.6.2",
    tested=("0.6.2 on Python 3.12", "0.6.0 inside SkyRL's Megatron worker (tools/gpu/skyrl_loop.sh)"),
    why="the bridge subclasses MegatronModelBridge and routes get_model_bridge's K2 entry; the TE stand-in "
    "names the one Bridge module that imports TransformerEngine unguarded",
    install="Install 'kimi-megatron-plugin[bridge]' (megatron-bridge==0.6.2, Python 3.12); without Bridge, load "
    "native checkpoints with kimi_megatron_plugin.checkpoint.load_hf_checkpoint.",
)

HOSTS: dict[str, HostSupport] = {h.distribution: h for h in (MEGATRON_CORE, MEGATRON_BRIDGE)}


def mcore_version() -> Version:
    """The installed megatron-core release (read from ``megatron.core.package_info``, which source checkouts
    such as Megatron-LM's also carry).

    :raises PluginError: megatron-core is not importable.
    """
    try:
        from megatron.core.package_info import __version__
    except ImportError as e:
        raise PluginError(MEGATRON_CORE.refusal("no megatron-core")) from e
    return Version(__version__)


def check_mcore_version(version: Version | str | None = None) -> Version:
    """Raise :class:`PluginError` unless megatron-core (installed, or ``version``) is in
    :data:`MEGATRON_CORE`'s range; returns the checked release."""
    v = Version(str(version)) if version is not None else mcore_version()
    if not MEGATRON_CORE.accepts(v):
        raise PluginError(MEGATRON_CORE.refusal(f"megatron-core {v}"))
    return v


def host_release(distribution: str) -> str | None:
    """The installed release of ``distribution`` (a key of :data:`HOSTS`), or None when it is absent."""
    if distribution == MEGATRON_CORE.distribution:
        try:
            return str(mcore_version())
        except PluginError:
            return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
