"""A job's breakpoints (a client's ``cache_control``): each prefix is published at once, whatever becomes of the answer, and pinned."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from store.backends.fs import FsBackend
from store.chain import tail_key
from store.index import RedisIndex
from store.store import Store
from tests.helpers import prompt_text
from worker.answering import Engine
from worker.protocol import Breakpoint, JobSpec, SamplingParams, TokenEvent, job_spec
from worker.settings import WorkerSettings

CHUNK = 8


@pytest.fixture
def engine(tiny_model: Path, redis_url: str, tmp_path: Path) -> Iterator[Engine]:
    store = Store(FsBackend(tmp_path / "blobs"), RedisIndex.from_url(redis_url))
    e = Engine.open(WorkerSettings(chunk_size=CHUNK, n_ctx=512, n_threads=1, self_check=False), tiny_model, store=store, name="bp")
    yield e
    e.close()
    store.close()


def spec_for(e: Engine, tokens: list[int], breakpoints: list[Breakpoint], **sampling: object) -> JobSpec:
    spec = job_spec(tokens, model=e.fingerprint, chunk_size=CHUNK, sampling=SamplingParams(**{"temperature": 0.0, **sampling}))
    return spec.model_copy(update={"breakpoints": breakpoints})


def kept(e: Engine, tokens: list[int], n: int) -> list[float]:
    """When the pins of the prefix ``tokens[:n]`` (its chunks and its tail) run out; 0 for an entry not pinned, -1 for one not stored."""
    ns = e.namespace("")
    keys = ns.chain(tokens[:n])
    tail = [tail_key(keys[-1], tokens[len(keys) * CHUNK : n])] if n % CHUNK else []
    assert e.store is not None
    return [entry.pinned_until if (entry := e.store.index.get(k)) else -1.0 for k in [*keys, *tail]]


def test_a_breakpoint_is_published_and_pinned_even_when_no_answer_is_asked_for(engine: Engine, tiny_model: Path) -> None:
    tokens = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False).tokenize(prompt_text(3, 40).encode())
    assert len(tokens) > 30
    now = time.time()
    result = engine.run(spec_for(engine, tokens, [Breakpoint(tokens=21, ttl_s=300)], max_tokens=0), lambda ev: True)
    assert result.usage.completion_tokens == 0
    assert engine.publisher is not None and engine.publisher.wait_idle()
    assert all(now + 299 < t <= time.time() + 300 for t in kept(engine, tokens, 21)), "2 chunks and the breakpoint's own tail"
    assert kept(engine, tokens, len(tokens))[3] == 0.0, "the rest of the prompt is published, not pinned"

    # Asked again with a longer TTL: nothing is new, the pin is only lengthened.
    engine.run(spec_for(engine, tokens, [Breakpoint(tokens=21, ttl_s=3600)], max_tokens=0), lambda ev: True)
    assert engine.publisher.wait_idle()
    assert all(t > now + 3500 for t in kept(engine, tokens, 21))


def test_a_breakpoint_is_kept_when_the_client_leaves_at_the_first_token(engine: Engine, tiny_model: Path) -> None:
    tokens = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False).tokenize(prompt_text(4, 40).encode())
    seen: list[TokenEvent] = []

    def leave(ev: TokenEvent) -> bool:
        seen.append(ev)
        return False  # the client is gone

    result = engine.run(spec_for(engine, tokens, [Breakpoint(tokens=19, ttl_s=300)], max_tokens=50), leave)
    assert result.finish_reason == "cancelled" and len(seen) == 1
    assert engine.publisher is not None and engine.publisher.wait_idle()
    assert all(t > time.time() + 290 for t in kept(engine, tokens, 19))


def test_a_breakpoint_inside_a_stored_prompt_gets_its_tail_published_from_the_cells_copied(engine: Engine, tiny_model: Path) -> None:
    """The store holds the whole prompt; a mark in its middle still needs the cells of its own tail, which a copy
    from the store's end would not hold: the copy starts at the mark's chunk."""
    tokens = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False).tokenize(prompt_text(5, 60).encode())
    assert len(tokens) > 5 * CHUNK
    engine.run(spec_for(engine, tokens, [], max_tokens=0), lambda ev: True)
    assert engine.publisher is not None and engine.publisher.wait_idle()
    assert kept(engine, tokens, len(tokens))[-1] == 0.0, "the whole prompt, tail included, is stored and not pinned"
    assert kept(engine, tokens, 2 * CHUNK + 3)[-1] == -1.0, "a tail in the prompt's middle is not"

    engine.run(spec_for(engine, tokens, [Breakpoint(tokens=2 * CHUNK + 3, ttl_s=300)], max_tokens=0), lambda ev: True)
    assert engine.publisher.wait_idle()
    assert all(t > time.time() + 290 for t in kept(engine, tokens, 2 * CHUNK + 3)), "its 2 chunks and its own tail, pinned"
