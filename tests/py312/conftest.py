"""The Python 3.12 lane: tests against the REAL skyrl 0.4.0 and megatron-bridge 0.6.2 (``make test-py312``).

Both need Python 3.12, so this folder runs only in ``.venv-py312``; the main lane (Python 3.11)
passes ``--ignore=tests/py312``. Run by another interpreter, every module here is skipped with the
reason printed (``-ra``), never silently (:func:`py312_lane.require`).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for p in (_ROOT, _HERE, os.path.dirname(_HERE)):  # the package, py312_lane, tests/utils.py
    if p not in sys.path:
        sys.path.insert(0, p)


def pytest_report_header(config):
    return f"py312 lane: Python {sys.version.split()[0]}"
