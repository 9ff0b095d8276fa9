"""Another GGUF model's tokenizer and chat template, for a generated model that reads prompts as that one does.

A random-weight model (`worker.models.synth`) with tiny dimensions and a real model's
``tokenizer.*`` keys tokenizes and renders every prompt exactly as the real model does,
token for token, but evaluates a long prompt in seconds: tests that care about a prompt's
shape, length and cache, not about the answer's text, run on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gguf


@dataclass(frozen=True)
class Tokenizer:
    """Every ``tokenizer.*`` key of a GGUF file, each as (key, value, value type, array item type)."""

    source: str
    keys: tuple[tuple[str, Any, Any, Any], ...]
    n_vocab: int

    def write(self, writer: gguf.GGUFWriter) -> None:
        for key, value, vtype, sub_type in self.keys:
            writer.add_key_value(key, value, vtype, sub_type)


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer and chat template of the GGUF model at ``path``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except ValueError as e:
        raise ValueError(f"{path}: not a GGUF model ({e})") from None
    keys = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            keys.append((key, field.contents(), field.types[0], sub_type))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no tokenizer (no tokenizer.ggml.tokens)")
    return Tokenizer(Path(path).name, tuple(keys), len(tokens.data))
