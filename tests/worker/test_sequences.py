"""How many sequences a worker serves by default: 4 where the model's cache keeps one cell per token, 1 where it is checkpointed.

``KVPOOL_PARALLEL`` = 0, the default, is resolved for the model from its header
(`worker.engine.context.sequences_for`): a model whose cache keeps one cell per token gets four
sequences, as llama-server gets four slots, so one worker serves four requests at once;
sliding-window, recurrent and hybrid models keep one, which their whole-state
checkpoints need. A worker's adverts say what it chose, so whoever started it knows its
sequences' names. (The rest of the suite pins one sequence: `tests/conftest.py`.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import PoolClient, prompt_text
from worker.advert import adverts
from worker.engine.context import AUTO_SEQUENCES, flash_attn_for, sequences_for


def test_a_model_with_one_cell_per_token_gets_four_sequences_and_a_checkpointed_one_gets_one(
    tiny_model: Path, smollm2: Path, uncuttable_models: dict[str, Path], gemma3: Path
) -> None:
    assert sequences_for(tiny_model, 0) == sequences_for(smollm2, 0) == AUTO_SEQUENCES == 4
    for kind, path in {**uncuttable_models, "gemma3": gemma3}.items():
        assert sequences_for(path, 0) == 1, kind
    assert sequences_for(tiny_model, 2) == 2 and sequences_for(uncuttable_models["tiny-swa"], 3) == 3, "a value set is kept"


def test_flash_attention_is_on_by_default_except_where_a_sliding_window_moves_restored_cells(
    tiny_model: Path, smollm2: Path, uncuttable_models: dict[str, Path], gemma3: Path
) -> None:
    on = {"tiny": tiny_model, "smollm2": smollm2, "recurrent": uncuttable_models["tiny-ssm"], "hybrid": uncuttable_models["tiny-hybrid"]}
    assert all(flash_attn_for(path, None) for path in on.values())
    assert not flash_attn_for(uncuttable_models["tiny-swa"], None) and not flash_attn_for(gemma3, None), "sliding-window models"
    assert flash_attn_for(gemma3, True) and not flash_attn_for(smollm2, False), "a value set is kept"


def test_a_worker_started_with_the_default_serves_four_requests_at_once(
    start_worker, client: PoolClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPOOL_PARALLEL")
    w = start_worker("d")
    assert w.names == ["d.0", "d.1", "d.2", "d.3"]
    assert {a.sequences for a in adverts(w.conn) if a.pid == w.proc.pid} == {4}  # type: ignore[union-attr]

    never_stop = {client.vocab.token_eos(): -100.0}
    jobs = [
        client.submit(client.spec(client.tokens(prompt_text(90 + i, 40)), max_tokens=400, logit_bias=never_stop), worker=f"d.{i}")
        for i in range(4)
    ]
    most_busy, deadline = 0, time.monotonic() + 60
    while most_busy < 4 and time.monotonic() < deadline:
        most_busy = max(most_busy, sum(a.busy for a in adverts(w.conn) if a.pid == w.proc.pid))  # type: ignore[union-attr]
    assert most_busy == 4, "the four jobs did not run at the same time"
    for job in jobs:
        out = client.collect(job)
        assert out.result is not None and out.result.usage.completion_tokens == 400


def test_a_sliding_window_model_keeps_one_sequence_and_its_checkpoints_by_default(
    start_worker, uncuttable_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPOOL_PARALLEL")
    w = start_worker("swa", KVPOOL_MODEL=str(uncuttable_models["tiny-swa"]))
    assert w.names == ["swa"]
    assert [a.sequences for a in adverts(w.conn) if a.pid == w.proc.pid] == [1]  # type: ignore[union-attr]
    assert "restore.checkpoints" in w.log(), "the window model stores whole-state checkpoints"
