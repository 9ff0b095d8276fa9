"""Tokenization and chat templates, done once per request in the gateway with a vocabulary-only model load."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import InvalidRequest

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, used when the GGUF file carries no ``tokenizer.chat_template``."""


class TemplateError(InvalidRequest):
    """The chat template could not render these messages (its ``raise_exception``, or a Jinja error): a 400 naming ``messages``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


WHOLE_STATE_KEYS = (".attention.sliding_window",)
"""GGUF keys (after the architecture's name) of a sliding-window model."""


class Tokenizer:
    def __init__(self, model_path: str | Path, template: str | None = None) -> None:
        self.llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        meta = self.llm.metadata
        self.n_vocab = self.llm.n_vocab()
        self.n_ctx_train = int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length", 0) or 0)
        self.bos_token = self._piece(self.llm.token_bos())
        self.eos_token = self._piece(self.llm.token_eos())
        source = template or meta.get("tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATE
        self.template_source = source
        self.template = compile_template(source)
        self.chat_stops = [s for s in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>") if s in source]
        self.stored_whole = any(k.endswith(WHOLE_STATE_KEYS) or any(m in k for m in (".ssm.", ".wkv.", ".shortconv.")) for k in meta)
        """The model's cache cannot be cut into chunks (a sliding window, a recurrent or hybrid memory: told by its GGUF
        keys, since a vocabulary-only load has no hyper-parameters): workers share it as whole-state checkpoints."""

    def _piece(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Tokens of ``text`` with a BOS in front (unless the text already starts with it).

        ``special`` parses control-token text (``<s>``, ``<|im_start|>``, ...) as those tokens:
        right for a rendered chat template, not for a raw completion prompt.
        """
        add_bos = not (special and self.bos_token and text.startswith(self.bos_token))
        return self.llm.tokenize(text.encode(), add_bos=add_bos, special=special)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, template: jinja2.Template | None = None
    ) -> str:
        """``template``: another compiled template than the model's (`compile_template`)."""
        try:
            return (template or self.template).render(
                messages=list(messages), tools=tools or None, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled as Hugging Face renders them: sandboxed, strict, with ``raise_exception`` and ``tojson``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    """JSON as Hugging Face renders chat templates: not HTML-escaped (Jinja's own ``tojson`` turns ``<`` into ``\\u003c``)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise TemplateError(message)
