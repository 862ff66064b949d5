"""Deepscaler-style math reward and dynamic-sampling filter (kimi_rl_glue/miles/reward.py, filters.py)."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from types import SimpleNamespace

import pytest

from kimi_rl_glue.miles.filters import reward_nonzero_std
from kimi_rl_glue.miles.reward import answers_equivalent, extract_boxed, math_reward, math_rm


@pytest.mark.parametrize(
    "text,want",
    [
        (r"a \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{a^{2}+b^{2}}", "a^{2}+b^{2}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 42$", "42"),
        (r"\boxed{3} and \boxed{unclosed", "3"),
        ("no box at all", None),
    ],
    ids=["last-wins", "escaped-braces", "nested", "fbox", "space-form", "unbalanced-last", "none"],
)
def test_extract_boxed(text, want):
    """The last balanced \\boxed{}/\\fbox{} (or '\\boxed x') is extracted; None when there is none."""
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    "a,b,eq",
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\dfrac{3}{4}", "0.75", True),
        ("x=7", "7", True),
        ("1,000", "1000", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        (r"\frac{\pi}{2}", r"\pi/2", True),
        ("(1,2)", "(1, 2)", True),
        ("2x+1", "1+2x", True),
        (r"90^\circ", "90", True),
        (r"\text{5}", "5", True),
        ("2.50", "2.5", True),
        ("3", "4", False),
        ("x+1", "x+2", False),
        ("(1,2)", "(2,1)", False),
        (r"10^{99999}", "1", False),
        ("__import__('os')", "0", False),
        ("", "0", False),
    ],
    ids=lambda v: str(v),
)
def test_equivalence(a, b, eq):
    """Equivalent spellings match, different values do not, and unsafe or huge inputs are simply unequal."""
    assert answers_equivalent(a, b) is eq


def test_reward_follows_deepscaler_rule():
    """Only the boxed answer after the end of thinking counts; no marker scores 0 unless require_think=False."""
    assert math_reward(r"<think>maybe \boxed{5}</think> so \boxed{6}", "6") == 1.0
    assert math_reward(r"<think>\boxed{6}</think> final: \boxed{5}", "6") == 0.0
    assert math_reward(r"</think>no box", "6") == 0.0
    assert math_reward(r"answer \boxed{6}", "6") == 0.0
    assert math_reward(r"answer \boxed{6}", "6", require_think=False) == 1.0
    assert math_reward(r"</think>\boxed{6}", r"\boxed{6}") == 1.0
    assert math_reward(r"</think>\boxed{6}", "") == 0.0


def test_custom_rm_single_and_group():
    """math_rm awaits one Sample (float) or a --group-rm list (list of floats)."""
    args = Namespace(kimi_rm_require_think=True)
    s1 = SimpleNamespace(response=r"</think>\boxed{12}", label="12")
    s2 = SimpleNamespace(response=r"</think>\boxed{13}", label="12")
    assert asyncio.run(math_rm(args, s1)) == 1.0
    assert asyncio.run(math_rm(args, [s1, s2])) == [1.0, 0.0]


def test_dynamic_filter_keeps_groups_with_reward_spread():
    """A group with equal rewards is dropped with a reason; a mixed group (nested lists too) is kept."""
    args = Namespace()
    same = [SimpleNamespace(reward=1.0) for _ in range(4)]
    mixed = [[SimpleNamespace(reward=1.0)], [SimpleNamespace(reward=0.0)]]
    out = reward_nonzero_std(args, same)
    assert out.keep is False and out.reason == "zero_std_1.0"
    assert reward_nonzero_std(args, mixed).keep is True
