"""``/tokenize`` and ``/detokenize``, as llama-server offers them: count tokens against the exact tokenizer the pool uses.

The shapes follow llama-server's: ``{"content": ..., "add_special": false, "parse_special":
true, "with_pieces": false}`` gives ``{"tokens": [ids]}``, or with pieces ``{"tokens":
[{"id": 1, "piece": "text"}]}``, where a piece that is not valid UTF-8 on its own (part of
a character) is given as its list of bytes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gateway.errors import InvalidRequest
from gateway.schemas import _lone_surrogate

router = APIRouter()

MAX_DETOKENIZE = 1 << 17
"""Most token ids one /detokenize call takes (the body limit bounds it too)."""


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    content: str
    add_special: bool = Field(False, description="Add the model's BOS (and EOS, where the model asks for it).")
    parse_special: bool = Field(True, description="Read control-token text (<|im_start|>, ...) as those tokens.")
    with_pieces: bool = Field(False, description="Return each token's text beside its id.")
    model: str | None = None


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
    if _lone_surrogate(body.content, "content") is not None:
        raise InvalidRequest("content holds a lone UTF-16 surrogate, which is not valid Unicode text", param="content")
    tok = gw.preparer.tokenizer
    ids: list[int] = await run_in_threadpool(tok.llm.tokenize, body.content.encode(), body.add_special, body.parse_special)
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
    return {"content": raw.decode("utf-8", "replace")}
