"""Restore or evaluate, by measurement: the worker restores a stored prefix only when that is expected to be faster.

`choose` on its own (a specification of the choice), then an in-process engine on the
real model and S3: told its store is slow it evaluates, told its evaluation is slow it
restores, and both answers have the cold run's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from logging import LogRecord
from pathlib import Path

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY

from gateway.pool.s3server import S3Server
from store.store import Store
from tests.worker.test_invariance import Answer, Runner, _settings
from worker.answering import Engine
from worker.cache.leases import EvalRate
from worker.cache.restore_choice import Choice, Option, RestoreRate, choose
from worker.protocol import lease_key

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, bit for bit


def rates(restore_tokens_per_s: float | None, eval_tokens_per_s: float | None) -> tuple[RestoreRate, EvalRate]:
    restores, evals = RestoreRate(), EvalRate()
    if restore_tokens_per_s is not None:
        restores.bytes_per_token, restores.bytes_per_s = 16_000.0, 16_000.0 * restore_tokens_per_s
    evals.tokens_per_s = eval_tokens_per_s
    return restores, evals


CHUNKS = [Option(upto=256 * j, fetched=256 * j) for j in (1, 2, 3, 4)]
"""Four chunks of 256 tokens of 16,000 bytes each (`rates`): one alone is just under 4 MiB."""


def test_nothing_measured_restores_everything() -> None:
    for measured in (rates(None, 500.0), rates(5000.0, None)):
        d = choose(CHUNKS, 0, 1030, *measured)
        assert (d.choice, d.upto) == (Choice.UNMEASURED, 1024)


def test_the_faster_way_wins() -> None:
    fast_link = choose(CHUNKS, 0, 1030, *rates(restore_tokens_per_s=5000.0, eval_tokens_per_s=500.0))
    assert (fast_link.choice, fast_link.upto) == (Choice.RESTORE, 1024)
    assert fast_link.restore_s == pytest.approx(1024 / 5000) and fast_link.cold_s == pytest.approx(1030 / 500)
    slow_link = choose(CHUNKS, 0, 1030, *rates(restore_tokens_per_s=400.0, eval_tokens_per_s=500.0))
    assert (slow_link.choice, slow_link.upto) == (Choice.EVALUATE, 0)
    assert slow_link.evaluate_s == slow_link.cold_s == pytest.approx(1030 / 500)


def test_a_tail_that_costs_more_than_it_serves_is_left_for_evaluation() -> None:
    """The stored tail holds 250 tokens, of which 10 match the prompt: the chunks are restored, those 10 evaluated."""
    options = [*CHUNKS, Option(upto=1024 + 10, fetched=1024 + 250)]
    d = choose(options, 0, 1036, *rates(restore_tokens_per_s=2000.0, eval_tokens_per_s=500.0))
    assert (d.choice, d.upto) == (Choice.PARTIAL, 1024)
    assert choose(options, 0, 1036, *rates(restore_tokens_per_s=200_000.0, eval_tokens_per_s=500.0)).choice == Choice.RESTORE


def test_the_context_counts_as_held() -> None:
    """What the context holds costs nothing: restoring the chunks it already has is not weighed against it."""
    d = choose(CHUNKS[2:], 512, 1030, *rates(restore_tokens_per_s=400.0, eval_tokens_per_s=500.0))
    assert (d.choice, d.upto) == (Choice.EVALUATE, 512) and d.cold_s == pytest.approx(518 / 500)


def test_a_small_restore_is_made_unweighed() -> None:
    """Under 4 MiB a restore's time is latency, which a throughput does not predict: it is made, whatever the rates say."""
    restores, evals = rates(restore_tokens_per_s=1.0, eval_tokens_per_s=1e6)
    small = [Option(upto=256, fetched=256)]  # 4,096,000 bytes
    assert choose(small, 0, 300, restores, evals).choice == Choice.SMALL
    assert choose([Option(upto=2048, fetched=2048)], 0, 2050, restores, evals).choice == Choice.EVALUATE


def test_a_restore_is_measured() -> None:
    r = RestoreRate()
    r.observe(100_000, 10, 0.1)
    assert r.seconds_for(100) is None, "a small restore is latency, not throughput"
    r.observe(10_000_000, 1000, 0.5)
    assert r.bytes_per_s == 20_000_000 and r.bytes_per_token == 10_000 and r.seconds_for(100) == pytest.approx(0.05)


@pytest.fixture(scope="module")
def engines(smollm2: Path, redis_server, s3_server: S3Server) -> Iterator[dict[str, Runner]]:
    redis.Redis.from_url(redis_server.url).flushall()
    settings = _settings(redis_server.url, s3_server, "kvpool-choice")
    store = Store.open(settings)
    built = {
        "cold": Engine.open(_settings(redis_server.url, s3_server, "kvpool-choice", publish=False), smollm2, store=None, name="cold"),
        "publisher": Engine.open(settings, smollm2, store=store, name="publisher"),
        "chooser": Engine.open(settings, smollm2, store=store, name="chooser"),
    }
    yield {name: Runner(e) for name, e in built.items()}
    for e in built.values():
        e.close()
    store.close()


