"""Start-up checks are run once per model, library and layout on a machine, and again whenever one of them changes.

Real models loaded in this process (`worker.startup.loaded.LoadedModel`, as a worker loads its model);
the records live in the test's own folder.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from worker.models.synth import ensure_model
from worker.settings import WorkerSettings
from worker.startup.checkrecords import CheckRecords, library_digest, library_folder
from worker.startup.loaded import LoadedModel
from worker.startup.selfcheck import SelfCheck


def load(model: Path, records: Path, caplog: pytest.LogCaptureFixture) -> dict[str, logging.LogRecord]:
    """Load ``model`` as a worker does, with its checks remembered in ``records``; the start-up checks' log lines by name."""
    caplog.clear()
    settings = WorkerSettings(model=str(model), n_ctx=256, n_threads=1, parallel=1, check_records=records, redis_url="redis://unused")
    with caplog.at_level(logging.INFO, logger="kvpool.worker"):
        loaded = LoadedModel(settings, model, store=None)
        try:
            decode, exact = loaded.decode, loaded.exact
        finally:
            loaded.stop()
            loaded.context.close()
    lines = {r.getMessage(): r for r in caplog.records if r.getMessage() in ("restore.selfcheck", "decode.mode")}
    assert lines["decode.mode"].mode == str(decode) and lines["restore.selfcheck"].exact == exact  # type: ignore[attr-defined]
    return lines


def sources(lines: dict[str, logging.LogRecord]) -> dict[str, str]:
    return {name: r.source for name, r in lines.items()}  # type: ignore[attr-defined]


def test_a_second_worker_of_the_same_model_takes_the_checks_from_the_record_and_logs_the_same_verdicts(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = load(tiny_model, tmp_path / "checks", caplog)
    assert sources(first) == {"restore.selfcheck": "checked", "decode.mode": "checked"}
    assert len(list((tmp_path / "checks").glob("*.json"))) == 2, "one record per check"

    second = load(tiny_model, tmp_path / "checks", caplog)
    assert sources(second) == {"restore.selfcheck": "record", "decode.mode": "record"}
    for name in first:
        assert (second[name].detail, second[name].mode if name == "decode.mode" else second[name].ok) == (  # type: ignore[attr-defined]
            first[name].detail,  # type: ignore[attr-defined]
            first[name].mode if name == "decode.mode" else first[name].ok,  # type: ignore[attr-defined]
        )


def test_another_model_runs_the_checks_again(tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    load(tiny_model, tmp_path / "checks", caplog)
    other = ensure_model("tiny", tmp_path / "models", seed=1)  # the same shape, other weights: another fingerprint
    assert sources(load(other, tmp_path / "checks", caplog)) == {"restore.selfcheck": "checked", "decode.mode": "checked"}
    assert len(list((tmp_path / "checks").glob("*.json"))) == 4


def test_a_changed_library_is_another_identity_and_its_check_runs_again(tmp_path: Path) -> None:
    """A rebuilt llama.cpp (one library's bytes changed) does not inherit the loaded library's records."""
    rebuilt = tmp_path / "lib"
    shutil.copytree(library_folder(), rebuilt)
    assert library_digest(rebuilt) == library_digest(library_folder()), "the same bytes are the same library"
    ggml = sorted(rebuilt.glob("libggml*.so*"))[0]
    ggml.write_bytes(ggml.read_bytes() + b"\0")
    library_digest.cache_clear()
    assert library_digest(rebuilt) != library_digest(library_folder())

    facts = {"model": "m", "layout": "l"}
    loaded = CheckRecords.for_worker(tmp_path / "checks", **facts)
    runs: list[str] = []

    def check(verdict: bool) -> SelfCheck:
        runs.append("ran")
        return SelfCheck(verdict, verdict, "checked")

    assert loaded.recall("restore-cells", SelfCheck, lambda: check(True)) == (SelfCheck(True, True, "checked"), "checked")
    assert loaded.recall("restore-cells", SelfCheck, lambda: check(False)) == (SelfCheck(True, True, "checked"), "record")
    other = CheckRecords.for_worker(tmp_path / "checks", library=rebuilt, **facts)
    assert other.recall("restore-cells", SelfCheck, lambda: check(False)) == (SelfCheck(False, False, "checked"), "checked")
    assert runs == ["ran", "ran"]


def test_a_damaged_record_is_checked_again_and_no_folder_means_no_record(tmp_path: Path) -> None:
    records = CheckRecords.for_worker(tmp_path / "checks", model="m")
    path = records.path("restore-cells")
    assert path is not None
    path.parent.mkdir()
    path.write_text('{"identity": ')  # half a record
    assert records.recall("restore-cells", SelfCheck, lambda: SelfCheck(True, True, "x"))[1] == "checked"
    assert records.recall("restore-cells", SelfCheck, lambda: SelfCheck(False, False, "y"))[1] == "record"

    never = CheckRecords.for_worker(None, model="m")
    assert never.recall("restore-cells", SelfCheck, lambda: SelfCheck(True, True, "x"))[1] == "checked"
    assert never.recall("restore-cells", SelfCheck, lambda: SelfCheck(True, True, "x"))[1] == "checked"
