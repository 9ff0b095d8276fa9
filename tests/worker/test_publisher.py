"""The background publisher never holds up a job: when tasks pile up past its bound, new ones are dropped and counted;
and a job copies for it only the cells of the chunks the store lacked when the job looked."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest
from prometheus_client import REGISTRY

from store.backends.fs import FsBackend
from store.chain import CacheFormat, Namespace
from store.index import RedisIndex
from store.store import Store
from tests.helpers import prompt_text
from worker import answering as engine_module
from worker.answering import Engine
from worker.cache.kvchunks import cut_state
from worker.cache.publisher import Publisher
from worker.engine import llama_state
from worker.engine.kvstate import describe_state
from worker.protocol import SamplingParams, job_spec
from worker.settings import WorkerSettings

NS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=4)
LABELS = {"model": "test-publisher", "layout": "f16"}


def _dropped() -> float:
    return REGISTRY.get_sample_value("kvpool_worker_publish_errors_total", {**LABELS, "reason": "queue_full"}) or 0.0


def test_a_full_queue_drops_new_tasks_and_says_so(store: Store) -> None:
    publisher = Publisher(store, max_pending=1, labels=LABELS)
    release, running = threading.Event(), threading.Event()
    done: list[str] = []

    def hold() -> None:  # runs on the publisher's thread once its task is over: it stays busy until released
        running.set()
        release.wait(10)
        done.append("first")

    before = _dropped()
    try:
        assert publisher.submit(NS, [1, 2, 3, 4], [], b"not a state", on_done=hold)
        assert running.wait(10)
        assert publisher.submit(NS, [1, 2, 3, 4], [], b"not a state", on_done=lambda: done.append("second")), "one waits in the queue"
        assert not publisher.submit(NS, [1, 2, 3, 4], [], b"not a state", on_done=lambda: done.append("dropped")), "the queue is full"
        assert done == ["dropped"], "a dropped task's on_done runs at once (its leases are released)"
        assert _dropped() == before + 1
    finally:
        release.set()
        assert publisher.wait_idle(10)
        publisher.close()
    assert done == ["dropped", "first", "second"]


# --- what a job copies for publishing: the cells of the chunks the store lacked ---------------

CHUNK = 8


@pytest.fixture
def engine(tiny_model: Path, redis_url: str, tmp_path: Path) -> Iterator[Engine]:
    store = Store(FsBackend(tmp_path / "blobs"), RedisIndex.from_url(redis_url))
    settings = WorkerSettings(chunk_size=CHUNK, n_ctx=512, n_threads=1, parallel=2, self_check=False)
    e = Engine.open(settings, tiny_model, store=store, name="pub")
    yield e
    e.close()
    store.close()


def ask(e: Engine, tokens: list[int]) -> None:
    spec = job_spec(tokens, model=e.fingerprint, chunk_size=CHUNK, sampling=SamplingParams(max_tokens=0, temperature=0.0))
    e.run(spec, lambda ev: True)
    e.after_answer()
    assert e.publisher is not None and e.publisher.wait_idle()


@pytest.mark.parametrize("build", ["kvpool", "without the window"])
def test_a_longer_turn_copies_only_the_cells_past_what_the_store_held_and_stores_the_same_chunks(
    engine: Engine, tiny_model: Path, build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert llama_state.readable_from(CHUNK) == CHUNK, "kvpool's build of llama.cpp reads a window of positions"
    if build != "kvpool":  # a build without deploy/patches/state-window.patch copies every cell, and publishes the same
        monkeypatch.setattr(llama_state, "_WINDOW", None)
    copies: list[tuple[int, int]] = []

    def recording(llm: object, *args: object, start: int = 0, **kwargs: object) -> object:
        state = llama_state.read_seq_state(llm, *args, start=start, **kwargs)
        copies.append((start, describe_state(state).n_cells))
        return state

    monkeypatch.setattr(engine_module, "read_seq_state", recording)
    tokens = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False).tokenize(prompt_text(11, 60).encode())
    assert len(tokens) > 7 * CHUNK
    ask(engine, tokens[: 3 * CHUNK + 3])
    ask(engine, tokens[: 7 * CHUNK + 5])

    first = 3 * CHUNK if build == "kvpool" else 0  # the store held 3 chunks and a tail when the second turn looked
    assert copies == [(0, 3 * CHUNK + 3), (first, 7 * CHUNK + 5 - first)]
    ns, whole = engine.namespace(""), llama_state.read_seq_state(engine.llm)
    held = tokens[: 7 * CHUNK + 5]
    keys = ns.chain(held)
    assert engine.store is not None
    stored = [bytes(p) for p in engine.store.fetch(ns, held, keys, 0, 7)]
    assert stored == cut_state(whole, CHUNK, 0, 7), "every chunk, the first turn's and the second's, is the cells' own bytes"
    hit = engine.store.find(ns, held, keys)
    assert hit.tokens == len(held), "the second turn's tail is stored too"
