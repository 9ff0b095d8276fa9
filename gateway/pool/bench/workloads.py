"""The four workloads, as token ids: deterministic for a given model vocabulary, sizes and seed.

Prompts are random *ordinary* token ids of the model's own vocabulary (no control,
byte or unknown tokens), so any GGUF works and lengths are exact rather than
depending on how text happens to tokenize. Chat role markers are tokenized with the
model's tokenizer. Each workload draws from its own PCG64 stream seeded by
``(seed, workload)``, so changing one workload's sizes leaves the others' prompts alone.

Requests marked ``warmup`` fill caches and stores before measuring; they are run by
every system that keeps state but not recorded as samples.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

WORKLOAD_KEYS = ("shared", "chat", "docs", "unique")
WORKLOAD_TITLES = {"shared": "B1 shared prefix", "chat": "B2 chat", "docs": "B3 documents", "unique": "B4 no sharing"}
"""How reports name the workloads: B1-B4, apart from `kvpool bench-peers`' W1-W4 (earlier reports call these W1-W4 too)."""


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; the defaults are the issue's full sizes."""

    prefix_tokens: int = 2048
    question_tokens: int = 64
    shared_questions: int = 8
    chat_turns: int = 6
    chat_system_tokens: int = 128
    chat_user_tokens: int = 96
    chat_reply_tokens: int = 64
    docs: int = 4
    doc_tokens: int = 1500
    doc_questions: int = 8
    unique_prompts: int = 8
    unique_tokens: int = 512


@dataclass(frozen=True)
class Request:
    workload: str
    index: int
    label: str
    tokens: list[int] = field(repr=False)
    warmup: bool = False
    shared: int = 0
    """Leading tokens a warm-up already sent (the shared prefix): what a perfect cache would reuse."""

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    description: str
    requests: list[Request] = field(repr=False)

    @property
    def measured(self) -> list[Request]:
        return [r for r in self.requests if not r.warmup]


class TokenSource:
    """Ordinary token ids and chat markers of one model's vocabulary."""

    def __init__(self, llm: llama_cpp.Llama) -> None:
        vocab = llm._model.vocab
        normal = llama_cpp.LLAMA_TOKEN_ATTR_NORMAL
        self.pool = np.array([i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_get_attr(vocab, i) == normal])
        if self.pool.size < 16:
            raise ValueError("the model's vocabulary has too few ordinary tokens to build prompts from")
        self.bos = int(llm.token_bos())
        self.eos = int(llm.token_eos())

        def tok(text: str) -> list[int]:
            return [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=True)]

        self.role = {role: tok(f"<|im_start|>{role}\n") for role in ("system", "user", "assistant")}
        self.end = tok("<|im_end|>\n")

    def random(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(t) for t in rng.choice(self.pool, n)]

    def message(self, role: str, content: list[int]) -> list[int]:
        return self.role[role] + content + self.end


def _rng(seed: int, key: str) -> np.random.Generator:
    salt = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, salt])))


def shared_prefix(src: TokenSource, sizes: Sizes, seed: int) -> Workload:
    """One system prompt of ``prefix_tokens`` (BOS included), then different questions; the first only warms up."""
    rng = _rng(seed, "shared")
    prefix = [src.bos] + src.random(rng, sizes.prefix_tokens - 1)
    requests = [
        Request("shared", i, "warm-up" if i == 0 else f"q{i}", prefix + src.random(rng, sizes.question_tokens), i == 0, len(prefix))
        for i in range(sizes.shared_questions + 1)
    ]
    return Workload(
        "shared",
        "Shared system prompt",
        f"a {sizes.prefix_tokens}-token prefix, then {sizes.shared_questions} different {sizes.question_tokens}-token questions "
        "(one more question warms the caches first)",
        requests,
    )


def chat(src: TokenSource, sizes: Sizes, seed: int) -> Workload:
    """A conversation; turn k resends the system prompt, every earlier exchange and a new user message.

    The assistant's earlier replies are scripted (fixed tokens), so every system sees
    the same prompts whatever it generated.
    """
    rng = _rng(seed, "chat")
    history = [src.bos] + src.message("system", src.random(rng, sizes.chat_system_tokens))
    requests = []
    for turn in range(1, sizes.chat_turns + 1):
        history += src.message("user", src.random(rng, sizes.chat_user_tokens))
        prompt = history + src.role["assistant"]
        requests.append(Request("chat", turn - 1, f"turn {turn}", prompt))
        history += src.message("assistant", src.random(rng, sizes.chat_reply_tokens))
    return Workload(
        "chat",
        "Multi-turn chat",
        f"{sizes.chat_turns} turns, each resending the whole history plus a new {sizes.chat_user_tokens}-token user message "
        f"(system prompt {sizes.chat_system_tokens} tokens, scripted {sizes.chat_reply_tokens}-token replies)",
        requests,
    )


def documents(src: TokenSource, sizes: Sizes, seed: int) -> Workload:
    """``docs`` documents times ``doc_questions`` questions each, in a shuffled order; nothing warms up."""
    rng = _rng(seed, "docs")
    docs = [[src.bos] + src.random(rng, sizes.doc_tokens) for _ in range(sizes.docs)]
    pairs = [(d, q, src.random(rng, sizes.question_tokens)) for d in range(sizes.docs) for q in range(sizes.doc_questions)]
    order = rng.permutation(len(pairs))
    requests = [
        Request("docs", i, f"doc{pairs[j][0] + 1}/q{pairs[j][1] + 1}", docs[pairs[j][0]] + pairs[j][2]) for i, j in enumerate(order)
    ]
    return Workload(
        "docs",
        "Documents",
        f"{sizes.docs} documents of {sizes.doc_tokens} tokens x {sizes.doc_questions} {sizes.question_tokens}-token questions each, shuffled",
        requests,
    )


def unique(src: TokenSource, sizes: Sizes, seed: int) -> Workload:
    """Prompts that share nothing but BOS: every cache misses, so this shows what keeping one costs."""
    rng = _rng(seed, "unique")
    requests = [
        Request("unique", i, f"u{i + 1}", [src.bos] + src.random(rng, sizes.unique_tokens - 1)) for i in range(sizes.unique_prompts)
    ]
    return Workload(
        "unique",
        "No sharing",
        f"{sizes.unique_prompts} unrelated prompts of {sizes.unique_tokens} tokens (worst case)",
        requests,
    )


BUILDERS = {"shared": shared_prefix, "chat": chat, "docs": documents, "unique": unique}


def build(keys: tuple[str, ...], src: TokenSource, sizes: Sizes, seed: int = 0) -> list[Workload]:
    return [BUILDERS[k](src, sizes, seed) for k in keys]
