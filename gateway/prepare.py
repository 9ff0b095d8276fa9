"""From an OpenAI request body to a job: render, tokenize, check the limits, hash the chain.

A ``max_tokens`` beyond what the prompt leaves of the context is clamped to what is left, as
llama-server does (agents ask for 32,000 whatever the model): the answer ends with
``finish_reason`` ``length`` when it fills the context. Only a prompt that fills the
context alone is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from gateway.errors import ContextOverflow, InvalidRequest, NotFound
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.structured import response_grammar
from gateway.tenants import Tenant
from gateway.tokenizer import TemplateError, Tokenizer
from gateway.toolformat import Offered, ToolFormat
from store.fingerprint import fingerprint_file
from store.tails import common_prefix
from worker.protocol import JobSpec, SamplingParams, job_spec


@dataclass(frozen=True)
class Prepared:
    spec: JobSpec
    chat: bool
    echo: str | None = None
    """The prompt's text, put before the completion (``echo``)."""
    tools: Offered | None = None
    """The functions a chat answer may call: its text is parsed for their calls."""


EARLIER_KEPT = 256
"""Chats' earlier messages whose tokens a gateway keeps (about 8 KB each for 2,000 tokens)."""


class Preparer:
    """Holds what every request needs: the tokenizer, the model fingerprint and the settings."""

    def __init__(self, settings: GatewaySettings, model_path: Path) -> None:
        self.settings = settings
        template = Path(settings.chat_template_file).read_text() if settings.chat_template_file else None
        self.tokenizer = Tokenizer(model_path, template)
        self.fingerprint = fingerprint_file(model_path)
        self.model_name = settings.model_name or Path(model_path).name.removesuffix(".gguf")
        self.tool_format = ToolFormat.for_template(self.tokenizer.template_source, settings.tool_format)
        self._earlier: dict[bytes, np.ndarray] = {}
        """Tokens of recent chats' earlier messages, by their text's hash, least recently used first (`_last_message_start`)."""

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise NotFound(
                f"the model '{name}' does not exist; this gateway serves '{self.model_name}'", param="model", code="model_not_found"
            )

    def completions(self, req: CompletionRequest, tenant: Tenant) -> list[Prepared]:
        """One job per prompt."""
        return [self.completion(req, tenant, prompt, i) for i, prompt in enumerate(req.prompts())]

    def completion(self, req: CompletionRequest, tenant: Tenant, prompt: str | list[int] | None = None, index: int = 0) -> Prepared:
        self.check_model(req.model)
        if prompt is None:
            prompts = req.prompts()
            if len(prompts) != 1:
                raise InvalidRequest("this takes one prompt per request", param="prompt")
            prompt = prompts[0]
        param = "prompt" if len(req.prompts()) == 1 else f"prompt.{index}"
        if isinstance(prompt, str):
            tokens = self.tokenizer.tokenize(prompt)
        else:
            tokens = list(prompt)
            bad = [t for t in tokens if not 0 <= t < self.tokenizer.n_vocab]
            if bad:
                raise InvalidRequest(f"{param}: token ids must lie in [0, {self.tokenizer.n_vocab}), got {bad[0]}", param="prompt")
        prepared = self._job(
            req, tokens, req.max_tokens, list(req.stop or []), req.logprobs, tenant, chat=False, score=req.echo and req.logprobs is not None
        )
        if not req.echo:
            return prepared
        text = prompt if isinstance(prompt, str) else self.tokenizer.llm.detokenize(tokens).decode("utf-8", "replace")
        return Prepared(prepared.spec, chat=False, echo=text)

    def chat_tokens(self, req: ChatCompletionRequest, prefill: str = "") -> list[int]:
        """The prompt: the messages as the chat template (or, with tools, `ToolFormat`) renders them, then ``prefill``.

        ``prefill``: the start of the answer, which the model continues.
        """
        try:
            text = self.tool_format.render(self.tokenizer, req)
        except TemplateError as e:
            raise InvalidRequest(str(e), param="messages") from None
        return self.tokenizer.tokenize(text + prefill, special=True)

    def chat(self, req: ChatCompletionRequest, tenant: Tenant, *, prefill: str = "") -> Prepared:
        self.check_model(req.model)
        tokens = self.chat_tokens(req, prefill)
        stops = list(req.stop or []) + [s for s in self.tokenizer.chat_stops if s not in (req.stop or [])]
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        budget = req.token_budget(min(self.settings.max_tokens_default, max(1, self.settings.n_ctx - len(tokens) - 1)))
        vocab = self.tokenizer.llm._model.vocab
        grammar = self.tool_format.grammar(req, vocab) or response_grammar(req.response_format, vocab)
        prepared = self._job(req, tokens, budget, stops, logprobs, tenant, chat=True, grammar=grammar)
        prepared.spec.message_starts = self._last_message_start(req, tokens)
        return Prepared(prepared.spec, chat=True, tools=self.tool_format.offered(req))

    def _last_message_start(self, req: ChatCompletionRequest, tokens: list[int]) -> list[int]:
        """Where the last message starts in ``tokens``: a hint for workers that checkpoint whole states, for their models only.

        The prompt of the messages before it parts from this one there: they share every
        token up to the last message's own (whatever the template adds after them). Their
        tokens are kept for the next request with the same earlier messages (another
        question about the same document, say): tokenizing them again cost as much as the
        prompt itself (12 ms for 2,000 tokens of Gemma 3).
        """
        if len(req.messages) < 2 or not self.tokenizer.stored_whole:
            return []
        try:
            text = self.tool_format.render(self.tokenizer, req.model_copy(update={"messages": req.messages[:-1]}))
        except (TemplateError, InvalidRequest):  # a template that refuses the shorter chat: no hint
            return []
        key = xxhash.xxh3_128_digest(text.encode())
        before = self._earlier.pop(key, None)
        if before is None:
            before = np.asarray(self.tokenizer.tokenize(text, special=True), dtype=np.int32)
        self._earlier[key] = before
        while len(self._earlier) > EARLIER_KEPT:
            self._earlier.pop(next(iter(self._earlier)))
        n = common_prefix(before, tokens)
        return [n] if 0 < n < len(tokens) else []

    def _job(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        tokens: list[int],
        max_tokens: int,
        stop: list[str],
        logprobs: int | None,
        tenant: Tenant,
        *,
        chat: bool,
        grammar: str | None = None,
        score: bool = False,
    ) -> Prepared:
        n_ctx = self.settings.n_ctx
        if len(tokens) >= n_ctx:
            raise ContextOverflow(len(tokens), n_ctx, "messages" if chat else "prompt")
        max_tokens = min(max_tokens, n_ctx - len(tokens))  # what is left of the context, as llama-server clamps it
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        if any(k >= self.tokenizer.n_vocab for k in bias):
            raise InvalidRequest(f"logit_bias token ids must lie in [0, {self.tokenizer.n_vocab})", param="logit_bias")
        spec = job_spec(
            tokens,
            model=self.fingerprint,
            chunk_size=self.settings.chunk_size,
            tenant_salt=tenant.salt,
            sampling=SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                repeat_penalty=req.repeat_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                stop=stop,
                logprobs=logprobs,
                logit_bias=bias,
                n=req.n,
                grammar=grammar,
                prompt_logprobs=logprobs if score else None,
            ),
            enqueued_at=time.time(),
            route_key=req.prompt_cache_key,
        )
        return Prepared(spec, chat)
