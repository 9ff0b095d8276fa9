"""The blob format: a blob is read back only at the exact chain position it was written for."""

import pytest

from store.blob import BlobName, decode_blob, encode_blob, header_size, verify_blob
from store.chain import CacheFormat, Namespace
from store.errors import BlobCorrupt, BlobMismatch

NS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=4)
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
KEYS = NS.chain(TOKENS)
PAYLOAD = bytes(range(256)) * 40


def blob(index: int = 1, payload: bytes = PAYLOAD) -> bytes:
    return encode_blob(NS.key, index, KEYS[index - 1] if index else NS.key, TOKENS[index * 4 : index * 4 + 4], payload)


def expected(index: int = 1) -> dict:
    return dict(
        namespace=NS.key,
        index=index,
        parent=KEYS[index - 1] if index else NS.key,
        key=KEYS[index],
        tokens=TOKENS[index * 4 : index * 4 + 4],
    )


def test_round_trip() -> None:
    data = blob()
    assert bytes(verify_blob(data, **expected())) == PAYLOAD
    header, payload = decode_blob(data)
    assert (header.index, header.key, header.parent, header.tokens) == (1, KEYS[1], KEYS[0], (9, 10, 11, 12))
    assert header.payload_len == len(PAYLOAD) == len(payload)


def test_header_size_does_not_depend_on_payload() -> None:
    assert len(blob(payload=b"")) == header_size(4)
    assert len(blob(payload=b"x" * 1000)) == header_size(4) + 1000


def test_empty_payload_round_trips() -> None:
    assert bytes(verify_blob(blob(payload=b""), **expected())) == b""


def flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("pos", [0, 5, 10, 30, 50, 62, 66, 80, 100], ids=lambda p: f"byte{p}")
def test_bit_flip_in_header_is_corrupt(pos: int) -> None:
    assert pos < header_size(4)
    with pytest.raises(BlobCorrupt):
        verify_blob(flip(blob(), pos), **expected())


@pytest.mark.parametrize("where", [0, len(PAYLOAD) // 2, len(PAYLOAD) - 1])
def test_bit_flip_in_payload_is_corrupt(where: int) -> None:
    with pytest.raises(BlobCorrupt, match="payload checksum"):
        verify_blob(flip(blob(), header_size(4) + where), **expected())


@pytest.mark.parametrize("keep", [0, 3, 40, header_size(4) - 1, header_size(4), header_size(4) + 100])
def test_truncated_is_corrupt(keep: int) -> None:
    with pytest.raises(BlobCorrupt):
        verify_blob(blob()[:keep], **expected())


def test_trailing_bytes_are_corrupt() -> None:
    with pytest.raises(BlobCorrupt, match="payload length"):
        decode_blob(blob() + b"\0")


def test_wrong_namespace_is_mismatch() -> None:
    other = Namespace("fp", NS.layout, chunk_size=4, tenant_salt="other-tenant")
    with pytest.raises(BlobMismatch, match="namespace"):
        verify_blob(blob(), **{**expected(), "namespace": other.key})


def test_wrong_parent_is_mismatch() -> None:
    with pytest.raises(BlobMismatch, match="parent"):
        verify_blob(blob(), **{**expected(), "parent": NS.key})


def test_wrong_position_is_mismatch() -> None:
    with pytest.raises(BlobMismatch, match="index"):
        verify_blob(blob(), **{**expected(), "index": 2})


def test_wrong_tokens_are_mismatch() -> None:
    with pytest.raises(BlobMismatch):
        verify_blob(blob(), **{**expected(), "tokens": [9, 10, 11, 13]})


def test_blob_of_another_chain_at_the_same_position_is_mismatch() -> None:
    other_tokens = [5, 6, 7, 8, 1, 2, 3, 4]
    other_keys = NS.chain(other_tokens)
    data = encode_blob(NS.key, 1, other_keys[0], other_tokens[4:], PAYLOAD)
    with pytest.raises(BlobMismatch):
        verify_blob(data, **expected())


def test_forged_key_is_corrupt_even_with_a_valid_header_checksum() -> None:
    import struct

    import xxhash

    data = bytearray(blob())
    data[44:60] = KEYS[0]
    hlen = header_size(4)
    struct.pack_into("<Q", data, hlen - 8, xxhash.xxh3_64_intdigest(bytes(data[: hlen - 8])))
    with pytest.raises(BlobCorrupt, match="key does not match"):
        decode_blob(bytes(data))


def test_names_round_trip_and_reject_foreign_objects() -> None:
    name = BlobName(NS.key, 3, KEYS[1])
    assert str(name).startswith("chunks/v1/")
    assert BlobName.parse(str(name)) == name
    assert BlobName.parse("chunks/v1/zz/000001-abc") is None
    assert BlobName.parse("quarantine/" + str(name)) is None
    assert BlobName.parse(str(name).replace("chunks/v1/", "chunks/v9/")) is None
