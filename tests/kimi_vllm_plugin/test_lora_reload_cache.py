"""The ``lora_reload_cache`` patch: an adapter reloaded under a name or id the engine core served before resets
the prefix cache; a first load, another adapter, and other models' engines do not. The wrapper runs on a
stand-in engine core (the worker's adapter table and the cache as plain Python); the row is checked against the
installed vLLM, and the installation paths (at once, or through the import hook) in fresh processes."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest

from kimi_core.errors import PatchTargetError
from kimi_vllm_plugin.patches import lora_reload_cache as patch

#: the stand-in core's source: its ``add_lora`` has vLLM's annotations, not strings, as the row records
STAND_IN = '''
from vllm.lora.request import LoRARequest


class EngineCore:
    """vLLM's engine core as the wrapper sees it: the worker's adapter table ``{id: path}`` (an in-place load
    re-reads, a loaded id without ``load_inplace`` is only touched, as WorkerLoRAManager.add_adapter does) and a
    prefix cache that cannot be reset without preemption while ``running`` requests hold blocks."""

    def __init__(self, architectures):
        self.vllm_config = Config(architectures)
        self.loaded = {}
        self.reads = []
        self.resets = []
        self.running = 0

    def add_lora(self, lora_request: LoRARequest) -> bool:
        if lora_request.lora_path.endswith("bad"):
            raise ValueError("refused")
        if lora_request.lora_int_id not in self.loaded or lora_request.load_inplace:
            self.reads.append(lora_request.lora_int_id)
            self.loaded[lora_request.lora_int_id] = lora_request.lora_path
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loaded)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        if reset_running_requests:
            self.running = 0
        return self.running == 0


class Config:
    def __init__(self, architectures):
        self.model_config = types.SimpleNamespace(architectures=architectures)
'''


@pytest.fixture
def core_module():
    """A fresh stand-in of ``vllm.v1.engine.core`` with the patch applied."""
    mod = types.ModuleType("stand_in_engine_core")
    mod.types = types
    exec(compile(STAND_IN, "stand_in_engine_core", "exec", dont_inherit=True), mod.__dict__)
    patch.apply(mod)
    return mod


@pytest.fixture
def kimi_core_(core_module):
    return core_module.EngineCore(["DeepseekV3ForCausalLM"])


def req(name: str, lora_id: int, path: str, inplace: bool = False) -> LoRARequest:
    return LoRARequest(name, lora_id, path, load_inplace=inplace)


def test_first_load_and_another_adapter_keep_the_cache(kimi_core_):
    """Loading adapters under new names and ids never resets the cache."""
    core = kimi_core_
    assert core.add_lora(req("skyrl-lora", 1, "/sync"))
    assert core.add_lora(req("other", 2, "/other", inplace=True))  # in place, but never served before
    assert core.resets == [] and core.reads == [1, 2]


def test_in_place_reload_of_a_loaded_id_resets_once(kimi_core_, caplog):
    """SkyRL's sync: the same name, id and folder, ``load_inplace``: the files are re-read and the cache reset
    after the load, with one log line."""
    core = kimi_core_
    core.add_lora(req("skyrl-lora", 1, "/sync", inplace=True))
    with caplog.at_level(logging.INFO, logger=patch.__name__):
        assert core.add_lora(req("skyrl-lora", 1, "/sync", inplace=True))
    assert core.reads == [1, 1] and core.resets == [False]
    lines = [r.getMessage() for r in caplog.records if r.name == patch.__name__]
    assert lines == ["kimi_vllm_plugin: LoRA 'skyrl-lora' (id 1) reloaded: prefix cache reset"], lines


def test_loaded_id_without_inplace_is_only_touched(kimi_core_):
    """Re-adding a loaded id without ``load_inplace`` keeps vLLM's tensors (no re-read), so nothing is reset."""
    core = kimi_core_
    core.add_lora(req("x", 1, "/a"))
    core.add_lora(req("x", 1, "/a"))
    assert core.reads == [1] and core.resets == []


def test_name_served_before_loaded_again_resets(kimi_core_):
    """Unload, then load a new version under the old name (a new id too): vLLM's cache key is the name (and
    path), so the cache is reset; an id the worker never held, loaded in place, counts only if served before."""
    core = kimi_core_
    core.add_lora(req("x", 1, "/a"))
    core.remove_lora(1)
    core.add_lora(req("x", 7, "/a"))
    assert core.resets == [False]
    core.add_lora(req("y", 8, "/y", inplace=True))
    assert core.resets == [False]


def test_in_place_reload_of_an_id_loaded_by_a_request_resets(kimi_core_):
    """An id the workers loaded themselves (a request carrying the adapter, never ``add_lora``) is found through
    ``list_loras``."""
    core = kimi_core_
    core.loaded[3] = "/a"
    core.add_lora(req("z", 3, "/a", inplace=True))
    assert core.resets == [False]


