"""Chain hashing: content addresses that cover every token before them and every setting that changes the bytes."""

import subprocess
import sys

import numpy as np
import pytest

from store.chain import (
    CacheFormat,
    Namespace,
    chain_keys,
    chunk_key,
    extend_chain,
    namespace_key,
    token_bytes,
)

NS = Namespace("fingerprint-0", CacheFormat.of("f16", "f16", False), chunk_size=4, tenant_salt="")


def test_fixed_vectors() -> None:
    # Frozen values: a change here breaks every stored chain and needs a FORMAT_VERSION bump.
    assert NS.key.hex() == "9beca8e53b4db149d999f3fa72a4ba00"
    assert [k.hex() for k in NS.chain(list(range(10)))] == [
        "6546bdf5fde18ded7e1d4be15dca7a5e",
        "697622ff37293eea9eaccc2d1dfac6b3",
    ]
    assert chunk_key(b"\x00" * 16, [1, 2, 3]).hex() == chunk_key(b"\x00" * 16, np.array([1, 2, 3])).hex()


def test_chunk_key_is_xxh3_128_of_parent_and_le_int32_tokens() -> None:
    import xxhash

    parent = bytes(range(16))
    assert chunk_key(parent, [1, 256]) == xxhash.xxh3_128_digest(parent + b"\x01\x00\x00\x00\x00\x01\x00\x00")


def test_only_full_chunks_get_keys() -> None:
    assert NS.chain([]) == []
    assert NS.chain([1, 2, 3]) == []
    assert len(NS.chain(list(range(8)))) == 2
    assert len(NS.chain(list(range(11)))) == 2


def test_each_key_covers_every_token_before_it() -> None:
    a = NS.chain([1, 2, 3, 4, 5, 6, 7, 8])
    b = NS.chain([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]
    c = NS.chain([1, 2, 3, 4, 5, 6, 7, 9])
    assert a[0] == c[0] and a[1] != c[1]
    assert NS.chain(list(range(12)))[:2] == NS.chain(list(range(8)))


@pytest.mark.parametrize(
    "other",
    [
        Namespace("fingerprint-1", NS.layout, 4, ""),
        Namespace("fingerprint-0", CacheFormat.of("q8_0", "q8_0", True), 4, ""),
        Namespace("fingerprint-0", CacheFormat.of("f16", "f16", True), 4, ""),
        Namespace("fingerprint-0", CacheFormat.of("f16", "f16", False, {"LLAMA_ATTN_ROT_DISABLE": "1"}), 4, ""),
        Namespace("fingerprint-0", NS.layout, 8, ""),
        Namespace("fingerprint-0", NS.layout, 4, "tenant-b"),
    ],
    ids=["model", "cache-type", "flash-attn", "env-setting", "chunk-size", "tenant"],
)
def test_namespace_covers_model_layout_chunk_size_and_tenant(other: Namespace) -> None:
    tokens = list(range(8))
    assert other.key != NS.key
    assert set(other.chain(tokens)).isdisjoint(NS.chain(tokens))


def test_layout_canonical_form_ignores_extras_order() -> None:
    a = CacheFormat.of("f16", "f16", False, {"A": "1", "B": "2"})
    b = CacheFormat.of("f16", "f16", False, {"B": "2", "A": "1"})
    assert namespace_key("m", a, 4, "") == namespace_key("m", b, 4, "")


def test_fields_are_length_prefixed_so_boundaries_cannot_shift() -> None:
    assert namespace_key("ab", NS.layout, 4, "c") != namespace_key("a", NS.layout, 4, "bc")


def test_keys_are_identical_in_another_process() -> None:
    code = (
        "from store.chain import CacheFormat, Namespace;"
        "ns = Namespace('fingerprint-0', CacheFormat.of('f16', 'f16', False), 4, 't');"
        "print(','.join(k.hex() for k in ns.chain(list(range(1000)))))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": s}).stdout
        for s in ("1", "2")
    }
    assert len(outs) == 1
    here = Namespace("fingerprint-0", CacheFormat.of("f16", "f16", False), 4, "t")
    assert outs.pop().strip() == ",".join(k.hex() for k in here.chain(list(range(1000))))


@pytest.mark.parametrize("bad", [[-1], [2**31], [[1, 2]]])
def test_rejects_tokens_that_are_not_int32_ids(bad: list) -> None:
    with pytest.raises(ValueError):
        token_bytes(bad)


def test_rejects_bad_namespace() -> None:
    with pytest.raises(ValueError):
        Namespace("", NS.layout, 4)
    with pytest.raises(ValueError):
        Namespace("m", NS.layout, 0)


def test_chain_keys_matches_stepwise_definition() -> None:
    tokens = np.random.default_rng(0).integers(0, 32000, 1000)
    parent, expected = NS.key, []
    for i in range(1000 // 4):
        parent = chunk_key(parent, tokens[i * 4 : (i + 1) * 4])
        expected.append(parent)
    assert chain_keys(NS.key, tokens, 4) == expected


def test_a_chain_extends_from_the_keys_of_a_prefix_without_hashing_them_again() -> None:
    tokens = list(range(1, 20))
    whole = NS.chain(tokens)
    for done in range(len(whole) + 1):
        assert NS.extend(whole[:done], tokens) == whole
    assert extend_chain(NS.key, [], tokens[:3], 4) == []
    with pytest.raises(ValueError, match="chunks of keys"):
        NS.extend(whole, tokens[:7])
