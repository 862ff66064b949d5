"""Fixtures of tests/packaging: every distribution of the repository built once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import dist_tools`

import dist_tools


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """``built(dist) -> (sdist, wheel)``: ``python -m build --no-isolation`` of one distribution, cached."""
    try:
        import build  # noqa: F401
    except ImportError:  # a lane that builds must have it: fail, do not skip
        pytest.fail(
            "tests/packaging builds the distributions with `build` and `setuptools>=77`: the test extra "
            "and the Makefile's SGLang lane install them (make venv / make venv-sglang)"
        )
    work = tmp_path_factory.mktemp("dists")
    cache: dict = {}

    def get(dist: str):
        if dist not in cache:
            cache[dist] = dist_tools.build(dist, work)
        return cache[dist]

    return get