def test_running_requests_are_preempted_when_they_hold_blocks(kimi_core_, caplog):
    """While running requests hold blocks the plain reset fails; they are preempted (vLLM's
    ``reset_running_requests=True``) and the cache reset."""
    core = kimi_core_
    core.add_lora(req("x", 1, "/a"))
    core.running = 2
    with caplog.at_level(logging.INFO, logger=patch.__name__):
        core.add_lora(req("x", 1, "/a", inplace=True))
    assert core.resets == [False, True] and core.running == 0
    assert "running requests preempted" in caplog.records[-1].getMessage()


def test_refused_load_neither_resets_nor_counts_as_served(kimi_core_):
    """A load that raises (the previous adapter keeps serving) leaves the cache alone and the name unrecorded."""
    core = kimi_core_
    core.add_lora(req("x", 1, "/a"))
    with pytest.raises(ValueError, match="refused"):
        core.add_lora(req("x", 1, "/bad", inplace=True))
    with pytest.raises(ValueError, match="refused"):
        core.add_lora(req("new", 2, "/bad"))
    core.add_lora(req("new", 2, "/new"))
    assert core.resets == []


def test_other_models_engines_are_untouched(core_module):
    """An engine serving a model that is not ours calls vLLM's add_lora unchanged: no reset."""
    core = core_module.EngineCore(["LlamaForCausalLM"])
    core.add_lora(req("x", 1, "/a"))
    core.add_lora(req("x", 1, "/a", inplace=True))
    assert core.reads == [1, 1] and core.resets == []


def test_apply_is_idempotent(core_module):
    wrapped = core_module.EngineCore.add_lora
    patch.apply(core_module)
    assert core_module.EngineCore.add_lora is wrapped


def test_ledger_row_matches_installed_engine_core():
    """The row's target is vLLM's ``EngineCore.add_lora`` with the recorded signature, and the reset the wrapper
    calls exists: a release that changes either fails here."""
    import inspect

    from vllm.v1.engine.core import EngineCore

    from kimi_core.patch_ledger import check_patch
    from kimi_vllm_plugin.host_support import vllm_version

    check_patch(patch.ENTRY, vllm_version()[0])
    params = inspect.signature(EngineCore.reset_prefix_cache).parameters
    assert list(params)[:2] == ["self", "reset_running_requests"], params
    assert callable(EngineCore.list_loras)


def test_changed_target_is_refused_and_install_only_warns(monkeypatch, caplog):
    """If ``add_lora`` changes its signature, the check names the row; ``install()`` (vLLM's plugin loader) logs a
    warning and returns; an engine core without ``reset_running_requests`` is refused too."""
    import vllm.v1.engine.core as core

    from kimi_core.patch_ledger import check_patch

    def add_lora(self, lora_request, pin: bool = False) -> bool:
        return True

    monkeypatch.setattr(core.EngineCore, "add_lora", add_lora)
    with pytest.raises(PatchTargetError, match=r"lora_reload_cache.*EngineCore\.add_lora.*signature"):
        check_patch(patch.ENTRY)
    with caplog.at_level(logging.WARNING, logger=patch.__name__):
        patch.install()
    assert core.EngineCore.add_lora is add_lora
    assert "patch lora_reload_cache not installed" in caplog.text

    mod = types.ModuleType("stand_in_engine_core")
    mod.types = types
    exec(
        compile(STAND_IN.replace("reset_running_requests", "preempt"), "stand_in", "exec", dont_inherit=True),
        mod.__dict__,
    )
    with pytest.raises(PatchTargetError, match="reset_prefix_cache"):
        patch.apply(mod)


@pytest.mark.parametrize("core_first", [False, True], ids=["hook", "at-once"])
def test_register_installs_the_patch_before_or_after_the_core_import(core_first):
    """vLLM's plugin loader before the engine core is imported (the in-process core) leaves a one-module hook and
    imports nothing; the import then patches and removes the hook. After the import (an engine-core process) the
    patch is applied at once. Either way a second register() changes nothing, and the module's source stays
    readable through its loader."""
    code = (
        "import inspect, os, sys\n"
        "os.environ['VLLM_PLUGINS'] = 'kimi'\n"
        f"if {core_first}:\n"
        "    import vllm.v1.engine.core\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "hooks = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == '_PatchOnImport']\n"
        f"assert hooks == ([] if {core_first} else ['_PatchOnImport']), hooks\n"
        f"assert ('vllm.v1.engine.core' in sys.modules) is {core_first}\n"
        "import vllm.v1.engine.core as core\n"
        "wrapped = core.EngineCore.add_lora\n"
        "assert wrapped._kimi_lora_reload_cache is True\n"
        "assert not [f for f in sys.meta_path if type(f).__name__ == '_PatchOnImport']\n"
        "from kimi_vllm_plugin import register\n"
        "register()\n"
        "assert core.EngineCore.add_lora is wrapped\n"
        "assert 'class EngineCore' in inspect.getsource(core)\n"
        "print('OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
