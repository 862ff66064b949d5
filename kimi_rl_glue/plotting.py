"""matplotlib for the PNGs ``kimi-rl demo`` and ``check-numerics`` write, optional.

The JSON outputs (``metrics.jsonl``, ``summary.json``, ``report.json``) are the results; a PNG is a view
of them. Without matplotlib the run still finishes and one warning says which file was skipped and
what to install.
"""

from __future__ import annotations

import logging

__all__ = ["pyplot"]

log = logging.getLogger(__name__)


def pyplot(path: str):
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (after a warning naming ``path``) when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning(
            "matplotlib is not installed: %s not written (pip install matplotlib, or "
            "pip install kimi-rl-glue, which depends on it); the JSON results are complete",
            path,
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
