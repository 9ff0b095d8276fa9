"""The workloads of ``kvpool bench-peers``: chat requests of real text, the same for every system.

* ``W1`` a long shared system prompt and distinct questions;
* ``W2`` multi-turn chats: each turn sends the whole conversation so far, with the
  answers the system under test gave, and the next question;
* ``W3`` several documents, each asked several questions, the documents alternating;
* ``W4`` distinct prompts that share nothing (what a miss costs).

Counts of documents and chats are odd on purpose. Requests to two round-robin servers
alternate between them, so with an even count every document (or chat) would reach the
same server every time: a sticky assignment no round-robin balancer gives, and one that
would hand the round-robin pair a shared cache by accident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MAX_TOKENS = 32
KEYS = ("W1", "W2", "W3", "W4")


@dataclass(frozen=True)
class Chat:
    """A conversation sent turn by turn; the answers come from the system under test."""

    model: str
    system: str
    questions: tuple[str, ...]
    stop: tuple[str, ...] = ()

    def body(self, answers: list[str]) -> str:
        """The request of turn ``len(answers)``: the conversation so far and the next question."""
        messages = [{"role": "system", "content": self.system}]
        for question, answer in zip(self.questions, answers):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": self.questions[len(answers)]})
        return _body(self.model, messages, MAX_TOKENS, self.stop)


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    bodies: tuple[str, ...] = ()
    """JSON request bodies (chat, streaming), in the order they are sent."""
    chats: tuple[Chat, ...] = ()
    """For W2: sent one turn of every chat at a time, the chats in order."""

    @property
    def requests(self) -> int:
        return len(self.bodies) + sum(len(c.questions) for c in self.chats)


def _body(model: str, messages: list[dict[str, str]], max_tokens: int, stop: tuple[str, ...] = ()) -> str:
    body: dict[str, object] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if stop:
        body["stop"] = list(stop)
    return json.dumps(body)


def chat_body(model: str, system: str, question: str, max_tokens: int = MAX_TOKENS, stop: tuple[str, ...] = ()) -> str:
    return _body(model, [{"role": "system", "content": system}, {"role": "user", "content": question}], max_tokens, stop)


def _text(repo: Path) -> list[str]:
    words: list[str] = []
    for path in [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]:
        words += path.read_text().split()
    return words


def workloads(
    repo: Path, model: str, keys: tuple[str, ...] = KEYS, *, prefix_words: int = 1100, doc_words: int = 450, stop: tuple[str, ...] = ()
) -> list[Workload]:
    """The workloads named in ``keys``, from the words of the repository's Markdown files; ``stop``: every request's stop strings."""
    words = _text(repo)
    shared = " ".join(words[:prefix_words])
    w1 = tuple(chat_body(model, shared, f"In one sentence: what does part {i + 1} of this text say?", stop=stop) for i in range(12))
    at = prefix_words
    docs = [" ".join(words[at + i * doc_words : at + (i + 1) * doc_words]) for i in range(5)]
    asks = ["Summarise this document.", "Name one tool it mentions.", "What problem does it solve?", "Who would use it?"]
    w3 = tuple(chat_body(model, doc, q, stop=stop) for q in asks for doc in docs)
    at += 5 * doc_words
    turns = ("What is this text about?", "Give one detail from it.", "Why does that matter?", "Say it in five words.")
    chats = tuple(Chat(model, "Answer briefly.\n\n" + " ".join(words[at + i * 300 : at + (i + 1) * 300]), turns, stop) for i in range(5))
    at += 5 * 300
    w4 = tuple(chat_body(model, " ".join(words[at + i * 350 : at + (i + 1) * 350]), "What is this about?", stop=stop) for i in range(8))
    found = [
        Workload("W1", "shared system prompt, 12 questions", w1),
        Workload("W2", "5 chats x 4 turns, each turn with the answers so far", chats=chats),
        Workload("W3", "5 documents x 4 questions, alternating", w3),
        Workload("W4", "8 distinct prompts, nothing shared", w4),
    ]
    return [w for w in found if w.key in keys]
