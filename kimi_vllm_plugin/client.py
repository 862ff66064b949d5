"""Hot reload of a LoRA adapter into a running vLLM engine, one fresh versioned name per step.

A reused adapter name can serve stale prefix-cache KV computed with the previous weights
(vllm-project/vllm#42125, RFC #48312), and ``load_inplace=True`` is sticky on the cached request
(NovaSky-AI/SkyRL#1606). So every load gets a **new** ``lora_name`` (``<base>-v<n>``) and a new
``lora_int_id``, both never reused in this client's lifetime, and the previous version is
unloaded only after the new one is in.

Before vLLM sees an adapter, :func:`kimi_vllm_plugin.adapters.prepare_adapter` validates it, rewrites
it into the form vLLM serves and stages it in its own folder. A rejected adapter raises
:class:`~kimi_core.errors.AdapterRejected`; the engine keeps serving the previous version.

Example (offline ``LLM``)::

    client = KimiLoraClient.offline(llm, "/ckpt/k2", max_lora_rank=16, stage_dir="/tmp/stage")
    req = client.load("/trainer/step_12/adapter")          # LoRARequest("policy-v1", 1, ...)
    llm.generate(prompts, params, lora_request=client.current)

Example (HTTP server started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)::

    client = KimiLoraClient.http("http://rollout:8000", "/ckpt/k2", max_lora_rank=16, stage_dir=...)
    client.load("/nfs/step_12/adapter")                     # then use model="policy-v1" in requests
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass

from kimi_core.errors import AdapterRejected
from kimi_vllm_plugin.adapters import prepare_adapter

__all__ = ["LoadedAdapter", "KimiLoraClient", "OfflineBackend", "HttpBackend"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedAdapter:
    """One loaded version: ``name`` (``<base>-v<n>``), vLLM ``int_id``, staged ``path``, source ``origin``."""

    name: str
    int_id: int
    path: str
    origin: str
    version: int


class OfflineBackend:
    """Loads into an offline ``vllm.LLM`` through ``llm.llm_engine.add_lora`` / ``remove_lora``."""

    def __init__(self, llm):
        self.llm = llm

    def request(self, a: LoadedAdapter):
        from vllm.lora.request import LoRARequest

        return LoRARequest(a.name, a.int_id, a.path)

    def load(self, a: LoadedAdapter) -> None:
        ok = self.llm.llm_engine.add_lora(self.request(a))
        if not ok:
            raise AdapterRejected(f"{a.path}: vLLM refused adapter {a.name!r} (add_lora returned False)")

    def unload(self, a: LoadedAdapter) -> None:
        self.llm.llm_engine.remove_lora(a.int_id)


class HttpBackend:
    """Loads into ``vllm serve`` through ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    (the server needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and one API server process)."""

    def __init__(self, base_url: str, timeout: float = 300.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key

    def request(self, a: LoadedAdapter) -> str:
        return a.name  # the "model" field of completion requests

    def _post(self, path: str, body: dict) -> None:
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise AdapterRejected(
                f"{self.base_url}{path} {body.get('lora_path', body['lora_name'])}: HTTP {e.code}: "
                f"{e.read().decode(errors='replace')[:500]}"
            ) from None

    def load(self, a: LoadedAdapter) -> None:
        self._post("/v1/load_lora_adapter", {"lora_name": a.name, "lora_path": a.path, "load_inplace": False})

    def unload(self, a: LoadedAdapter) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": a.name})


class KimiLoraClient:
    """Versioned hot reload: :meth:`load` stages, validates, loads ``<base>-v<n>``, then drops the previous one.

    :param backend: :class:`OfflineBackend` or :class:`HttpBackend`.
    :param model_config: :class:`kimi_core.config.KimiConfig` of the served checkpoint.
    :param max_lora_rank: the engine's ``max_lora_rank``.
    :param stage_dir: where validated per-expert copies are written (one sub-dir per version; the
        engine reads them, so it must be visible to the engine's workers).
    :param base_name: adapter name prefix; versions are ``<base_name>-v1``, ``-v2``, ...
    :param keep: how many previous versions stay loaded (0: unload right after the new one is in).
    """

    def __init__(
        self,
        backend,
        model_config,
        max_lora_rank: int,
        stage_dir: str,
        base_name: str = "policy",
        keep: int = 0,
        first_int_id: int = 1,
    ):
        self.backend = backend
        self.config = model_config
        self.max_lora_rank = max_lora_rank
        self.stage_dir = stage_dir
        self.base_name = base_name
        self.keep = keep
        self._next_version = 1
        self._next_id = first_int_id
        self.loaded: list[LoadedAdapter] = []

    @classmethod
    def offline(cls, llm, model_path: str, **kw) -> KimiLoraClient:
        return cls(OfflineBackend(llm), _config(model_path), **kw)

    @classmethod
    def http(cls, base_url: str, model_path: str, api_key: str | None = None, **kw) -> KimiLoraClient:
        return cls(HttpBackend(base_url, api_key=api_key), _config(model_path), **kw)

    @property
    def current(self):
        """What to pass to vLLM for the newest version (``LoRARequest`` offline, model name over HTTP), or None."""
        return self.backend.request(self.loaded[-1]) if self.loaded else None

    def load(self, src, version: int | None = None):
        """Validate, stage and load ``src`` under a fresh name; returns :attr:`current`.

        :param version: optional step number for the name; must exceed every version used so far.
        :raises AdapterRejected: nothing changes in the engine; the previous version keeps serving.
        """
        if version is not None and version < self._next_version:
            raise AdapterRejected(
                f"version {version} was already used (next is {self._next_version}); "
                "adapter names are never reused (vllm#42125)"
            )
        v = self._next_version if version is None else version
        name = f"{self.base_name}-v{v}"
        path = os.path.join(self.stage_dir, name)
        prepare_adapter(src, self.config, max_lora_rank=self.max_lora_rank, out_dir=path)
        a = LoadedAdapter(
            name, self._next_id, path, os.fspath(src) if isinstance(src, (str, os.PathLike)) else "<memory>", v
        )
        # names and ids are consumed even if the engine refuses: never reuse either
        self._next_version, self._next_id = v + 1, self._next_id + 1
        try:
            self.backend.load(a)
        except AdapterRejected:
            shutil.rmtree(path, ignore_errors=True)
            raise
        except Exception as e:  # vLLM raises plain ValueError/RuntimeError from the worker
            shutil.rmtree(path, ignore_errors=True)
            raise AdapterRejected(f"{a.origin}: vLLM refused adapter {name!r}: {e}") from e
        self.loaded.append(a)
        while len(self.loaded) > self.keep + 1:
            old = self.loaded.pop(0)
            try:
                self.backend.unload(old)
            except Exception as e:  # noqa: BLE001 - unloading an old version is best effort; the new one is served
                logger.warning("kimi_vllm_plugin: could not unload %s: %s", old.name, e)
            shutil.rmtree(old.path, ignore_errors=True)
        logger.info("kimi_vllm_plugin: serving adapter %s (id %d) from %s", name, a.int_id, a.origin)
        return self.current


def _config(model_path: str):
    from kimi_core.config import load_config

    return load_config(model_path)
