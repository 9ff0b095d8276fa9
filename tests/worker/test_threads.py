"""A worker uses the threads it is given, for prompts as for generation: N workers never run N x cores threads."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.pool.up import default_workers
from worker.engine import Engine
from worker.settings import WorkerSettings


@pytest.mark.parametrize(("env", "threads", "batch"), [({"n_threads": 1}, 1, 1), ({"n_threads": 1, "n_threads_batch": 2}, 1, 2)])
def test_prompt_threads_follow_the_settings(tiny_model: Path, env: dict[str, int], threads: int, batch: int) -> None:
    engine = Engine(WorkerSettings(publish=False, self_check=False, **env), tiny_model, store=None, name="t")
    try:
        params = engine.llm.context_params
        assert (params.n_threads, params.n_threads_batch) == (threads, batch)
    finally:
        engine.close()


def test_n_threads_batch_defaults_to_n_threads() -> None:
    assert WorkerSettings(n_threads=3).threads_batch() == 3
    assert WorkerSettings(n_threads=3, n_threads_batch=1).threads_batch() == 1


@pytest.mark.parametrize(("cores", "split"), [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (16, (4, 4)), (64, (16, 4))])
def test_up_splits_the_cores_without_oversubscribing(cores: int, split: tuple[int, int]) -> None:
    workers, threads = default_workers(cores)
    assert (workers, threads) == split and workers * threads == cores
