"""``/tokenize`` and ``/detokenize``, as llama-server offers them: count tokens against the exact tokenizer the pool uses.

The shapes follow llama-server's: ``{"content": ..., "add_special": false, "parse_special":
true, "with_pieces": false}`` gives ``{"tokens": [ids]}``, or with pieces ``{"tokens":
[{"id": 1, "piece": "text"}]}``, where a piece that is not valid UTF-8 on its own (part of
a character) is given as its list of bytes.

vLLM's shapes are understood too, as lm-evaluation-harness's ``remote`` tokenizer (its
default when a server has them) sends them: ``{"prompt": ..., "add_special_tokens": ...}``
gives ``{"tokens", "count", "max_model_len"}``, ``/detokenize`` answers the text under
``prompt`` as well as ``content``, and ``GET /tokenizer_info`` names the special tokens and
the chat template. lm-eval then tokenizes with the pool's own tokenizer: no download.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from gateway.errors import InvalidRequest
from gateway.schemas import _lone_surrogate

router = APIRouter()

MAX_DETOKENIZE = 1 << 17
"""Most token ids one /detokenize call takes (the body limit bounds it too)."""


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    content: str | None = None
    prompt: str | None = Field(None, description="vLLM's name for content; the answer then has vLLM's shape.")
    add_special: bool = Field(False, description="Add the model's BOS (and EOS, where the model asks for it).")
    add_special_tokens: bool | None = Field(None, description="vLLM's name for add_special (vLLM's default: true).")
    parse_special: bool = Field(True, description="Read control-token text (<|im_start|>, ...) as those tokens.")
    with_pieces: bool = Field(False, description="Return each token's text beside its id.")
    model: str | None = None

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give the text as content (llama-server) or as prompt (vLLM), not both")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)
    model: str | None = None


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    gw = request.app.state.gateway
    gw.tenants.resolve(request.headers.get("authorization"))
    if body.model is not None:
        gw.preparer.check_model(body.model)
    field, text = ("content", body.content) if body.content is not None else ("prompt", body.prompt or "")
    if _lone_surrogate(text, field) is not None:
        raise InvalidRequest(f"{field} holds a lone UTF-16 surrogate, which is not valid Unicode text", param=field)
    tok = gw.preparer.tokenizer
    vllm = body.prompt is not None
    special = (body.add_special_tokens if body.add_special_tokens is not None else True) if vllm else body.add_special
    ids: list[int] = await run_in_threadpool(tok.llm.tokenize, text.encode(), special, body.parse_special)
    if vllm and not body.with_pieces:
        return {"tokens": ids, "count": len(ids), "max_model_len": gw.settings.n_ctx}
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(tok.llm.detokenize([t], special=True))} for t in ids]}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    gw = request.app.state.gateway
    gw.tenants.resolve(request.headers.get("authorization"))
    if body.model is not None:
        gw.preparer.check_model(body.model)
    tok = gw.preparer.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tok.n_vocab]
    if bad:
        raise InvalidRequest(f"token ids must lie in [0, {tok.n_vocab}), got {bad[0]}", param="tokens")
    raw: bytes = await run_in_threadpool(tok.llm.detokenize, body.tokens, None, True)
    text = raw.decode("utf-8", "replace")
    return {"content": text, "prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's: the special tokens and the chat template, for clients that tokenize through the server (lm-eval's ``remote``)."""
    gw = request.app.state.gateway
    gw.tenants.resolve(request.headers.get("authorization"))
    tok = gw.preparer.tokenizer
    return {
        "tokenizer_class": "llama.cpp",
        "bos_token": tok.bos_token or None,
        "eos_token": tok.eos_token or None,
        "chat_template": tok.template_source,
        "model_max_length": gw.settings.n_ctx,
    }
