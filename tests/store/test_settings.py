"""Settings come from KVPOOL_* variables; an empty variable means the default, a bad one is a clear error."""

import pytest
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from store.settings import StoreSettings
from worker.settings import PoolSettings, WorkerSettings


def test_environment_variables_set_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CHUNK_SIZE", "64")
    monkeypatch.setenv("KVPOOL_STORE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("KVPOOL_API_KEYS", '{"k": "t"}')
    s = GatewaySettings()
    assert (s.chunk_size, s.store_url, s.api_keys) == (64, "s3://bucket/prefix", {"k": "t"})


def test_empty_variables_mean_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVPOOL_S3_ENDPOINT_URL", "KVPOOL_STORE_MAX_BYTES", "KVPOOL_API_KEYS", "KVPOOL_CHUNK_SIZE", "KVPOOL_MODEL_CACHE"):
        monkeypatch.setenv(name, "")
    s = GatewaySettings()
    assert s.s3_endpoint_url is None and s.store_max_bytes is None and s.api_keys == {} and s.chunk_size == 256
    assert s.model_cache is None


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_IO_THREADS", "0")
    with pytest.raises(ValidationError, match="io_threads"):
        StoreSettings()


def test_the_store_defaults_to_a_folder_in_the_state_dir(tmp_path) -> None:
    assert StoreSettings(state_dir=tmp_path).resolved_store_url() == str(tmp_path / "store")


def test_the_gateway_reads_the_pool_settings_not_the_workers() -> None:
    """What gateway and workers must agree on is one class both extend; llama.cpp's options are the worker's alone."""
    assert issubclass(GatewaySettings, PoolSettings) and issubclass(WorkerSettings, PoolSettings)
    assert not issubclass(GatewaySettings, WorkerSettings)
    shared = {"model", "model_sha256", "model_cache", "chunk_size", "n_ctx", "queue", "job_attempts", "job_timeout_s", "stream_ttl_s"}
    assert set(PoolSettings.model_fields) - set(StoreSettings.model_fields) == shared
    assert not {"n_batch", "n_threads", "type_k", "flash_attn", "heartbeat_s", "lease_s"} & set(GatewaySettings.model_fields)


def test_the_store_does_not_read_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk size is the pool's: a store command is not refused for a value only the gateway and workers read."""
    monkeypatch.setenv("KVPOOL_CHUNK_SIZE", "0")
    StoreSettings()
    with pytest.raises(ValidationError, match="chunk_size"):
        PoolSettings()
