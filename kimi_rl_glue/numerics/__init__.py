"""Train/rollout numerics: ``compare(...)`` and the ``kimi-rl check-numerics`` command."""

from kimi_rl_glue.numerics.compare import NumericsReport, compare, compare_results
from kimi_rl_glue.numerics.engines import ENGINES, Engine, EngineResult, register_engine

__all__ = ["ENGINES", "Engine", "EngineResult", "NumericsReport", "compare", "compare_results", "register_engine"]