def choices(choice: Choice) -> float:
    """``kvpool_worker_restore_choices_total`` for ``choice``, over every model and layout."""
    samples = [s for m in REGISTRY.collect() if m.name == "kvpool_worker_restore_choices" for s in m.samples]
    return sum(s.value for s in samples if s.name.endswith("_total") and s.labels.get("choice") == choice)


def decided(caplog: pytest.LogCaptureFixture, job: Callable[[], Answer]) -> tuple[Answer, list[LogRecord]]:
    """Run one job; its answer and the ``restore.choice`` lines it logged (and only it)."""
    caplog.clear()
    with caplog.at_level("INFO", logger="kvpool.worker"):
        answer = job()
    return answer, [r for r in caplog.records if r.getMessage() == "restore.choice"]


def test_the_worker_evaluates_when_its_store_is_slow_and_restores_when_it_is_not(
    engines: dict[str, Runner], caplog: pytest.LogCaptureFixture
) -> None:
    cold_engine = engines["cold"].engine
    prompt = cold_engine.llm.tokenize((Path(__file__).resolve().parents[2] / "README.md").read_bytes(), add_bos=True)[:700]
    cold = engines["cold"].ask(prompt)
    engines["publisher"].ask(prompt)  # stores 2 chunks of 256 and a tail of 186
    chooser = engines["chooser"]
    finder = chooser.engine.finder

    chooser.engine.forget_context()
    finder.restore_rate.bytes_per_token, finder.restore_rate.bytes_per_s = 24_000.0, 24_000.0 * 100  # 100 tokens/s
    finder.eval_rate.tokens_per_s = 1000.0
    evaluated, said = decided(caplog, lambda: chooser.ask(prompt))
    assert evaluated.cached_store == 0 and evaluated.cached_context == 0
    assert np.array_equal(evaluated.logits, cold.logits) and evaluated.tokens == cold.tokens
    assert [r.choice for r in said] == ["evaluate"] and evaluated.restore_choice == "evaluate"  # type: ignore[attr-defined]

    chooser.engine.forget_context()
    finder.restore_rate.bytes_per_token, finder.restore_rate.bytes_per_s = 24_000.0, 24_000.0 * 100_000  # 100k tokens/s
    finder.eval_rate.tokens_per_s = 1000.0
    before = choices(Choice.RESTORE)
    restored, said = decided(caplog, lambda: chooser.ask(prompt))
    assert restored.cached_store == len(prompt) - 2
    assert np.array_equal(restored.logits, cold.logits) and restored.tokens == cold.tokens
    assert choices(Choice.RESTORE) == before + 1 and restored.restore_choice == "restore"
    assert [(r.choice, r.restore_upto, r.restored_tokens) for r in said] == [("restore", len(prompt) - 2, len(prompt) - 2)]  # type: ignore[attr-defined]
    assert finder.restore_rate.bytes_per_s < 24_000.0 * 100_000, "the restore just made was measured"


def test_a_job_that_waits_for_another_workers_lease_takes_one_decision(
    engines: dict[str, Runner], caplog: pytest.LogCaptureFixture
) -> None:
    """It decides, waits for a chunk another worker holds the lease on, looks the store up again and decides again:
    only the decision it acts on, the last, is logged, counted and in its result."""
    cold_engine = engines["cold"].engine
    prompt = cold_engine.llm.tokenize((Path(__file__).resolve().parents[2] / "README.md").read_bytes(), add_bos=True)[100:800]
    engines["publisher"].ask(prompt)
    chooser = engines["chooser"]
    finder = chooser.engine.finder
    keys = chooser.engine.namespace("").chain(prompt)
    chooser.engine.forget_context()
    finder.restore_rate.bytes_per_token, finder.restore_rate.bytes_per_s = 24_000.0, 24_000.0 * 10  # 10 tokens/s: evaluate
    finder.eval_rate.tokens_per_s = 50.0  # the wait is bounded by evaluating a chunk here: 5 s
    conn = redis.Redis.from_url(chooser.engine.settings.redis_url)
    conn.set(lease_key(keys[0]), "another-worker", px=1500)  # a holder that stopped: its lease lapses in 1.5 s
    before = choices(Choice.EVALUATE)
    answer, said = decided(caplog, lambda: chooser.ask(prompt))
    waits = [r for r in caplog.records if r.getMessage() == "lease.waited"]
    assert [r.outcome for r in waits] == ["released"], "the job waited for the lease, then looked again"  # type: ignore[attr-defined]
    assert [r.choice for r in said] == ["evaluate"] and answer.restore_choice == "evaluate"  # type: ignore[attr-defined]
    assert choices(Choice.EVALUATE) == before + 1
    assert answer.cached_store == 0
