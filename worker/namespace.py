"""The namespace a worker's chunks live in, computed the same way by the gateway and the workers.

The gateway hashes a prompt's chain before any worker sees it, and the worker recomputes
it and refuses a job whose keys differ, so both sides must agree on every field. Besides
the cache types and flash attention, the layout carries the version of the chunk payload
format, the llama-cpp-python release (which pins the llama.cpp state layout) and
``LLAMA_ATTN_ROT_DISABLE``, an environment switch that changes the bytes of a quantized
cache without changing anything else.
"""

from __future__ import annotations

import llama_cpp

from store.chain import CacheFormat, Namespace
from worker.kvstate import PAYLOAD_VERSION
from worker.llama_state import attn_rot_disabled
from worker.settings import WorkerSettings


def cache_format(type_k: str, type_v: str, flash_attn: bool) -> CacheFormat:
    return CacheFormat.of(
        type_k.lower(),
        type_v.lower(),
        flash_attn,
        {"payload": str(PAYLOAD_VERSION), "llama_cpp": llama_cpp.__version__, "attn_rot": "off" if attn_rot_disabled() else "on"},
    )


def namespace_for(settings: WorkerSettings, model_fingerprint: str, tenant_salt: str = "") -> Namespace:
    return Namespace(
        model_fingerprint,
        cache_format(settings.type_k, settings.type_v, settings.flash_attn),
        settings.chunk_size,
        tenant_salt,
    )
