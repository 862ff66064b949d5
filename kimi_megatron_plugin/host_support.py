"""Which megatron-core and Megatron-Bridge releases the plugin runs on, as data, and the one check of them.

One :class:`HostSupport` row per host distribution: the releases the plugin accepts (a PEP 440 specifier),
the releases the test lanes run, why the range is what it is and what to install. The model modules
(:mod:`kimi_megatron_plugin.models`) call :func:`check_mcore_version` when they are imported, so a wrong
install fails at the first import with the release found, the releases supported and what to install
(:class:`kimi_core.errors.PluginError`). The patch ledger (:mod:`kimi_megatron_plugin.patches`) records
its rows against the same ranges (:attr:`HostSupport.ledger_releases`: the range plus the accepted forks).

A :class:`HostFork` is a source tree that reports a release outside the range (a development version) and is
accepted only where its version string *and* a probe of the tree match: miles' Megatron-LM fork reports
megatron-core 0.16.0rc0 and carries packages no megatron-core release has.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kimi_core.errors import PluginError

__all__ = [
    "HostFork",
    "HostSupport",
    "MILES_MEGATRON_FORK",
    "accepted_fork",
    "refusal_class",
    "MEGATRON_CORE",
    "MEGATRON_BRIDGE",
    "HOSTS",
    "mcore_version",
    "check_mcore_version",
    "host_release",
]


@dataclass(frozen=True)
class HostFork:
    """A host source tree accepted outside its distribution's release range.

    :param name: the repository and branch (``"radixark/Megatron-LM miles-main"``).
    :param reports: the exact release string the tree reports (``megatron.core.package_info.__version__``).
    :param markers: modules the tree has and no release of the distribution has, found with
        :func:`importlib.util.find_spec` (nothing is imported); all must be present.
    :param checked: the commit the plugin's tests ran on, and where they ran.
    :param why: what the fork is for.
    """

    name: str
    reports: str
    markers: tuple[str, ...]
    checked: str
    why: str

    def matches(self, release: Version | str) -> bool:
        """True when ``release`` is the string this fork reports and every marker module is importable here."""
        if Version(str(release)) != Version(self.reports):
            return False
        try:
            return all(importlib.util.find_spec(m) is not None for m in self.markers)
        except (ImportError, ValueError):  # a marker's parent package is absent or broken
            return False


@dataclass(frozen=True)
class HostSupport:
    """The supported releases of one host distribution.

    :param distribution: the distribution name (``"megatron-core"``).
    :param releases: PEP 440 specifier of the releases the plugin accepts.
    :param tested: the releases the test lanes run, with the Python they run on.
    :param why: what pins the range.
    :param install: what to install instead.
    :param forks: source trees accepted outside ``releases`` by their version string and a probe.
    """

    distribution: str
    releases: str
    tested: tuple[str, ...]
    why: str
    install: str
    forks: tuple[HostFork, ...] = field(default=())

    def accepts(self, release: Version | str) -> bool:
        """True for a release in ``releases``, or for the installed tree of an accepted fork."""
        v = Version(str(release))
        return v in SpecifierSet(self.releases) or any(f.matches(v) for f in self.forks)

    @property
    def ledger_releases(self) -> str:
        """One PEP 440 specifier covering ``releases`` and every fork's release (the patch ledger's
        ``versions``): the lower bound drops to the lowest fork release, which, being a pre-release, admits
        pre-releases. :meth:`accepts` is the stricter gate."""
        if not self.forks:
            return self.releases
        low = min(Version(f.reports) for f in self.forks)
        clauses = [c for c in self.releases.split(",") if not c.strip().startswith(">=")]
        return ",".join([f">={low}", *clauses])

    def refusal(self, found: str) -> str:
        """The one message for a missing or unsupported release: found, supported, what to install."""
        forks = "".join(f" or {f.name} (reports {f.reports})" for f in self.forks)
        return (
            f"kimi_megatron_plugin supports {self.distribution} {self.releases}{forks} "
            f"(tested: {', '.join(self.tested)}); found {found}. {self.install}"
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


MILES_MEGATRON_FORK = HostFork(
    name="radixark/Megatron-LM miles-main",
    reports="0.16.0rc0",
    markers=("miles_megatron_plugins", "megatron.core.extensions.sglang"),
    checked="2e64d788b67fe8155774200c87606e1e449c494b (the commit docs/miles.md pins; CPU / gloo in the py312 "
    "lane's miles tests)",
    why="miles' train.py runs on this fork, not on a megatron-core release; its megatron.core is a 0.16 "
    "development tree (no megatron.core._rank_utils.safe_get_world_size, so Megatron-Bridge 0.6 does not import)",
)

MEGATRON_CORE = HostSupport(
    distribution="megatron-core",
    releases=">=0.16.1,<0.20",
    tested=("0.16.1 on Python 3.11", "0.19.2 on Python 3.12", "the miles fork on Python 3.12"),
    why="the layers subclass MLASelfAttention, MoELayer and TransformerLayer and rely on their constructor "
    "signatures; 0.16.1 is the newest wheel for Python 3.11",
    install="Install 'kimi-megatron-plugin[megatron]': megatron-core==0.16.1 (Python 3.11) or "
    "megatron-core==0.19.2 (Python 3.12), or run miles' Megatron-LM fork (radixark/Megatron-LM miles-main, "
    "docs/miles.md) first on PYTHONPATH.",
    forks=(MILES_MEGATRON_FORK,),
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


def accepted_fork() -> HostFork | None:
    """The accepted fork the installed megatron-core is (:data:`MILES_MEGATRON_FORK`), or None for a release
    (or no megatron-core)."""
    try:
        v = mcore_version()
    except PluginError:
        return None
    return next((f for f in MEGATRON_CORE.forks if f.matches(v)), None)


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
