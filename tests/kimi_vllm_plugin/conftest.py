"""Makes this folder's helpers (``vllm_adapters``) importable under ``--import-mode=importlib``."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
