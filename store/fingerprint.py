"""The model fingerprint: a digest of the GGUF file's bytes, cached beside it.

It enters every chain's namespace, so two files that differ in a single weight never
share a chunk. Hashing a multi-GB file takes a second or two; the result is cached in
``<model>.kvpool-fingerprint`` keyed by the file's size and modification time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

_BLOCK = 16 << 20


def fingerprint_file(path: str | os.PathLike[str]) -> str:
    path = Path(path)
    st = path.stat()
    cache = path.with_name(path.name + ".kvpool-fingerprint")
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        cached = json.loads(cache.read_text())
        if {k: cached.get(k) for k in stamp} == stamp:
            return str(cached["fingerprint"])
    except (OSError, ValueError, KeyError):
        pass
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    digest = "xxh3-128:" + h.hexdigest()
    try:
        cache.write_text(json.dumps({**stamp, "fingerprint": digest}))
    except OSError:
        pass
    return digest
