"""The gateway and the workers derive one namespace from the settings; everything that changes cache bytes splits it."""

import pytest

from worker.cache.namespace import cache_format, namespace_for
from worker.settings import WorkerSettings


def test_same_settings_same_namespace() -> None:
    a = namespace_for(WorkerSettings(chunk_size=64), "fp", "tenant")
    b = namespace_for(WorkerSettings(chunk_size=64), "fp", "tenant")
    assert a.key == b.key


@pytest.mark.parametrize("change", [{"type_k": "q8_0", "type_v": "q8_0", "flash_attn": True}, {"flash_attn": False}, {"chunk_size": 128}])
def test_layout_and_chunk_size_split_namespaces(change: dict) -> None:
    base = namespace_for(WorkerSettings(chunk_size=64), "fp")
    assert namespace_for(WorkerSettings(**{"chunk_size": 64, **change}), "fp").key != base.key


def test_attention_rotation_switch_is_read_like_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    layouts = {}
    for value in ["", "0", "abc", "1", "2"]:
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", value)
        layouts[value] = cache_format("q8_0", "q8_0", True, "k")
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE")
    unset = cache_format("q8_0", "q8_0", True, "k")
    assert layouts[""] == layouts["0"] == layouts["abc"] == unset
    assert layouts["1"] == layouts["2"] != unset


def test_layout_names_the_payload_format_and_llama_cpp_release() -> None:
    canonical = cache_format("f16", "f16", False, "k").canonical()
    assert "payload=" in canonical and "llama_cpp=0.3.36" in canonical and "kernels=k" in canonical
