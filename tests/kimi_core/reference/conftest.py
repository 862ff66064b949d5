"""Fixtures of the reference tests."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `from ref_helpers import ...`
warnings.filterwarnings("ignore", message=".*[Tt]riton.*")

from ref_helpers import tiny


@pytest.fixture(scope="session")
def tiny_models():
    """Session cache ``get(model) -> (config dict, tensors, KimiReferenceModel)`` of the default tiny models."""
    from kimi_core.reference import KimiReferenceModel

    cache = {}

    def get(model: str):
        if model not in cache:
            cfg, sd = tiny(model)
            cache[model] = (cfg, sd, KimiReferenceModel.from_state_dict(cfg, sd))
        return cache[model]

    return get
