"""The model fingerprint follows the file's bytes and is cached beside it."""

import os
from pathlib import Path

from store.fingerprint import fingerprint_file


def test_fingerprint_is_cached_and_follows_content(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    first = fingerprint_file(model)
    assert first.startswith("xxh3-128:")
    assert (tmp_path / "m.gguf.kvpool-fingerprint").exists()
    assert fingerprint_file(model) == first
    model.write_bytes(b"GGUF" + bytes(999) + b"\x01")
    os.utime(model, ns=(1, 1))
    assert fingerprint_file(model) != first


def test_same_bytes_same_fingerprint_anywhere(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in "ab":
        (tmp_path / d / "m.gguf").write_bytes(b"same")
    assert fingerprint_file(tmp_path / "a" / "m.gguf") == fingerprint_file(tmp_path / "b" / "m.gguf")
