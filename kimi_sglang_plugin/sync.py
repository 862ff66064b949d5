"""The SGLang side of the adapter sync: trainer buckets (HF/PEFT names) -> SGLang LoRA load requests, and the
receiving side that verifies them with the sync's one integrity scheme (:mod:`kimi_core.sync.checksum`).

Two request protocols; pin one per deployment:

``stock`` (sglang 0.5.17 and 0.5.23)
    ``Engine.load_lora_adapter_from_tensors`` / ``POST /load_lora_adapter_from_tensors`` with
    ``load_format="flattened_bucket"``: ``serialized_named_tensors`` holds **one payload per TP
    rank**; rank ``r`` deserializes only entry ``r`` (``TpModelWorker.deserialize_own_rank``), a
    ``MultiprocessingSerializer`` pickle of ``{"flattened_tensor": uint8 [n], "metadata":
    [FlattenedTensorMetadata]}`` whose byte ranges index the flat buffer. Attention-DP
    (``dp_size > 1``) is refused by stock 0.5.23 (0.5.17 allows it).
``miles`` (sglang-miles after sgl-project/sglang#36384)
    ``POST /register_lora_adapter`` with identity and config only (zero-initialised, upsert),
    then the factors ride ``update_weights_from_tensor`` (same per-rank flattened buckets).

Integrity: each rank's payload is one :class:`kimi_core.sync.Bucket` (64-byte aligned regions) and carries,
under ``"kimi_bucket"`` beside SGLang's own keys (which SGLang ignores), that bucket's metadata: tensor names,
offsets, tensor sums and the metadata digest. :func:`verify_received` is the receiving side: it checks the
flat buffer a rank received against that record (block sums on the buffer's device) and names the tensor
whose bytes changed; :func:`decode_payload` deserializes one rank's payload as SGLang does and verifies it.
SGLang's own ``expected_checksums`` (a SHA-256 per tensor, which its worker compares) stays available as
``build_payload(..., sha256=True)`` for an engine-side check inside stock SGLang.

Expert parallelism: with ``ep_size > 1`` TP rank ``r`` serves EP rank ``r // (tp_size // ep_size)``
and its experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``. Each rank's payload holds only those
experts' rows (:func:`kimi_core.sync.filter_experts`; names unchanged, per-expert names keep their
global ids). Stock 0.5.23's LoRA pool still slices *global* 3-D expert tensors by EP rank, so
row-filtered ``[E, ...]`` factors need ``filter_experts=False`` there (or the per-expert layout,
whose names carry the expert id); sglang-miles' per-rank chunks take filtered rows.

A serialized payload can be received once: a CPU bucket travels as a file descriptor that
``multiprocessing.resource_sharer`` hands out a single time (a second receive of the same bytes is
``KeyError`` in the sender and ``EOFError`` in SGLang's scheduler, which then dies). The backends therefore
send :meth:`LoraSyncPayload.fields_for_send`, which serializes the buckets again for every send after the
first; a CUDA bucket gets fresh IPC handles the same way.
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kimi_core.sync import Bucket, iter_buckets

__all__ = [
    "RankLayout",
    "LoraSyncPayload",
    "build_rank_buckets",
    "build_payload",
    "decode_payload",
    "verify_received",
    "sha256_hex",
    "StockSGLangBackend",
    "MilesRegisterBackend",
    "LOAD_FORMAT",
    "BUCKET_KEY",
]

LOAD_FORMAT = "flattened_bucket"
#: the key of our bucket record in a rank's payload dict (beside SGLang's "flattened_tensor" and "metadata")
BUCKET_KEY = "kimi_bucket"
_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class RankLayout:
    """The engine's TP x EP layout (one SGLang engine, ``dp_size == 1``).

    :param tp_size: tensor-parallel ranks (= payloads per request).
    :param ep_size: expert-parallel ranks; must divide ``tp_size`` (SGLang: ``moe_tp = tp / ep``).
    :param num_experts: routed experts ``E``; must be divisible by ``ep_size``.
    """

    tp_size: int
    ep_size: int = 1
    num_experts: int = 0

    def __post_init__(self):
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}")
        if self.num_experts and self.num_experts % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} does not divide num_experts {self.num_experts}")

    def ep_rank(self, tp_rank: int) -> int:
        return tp_rank // (self.tp_size // self.ep_size)

    def expert_range(self, tp_rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of the routed experts TP rank ``tp_rank`` holds."""
        n = self.num_experts // self.ep_size
        e = self.ep_rank(tp_rank)
        return e * n, (e + 1) * n


