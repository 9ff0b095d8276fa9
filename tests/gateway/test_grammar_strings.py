"""Every JSON string a grammar accepts is JSON to a strict parser: no raw control character (U+0000-U+001F) gets in.

A model that writes a raw newline inside a string, where the grammar lets it, produces
an answer ``json.loads`` refuses: a forced tool call comes back as text, a JSON
``response_format`` answer does not parse. The grammars are the gateway's own (a
``response_format`` schema, JSON mode, the generic tool format, a forced Hermes call),
checked by llama.cpp's own grammar sampler over SmolLM2's vocabulary, token by token, as a
worker samples.
"""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path

import llama_cpp
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from gateway.schemas import ChatCompletionRequest
from gateway.structured import json_object_grammar, schema_grammar
from gateway.toolformat import ToolFormat
from gateway.tools import tool_grammar

TOOL = {
    "type": "function",
    "function": {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
}
ASK = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def vocab_model(smollm2: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(smollm2), vocab_only=True, verbose=False)


def writable(llm: llama_cpp.Llama, text: str) -> bool:
    """Whether the model's tokens can write ``text`` at all (SmolLM2's vocabulary has no token for some control characters)."""
    return bytes(llm.detokenize(llm.tokenize(text.encode(), add_bos=False, special=False))) == text.encode()


def accepts(llm: llama_cpp.Llama, grammar: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets ``text`` through, then the end of the answer."""
    sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, grammar.encode(), b"root")
    assert sampler, "the grammar does not parse"
    try:
        for token in [*llm.tokenize(text.encode(), add_bos=False, special=False), llm.token_eos()]:
            data = (llama_cpp.llama_token_data * 1)()
            data[0].id, data[0].logit, data[0].p = token, 0.0, 0.0
            candidates = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
            if math.isinf(data[0].logit):
                return False
            if token != llm.token_eos():
                llama_cpp.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama_cpp.llama_sampler_free(sampler)


def grammars(llm: llama_cpp.Llama) -> dict[str, tuple[str, str]]:
    """Each grammar, and the JSON it wraps a string in (``{}`` where the string goes)."""
    vocab = llm._model.vocab
    generic_auto = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": [TOOL]})
    forced = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": [TOOL], "tool_choice": "required"})
    return {
        "schema string": (schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}), '{{"a": "{}"}}'),
        "schema maxLength": (schema_grammar({"type": "array", "items": {"type": "string", "maxLength": 80}}), '["{}"]'),
        "JSON mode": (json_object_grammar(), '{{"k": "{}"}}'),
        "generic answer": (ToolFormat("generic").grammar(generic_auto, vocab) or "", '{{"response": "{}"}}'),
        "generic call": (
            ToolFormat("generic").grammar(generic_auto, vocab) or "",
            '{{"tool_call": {{"name": "note", "arguments": {{"text": "{}"}}}}}}',
        ),
        "hermes call": (tool_grammar(forced, vocab) or "", '<tool_call>\n{{"name": "note", "arguments": {{"text": "{}"}}}}\n</tool_call>'),
    }


def raw(text: str) -> str:
    """``text`` inside JSON quotes as a careless writer puts it: quotes and backslashes escaped, control characters left raw."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def parses(kind: str, doc: str) -> bool:
    body = doc.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>") if kind == "hermes call" else doc
    try:
        json.loads(body)
        return True
    except json.JSONDecodeError:
        return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", max_codepoint=0x2FFF), max_size=40))
@example(text="line one\nline two")
@example(text="tab\there")
@example(text="a\rb")
def test_every_string_a_grammar_accepts_parses_with_strict_json(vocab_model: llama_cpp.Llama, text: str) -> None:
    assume(writable(vocab_model, text))
    for kind, (grammar, wrapper) in grammars(vocab_model).items():
        written = wrapper.format(raw(text))
        if accepts(vocab_model, grammar, written):
            assert parses(kind, written), f"{kind}: the grammar accepts {written!r}, which strict json.loads refuses"
        escaped = wrapper.format(json.dumps(text, ensure_ascii=False)[1:-1])
        assert accepts(vocab_model, grammar, escaped), f"{kind}: the grammar refuses valid JSON {escaped!r}"
