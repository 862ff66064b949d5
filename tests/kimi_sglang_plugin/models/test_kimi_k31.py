"""K3.1's MLA layers must hand K3's decoder layer a tensor: SGLang's DSA attention returns
``(output, topk_indices)`` unless ``next_skip_topk is None`` (``forward_absorb_core``), and its
``__init__`` sets ``next_skip_topk`` to a bool whenever ``use_dsa`` holds. The plugin's K3.1 class sets it
back to ``None`` (``_install_nope_indexers``). These tests read both releases' source (the live 0.5.23,
and the unpacked 0.5.17 wheel when ``KIMI_SGLANG_SRC_0517`` names one), so an upstream change to either
side fails here, and check that a config asking a layer to reuse another's top-k is refused."""

from __future__ import annotations

import ast
import os
from types import SimpleNamespace

import pytest

SRC_0517 = os.environ.get("KIMI_SGLANG_SRC_0517", "")
FORWARD_MLA = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py"
DEEPSEEK_V2 = "sglang/srt/models/deepseek_v2.py"


def _roots() -> list[tuple[str, str]]:
    import sglang

    out = [("live " + sglang.__version__, os.path.dirname(os.path.dirname(sglang.__file__)))]
    if SRC_0517:
        out.append(("0.5.17 wheel", SRC_0517))
    return out


def _method(path: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    raise AssertionError(f"{path}: no {cls}.{name}")


def _is_none_test(test, attr: str) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Attribute)
        and test.left.attr == attr
        and isinstance(test.ops[0], ast.Is)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


@pytest.mark.parametrize("where,root", _roots())
def test_absorb_core_returns_the_output_alone_when_next_skip_topk_is_none(where, root):
    f = _method(os.path.join(root, FORWARD_MLA), "DeepseekMLAForwardMixin", "forward_absorb_core")
    early = [n for n in ast.walk(f) if isinstance(n, ast.If) and _is_none_test(n.test, "next_skip_topk")]
    assert early, f"{where}: forward_absorb_core no longer tests next_skip_topk is None"
    body = early[0].body
    assert len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Name), (
        f"{where}: the next_skip_topk-is-None branch does not return one name: {ast.unparse(early[0])}"
    )
    tuples = [n for n in ast.walk(f) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    assert tuples, f"{where}: forward_absorb_core returns no tuple any more; the K3.1 setting may be unneeded"


@pytest.mark.parametrize("where,root", _roots())
def test_dsa_init_sets_next_skip_topk(where, root):
    """Without the plugin's setting, a DSA layer would return the pair: ``__init__`` assigns
    ``next_skip_topk`` something other than ``None`` (under ``use_dsa``)."""
    f = _method(os.path.join(root, DEEPSEEK_V2), "DeepseekV2AttentionMLA", "__init__")
    values = [
        n.value
        for n in ast.walk(f)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and t.attr == "next_skip_topk"
    ]
    assert any(not (isinstance(v, ast.Constant) and v.value is None) for v in values), (
        f"{where}: DeepseekV2AttentionMLA.__init__ no longer sets next_skip_topk to a value"
    )


def test_k31_refuses_a_layer_that_reuses_another_layers_topk(plugin):
    from kimi_sglang_plugin.models.kimi_k31 import KimiK31ForConditionalGeneration

    attn = SimpleNamespace(indexer=object(), skip_topk=True, next_skip_topk=False)
    fake = SimpleNamespace(mla_layers=lambda: [(4, attn)])
    with pytest.raises(ValueError, match="MLA layer 4 would reuse the previous layer's DSA top-k"):
        KimiK31ForConditionalGeneration._install_nope_indexers(fake)


TRANSFORM_INDEX = "sglang/kernels/ops/attention/dsa/transform_index.py"


def _prefill_asserts_topk_2048(path: str) -> bool:
    """Whether a prefill index transform of ``path`` (``transform_index_page_table_prefill*``, what the DSA
    backend's ``forward_extend`` calls, and what that delegates to) asserts ``topk_indices.shape[1] == 2048``."""
    tree = ast.parse(open(path).read())
    prefill = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("transform_index_page_table_prefill")
    ]
    assert prefill, f"{path}: no transform_index_page_table_prefill*"
    return any(
        isinstance(n, ast.Assert) and "2048" in ast.unparse(n.test) and "shape[1]" in ast.unparse(n.test)
        for f in prefill
        for n in ast.walk(f)
    )


@pytest.mark.parametrize("where,root", _roots())
def test_index_topk_served_follows_the_release_source(where, root):
    """``INDEX_TOPK_SERVED`` lists a release exactly where its prefill index transform asserts top-k 2048."""
    from kimi_sglang_plugin.models.kimi_k31 import INDEX_TOPK_SERVED

    release = "0.5.17" if where == "0.5.17 wheel" else where.split()[-1]
    asserts = _prefill_asserts_topk_2048(os.path.join(root, TRANSFORM_INDEX))
    assert asserts == (release in INDEX_TOPK_SERVED), f"{where}: prefill transform asserts 2048: {asserts}"


def test_k31_refuses_an_index_topk_the_release_cannot_serve(plugin):
    from kimi_sglang_plugin.models.kimi_k31 import check_index_topk

    with pytest.raises(ValueError, match=r"index_topk 128 cannot be served by SGLang 0\.5\.17.*0\.5\.23"):
        check_index_topk(128, release="0.5.17")
    check_index_topk(2048, release="0.5.17")
    check_index_topk(128, release="0.5.23")
