"""A chat job for a model stored whole marks where its last message starts: where the next request most likely parts from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.prepare import Preparer
from gateway.schemas import ChatCompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenants
from worker.protocol import JobSpec

SYSTEM = {"role": "system", "content": "You answer questions about the harbor, briefly."}


def chat(preparer: Preparer, messages: list[dict[str, str]]) -> JobSpec:
    body = {"model": preparer.model_name, "messages": messages, "max_tokens": 8}
    return preparer.chat(ChatCompletionRequest.model_validate(body), Tenants({}, "").resolve(None)).spec


@pytest.fixture(scope="module")
def window_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny-swa``: a sliding-window model (cohere2), so its workers share whole-state checkpoints."""
    from worker.models.synth import ensure_model

    return ensure_model("tiny-swa", tmp_path_factory.mktemp("models"))


def test_the_last_message_starts_where_the_chat_before_it_parts(window_model: Path) -> None:
    preparer = Preparer(GatewaySettings(model=str(window_model)), window_model)
    assert preparer.tokenizer.stored_whole
    spec = chat(preparer, [SYSTEM, {"role": "user", "content": "Where is the lighthouse?"}])
    [start] = spec.message_starts
    detok = preparer.tokenizer.llm.detokenize
    before, after = detok(spec.tokens[:start], special=True).decode(), detok(spec.tokens[start:], special=True).decode()
    assert "briefly.<|im_end|>" in before and "harbor" not in after, "everything before it is the system turn"
    assert "Where is the lighthouse?" in after

    other = chat(preparer, [SYSTEM, {"role": "user", "content": "And the cafe?"}])
    assert other.message_starts == [start] and other.tokens[:start] == spec.tokens[:start], "the next question parts there"


def test_a_lone_message_marks_nothing(window_model: Path) -> None:
    preparer = Preparer(GatewaySettings(model=str(window_model)), window_model)
    assert chat(preparer, [{"role": "user", "content": "Hello"}]).message_starts == []


def test_a_model_whose_cache_is_cut_into_chunks_gets_no_marks(smollm2: Path) -> None:
    """Its chunks serve any prefix to the token already: the hint would only cost the gateway a second tokenization."""
    preparer = Preparer(GatewaySettings(model=str(smollm2)), smollm2)
    assert not preparer.tokenizer.stored_whole
    assert chat(preparer, [SYSTEM, {"role": "user", "content": "Where is the lighthouse?"}]).message_starts == []