def sha256_hex(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as SGLang's ``expected_checksums`` check computes it."""
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def build_rank_buckets(
    tensors: Mapping[str, torch.Tensor], config, layout: RankLayout, filter_experts: bool = True
) -> list[Bucket]:
    """One checksummed :class:`Bucket` per TP rank (``[tp_size]``); ranks of one EP rank share it.

    :param tensors: PEFT-named adapter tensors (any file layout of ``kimi_core.lora``). The buckets live where
        the tensors do: on a GPU, SGLang's ``MultiprocessingSerializer`` then pickles them as CUDA-IPC handles
        (its colocated ``update_weights_from_tensor`` path), which the engine's worker opens on the same GPU.
    :param config: the ``KimiConfig`` (expert count, names).
    """
    device = next(iter(tensors.values())).device if tensors else None
    if filter_experts and layout.ep_size > 1 and layout.num_experts != config.n_routed_experts:
        raise ValueError(
            f"RankLayout.num_experts={layout.num_experts} but the model has {config.n_routed_experts} routed experts"
        )
    by_ep: dict[int, Bucket] = {}
    out = []
    for r in range(layout.tp_size):
        e = layout.ep_rank(r) if filter_experts and layout.ep_size > 1 else 0
        if e not in by_ep:
            rng = layout.expert_range(r) if filter_experts and layout.ep_size > 1 else None
            buckets = list(iter_buckets(tensors, _NO_LIMIT, config=config, experts=rng, device=device))
            if len(buckets) != 1:
                raise ValueError(f"adapter produced {len(buckets)} buckets for TP rank {r}; expected 1")
            by_ep[e] = buckets[0]
        out.append(by_ep[e])
    return out


def _sglang_bucket_dict(bucket: Bucket) -> dict:
    """``{"flattened_tensor", "metadata"}`` as SGLang's ``FlattenedTensorBucket`` reads it (no copy), and our
    bucket record (:data:`BUCKET_KEY`) for :func:`verify_received`."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metas = [
        FlattenedTensorMetadata(
            m.name,
            torch.Size(m.shape),
            getattr(torch, m.dtype),
            m.offset,
            m.offset + m.nbytes,
            m.nbytes // getattr(torch, m.dtype).itemsize,
        )
        for m in bucket.metas
    ]
    return {"flattened_tensor": bucket.buffer, "metadata": metas, BUCKET_KEY: bucket.metadata()}


@dataclass
class LoraSyncPayload:
    """The fields of ``LoadLoRAAdapterFromTensorsReqInput`` (stock) for one adapter version."""

    lora_name: str
    config_dict: dict
    serialized_named_tensors: list  # [tp_size] bytes
    load_format: str = LOAD_FORMAT
    expected_checksums: dict | None = None
    buckets: list = field(default_factory=list, repr=False)  # our buckets, for logging/tests
    sends: int = field(default=0, repr=False, compare=False)  # how many times fields_for_send handed it out

    def request_fields(self) -> dict:
        return {
            "lora_name": self.lora_name,
            "config_dict": self.config_dict,
            "serialized_named_tensors": self.serialized_named_tensors,
            "load_format": self.load_format,
            "expected_checksums": self.expected_checksums,
        }

    def fields_for_send(self) -> dict:
        """:meth:`request_fields` for one send: from the second send on, ``serialized_named_tensors`` is
        serialized again from :attr:`buckets` (the bytes of an earlier send may already have been received)."""
        if self.sends:
            if not self.buckets:
                raise ValueError(
                    f"adapter {self.lora_name!r}: this payload was sent already and holds no buckets "
                    "to serialize again (build it with build_payload)"
                )
            self.serialized_named_tensors = _serialize(self.buckets)
        self.sends += 1
        return self.request_fields()


def build_payload(
    lora_name: str,
    tensors: Mapping[str, torch.Tensor],
    adapter_config: dict,
    config,
    layout: RankLayout,
    filter_experts: bool = True,
    sha256: bool = False,
) -> LoraSyncPayload:
    """Build the stock ``load_lora_adapter_from_tensors`` request for ``layout``.

    :param sha256: add SGLang's ``expected_checksums`` for its worker's own check (one SHA-256 pass over the
        adapter; only valid when every rank receives the same tensors, i.e. no expert filtering). Our bucket
        record travels in every payload either way (:func:`verify_received`).
    :raises AdapterRejected: ``adapter_config`` is one SGLang would misread or refuse
        (:func:`~kimi_sglang_plugin.adapters.check_served_config`; prepare it first).
    """
    from kimi_sglang_plugin.adapters import check_served_config

    check_served_config(adapter_config, where=f"adapter {lora_name!r} adapter_config")

    buckets = build_rank_buckets(tensors, config, layout, filter_experts)
    if sha256 and len({id(b) for b in buckets}) > 1:
        raise ValueError(
            "expected_checksums is one dict for all ranks; it cannot describe expert-filtered "
            "payloads (pass sha256=False; every payload carries its own bucket record)"
        )
    payloads = _serialize(buckets)
    checks = (
        {m.name: sha256_hex(t) for m, t in zip(buckets[0].metas, buckets[0].tensors().values())} if sha256 else None
    )
    return LoraSyncPayload(lora_name, dict(adapter_config), payloads, LOAD_FORMAT, checks, buckets)


def _serialize(buckets: list) -> list:
    """One ``MultiprocessingSerializer`` pickle per rank's bucket (shared memory / CUDA-IPC handles, no copy)."""
    from sglang.srt.utils import MultiprocessingSerializer

    return [MultiprocessingSerializer.serialize(_sglang_bucket_dict(b)) for b in buckets]


def verify_received(data: dict, where: str = "SGLang payload") -> None:
    """Check one rank's received payload dict against its bucket record (tensor sums on the buffer's device,
    metadata digest).

    :param data: ``{"flattened_tensor": uint8 [n], "metadata": [...], BUCKET_KEY: Bucket.metadata()}``.
    :raises kimi_core.sync.AdapterSyncError: the record is missing, or names the tensor whose bytes changed.
    """
    from kimi_core.sync import AdapterSyncError, BucketChecksumError

    record = data.get(BUCKET_KEY)
    if record is None:
        raise AdapterSyncError(f"{where}: no {BUCKET_KEY!r} record to verify against (not built by build_payload)")
    try:
        Bucket.from_parts(data["flattened_tensor"], record, verify=True)
    except BucketChecksumError as e:
        raise BucketChecksumError(f"{where}: {e}") from None


def decode_payload(payload: bytes, verify: bool = True) -> dict[str, torch.Tensor]:
    """Receiving side of one rank's payload: deserialized and read as ``TpModelWorker`` does, after
    :func:`verify_received` (``verify=False``: SGLang's reading alone)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    data = MultiprocessingSerializer.deserialize(payload)
    if verify:
        verify_received(data)
    bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    return dict(bucket.reconstruct_tensors())


class StockSGLangBackend:
    """Sends :class:`LoraSyncPayload` to a stock 0.5.23 engine (in-process ``Engine`` or HTTP)."""

    def __init__(self, engine=None, url: str | None = None, timeout: float = 600.0):
        if (engine is None) == (url is None):
            raise ValueError("StockSGLangBackend: pass exactly one of engine= (sglang.Engine) or url=")
        self.engine, self.url, self.timeout = engine, url, timeout

    def load(self, payload: LoraSyncPayload, unload_first: bool = True):
        if self.engine is not None:
            if unload_first:
                try:
                    self.engine.unload_lora_adapter(payload.lora_name)
                except Exception:  # noqa: BLE001 - unloading the replaced version is best effort
                    pass
            from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

            req = LoadLoRAAdapterFromTensorsReqInput(**payload.fields_for_send())
            return self.engine.loop.run_until_complete(
                self.engine.tokenizer_manager.load_lora_adapter_from_tensors(req, None)
            )
        import base64

        body = payload.fields_for_send()
        body["serialized_named_tensors"] = [base64.b64encode(b).decode() for b in body["serialized_named_tensors"]]
        if unload_first:
            _post(self.url, "/unload_lora_adapter", {"lora_name": payload.lora_name}, self.timeout, ok_fail=True)
        return _post(self.url, "/load_lora_adapter_from_tensors", body, self.timeout)


class MilesRegisterBackend:
    """sglang-miles protocol: ``/register_lora_adapter`` (identity + config, upsert), then the
    factors as ``update_weights_from_tensor`` flattened buckets, one payload per TP rank."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url, timeout

    @staticmethod
    def register_body(payload: LoraSyncPayload) -> dict:
        return {"lora_name": payload.lora_name, "config_dict": payload.config_dict}

    @staticmethod
    def update_body(payload: LoraSyncPayload, weight_version: str | None = None) -> dict:
        import base64

        sent = payload.fields_for_send()["serialized_named_tensors"]
        return {
            "serialized_named_tensors": [base64.b64encode(b).decode() for b in sent],
            "load_format": LOAD_FORMAT,
            "flush_cache": True,
            "weight_version": weight_version,
        }

    def load(self, payload: LoraSyncPayload, weight_version: str | None = None):
        _post(self.url, "/register_lora_adapter", self.register_body(payload), self.timeout)
        return _post(self.url, "/update_weights_from_tensor", self.update_body(payload, weight_version), self.timeout)


def _post(base: str, path: str, body: dict, timeout: float, ok_fail: bool = False):
    req = urllib.request.Request(
        base.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except Exception as e:
        if ok_fail:
            return None
        raise RuntimeError(f"SGLang {base}{path} failed: {e}") from e
