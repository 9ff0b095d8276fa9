"""Settings come from KVPOOL_* variables; an empty variable means the default, a bad one is a clear error."""

import pytest
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from store.settings import StoreSettings


def test_environment_variables_set_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CHUNK_SIZE", "64")
    monkeypatch.setenv("KVPOOL_STORE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("KVPOOL_API_KEYS", '{"k": "t"}')
    s = GatewaySettings()
    assert (s.chunk_size, s.store_url, s.api_keys) == (64, "s3://bucket/prefix", {"k": "t"})


def test_empty_variables_mean_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVPOOL_S3_ENDPOINT_URL", "KVPOOL_STORE_MAX_BYTES", "KVPOOL_API_KEYS", "KVPOOL_CHUNK_SIZE"):
        monkeypatch.setenv(name, "")
    s = GatewaySettings()
    assert s.s3_endpoint_url is None and s.store_max_bytes is None and s.api_keys == {} and s.chunk_size == 256


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CHUNK_SIZE", "0")
    with pytest.raises(ValidationError, match="chunk_size"):
        StoreSettings()


def test_the_store_defaults_to_a_folder_in_the_state_dir(tmp_path) -> None:
    assert StoreSettings(state_dir=tmp_path).resolved_store_url() == str(tmp_path / "store")
