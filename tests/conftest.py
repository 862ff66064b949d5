"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `from utils import assert_close`


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """``tiny_ckpt(model, quant=None, convention='kimi', seed=0, layers=None) -> path``, cached per session."""
    from kimi_core.checkpoint.tiny import make_tiny

    cache: dict = {}

    def make(model: str, quant=None, convention="kimi", seed=0, layers=None) -> str:
        key = (model, quant, convention, seed, layers)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{model}_{quant}_{convention}_{seed}_{layers}")
            cache[key] = make_tiny(model, d, quant=quant, convention=convention, seed=seed, layers=layers)
        return cache[key]

    return make
