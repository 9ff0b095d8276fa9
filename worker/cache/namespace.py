"""The namespace a worker's chunks live in, computed the same way by the gateway and the workers.

The gateway hashes a prompt's chain before any worker sees it, and the worker recomputes
it and refuses a job whose keys differ, so both sides must agree on every field. Besides
the cache types and flash attention, the layout carries the version of the chunk payload
format, the llama-cpp-python release (which pins the llama.cpp state layout),
``LLAMA_ATTN_ROT_DISABLE``, an environment switch that changes the bytes of a quantized
cache without changing anything else, and the worker's kernel fingerprint
(`worker.kernels`): cells computed by other kernels (another CPU generation, build or a
GPU) are other bits, so workers share chunks only with workers whose kernels match.
With ``KVPOOL_SHARE_ACROSS_KERNELS`` the fingerprint gives way to `SHARED_KERNELS`:
every worker so set shares one namespace per layout, whatever its kernels.

Old chunks, stored before the kernel fingerprint was part of the layout, are simply not
found any more (their namespace is another one); eviction removes them in time.
"""

from __future__ import annotations

import llama_cpp

from store.chain import CHECKPOINT_EXTRA, CacheFormat, Namespace
from worker.engine.kvcache import attn_rot_disabled
from worker.engine.kvstate import PAYLOAD_VERSION
from worker.kernels import KernelFingerprint, library_fingerprint
from worker.settings import WorkerSettings

SHARED_KERNELS = "any"
"""The layout's ``kernels`` field of workers that share chunks across kernel fingerprints."""


def kernels_field(kernels: KernelFingerprint, share_across_kernels: bool) -> str:
    """What the layout says of the kernels: their digest, or `SHARED_KERNELS`."""
    return SHARED_KERNELS if share_across_kernels else kernels.digest


def cache_format(type_k: str, type_v: str, flash_attn: bool, kernels: str, *, checkpoints: bool = False) -> CacheFormat:
    """The layout; ``kernels`` is `kernels_field` of the worker's fingerprint.

    ``checkpoints``: blobs hold a whole sequence state at a chunk boundary (`store.checkpoints`),
    not the chunk's cells, so they live in namespaces of their own.
    """
    return CacheFormat.of(
        type_k.lower(),
        type_v.lower(),
        flash_attn,
        {
            "payload": str(PAYLOAD_VERSION),
            "llama_cpp": llama_cpp.__version__,
            "attn_rot": "off" if attn_rot_disabled() else "on",
            "kernels": kernels,
            **(dict([CHECKPOINT_EXTRA]) if checkpoints else {}),
        },
    )


def worker_kernels(settings: WorkerSettings) -> KernelFingerprint:
    """The kernel fingerprint of a worker with these settings, in this process's llama.cpp."""
    return library_fingerprint(settings.n_gpu_layers)


def namespace_for(settings: WorkerSettings, model_fingerprint: str, tenant_salt: str = "", *, checkpoints: bool = False) -> Namespace:
    kernels = kernels_field(worker_kernels(settings), settings.share_across_kernels)
    return Namespace(
        model_fingerprint,
        cache_format(settings.type_k, settings.type_v, _flash_attn(settings), kernels, checkpoints=checkpoints),
        settings.chunk_size,
        tenant_salt,
    )


def _flash_attn(settings: WorkerSettings) -> bool:
    """``KVPOOL_FLASH_ATTN`` as the worker resolves it (`worker.engine.context.flash_attn_for`): unset, by the model."""
    if settings.flash_attn is not None:
        return settings.flash_attn
    from worker.engine.context import flash_attn_for
    from worker.models.fetch import resolve_model

    return flash_attn_for(resolve_model(settings), None)
