"""A chat job marks where its last message starts: where the next request most likely parts from it (the real model's template)."""

from __future__ import annotations

from pathlib import Path

from gateway.prepare import Preparer
from gateway.schemas import ChatCompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenants


def chat(preparer: Preparer, messages: list[dict[str, str]]):  # type: ignore[no-untyped-def]
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": messages, "max_tokens": 8}
    return preparer.chat(ChatCompletionRequest.model_validate(body), Tenants({}, "").resolve(None)).spec


def test_the_last_message_starts_where_the_chat_before_it_parts(smollm2: Path) -> None:
    preparer = Preparer(GatewaySettings(model=str(smollm2)), smollm2)
    system = {"role": "system", "content": "You answer questions about the harbor, briefly."}
    question = {"role": "user", "content": "Where is the lighthouse?"}
    spec = chat(preparer, [system, question])
    [start] = spec.message_starts
    text = preparer.tokenizer.llm.detokenize(spec.tokens, special=True).decode()
    before = preparer.tokenizer.llm.detokenize(spec.tokens[:start], special=True).decode()
    assert before.endswith("briefly.<|im_end|>\n<|im_start|>"), "everything before it is the system turn"
    assert text[len(before) :].startswith("user\nWhere is the lighthouse?")

    other = chat(preparer, [system, {"role": "user", "content": "And the cafe?"}])
    assert other.message_starts == [start] and other.tokens[:start] == spec.tokens[:start], "the next question parts there"


def test_a_lone_message_marks_nothing(smollm2: Path) -> None:
    preparer = Preparer(GatewaySettings(model=str(smollm2)), smollm2)
    assert chat(preparer, [{"role": "user", "content": "Hello"}]).message_starts == []
