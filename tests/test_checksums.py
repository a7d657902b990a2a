"""Checksums of tensor bytes: xxh3-64 in one pass; block crcs computed in threads, joined into the plain
crc32 / crc32c."""

import zlib

import crc32c
import pytest
import torch
import xxhash

from specforge_core.checksums import (CHECKSUM_KINDS, CRC32, CRC32C, CRC_BLOCK, DEFAULT_CHECKSUM, XXH3_64, ChecksumKind,
                                     block_crcs, checksum, checksum_bytes, crc32)


@pytest.mark.parametrize("nbytes", [0, 1, CRC_BLOCK - 1, CRC_BLOCK, CRC_BLOCK + 1, 2 * CRC_BLOCK, 9 * (1 << 20) + 7])
def test_crc32_is_the_plain_zlib_crc32_at_every_block_boundary(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert crc32(data) == zlib.crc32(data.numpy())


@pytest.mark.parametrize("nbytes", [0, 1, CRC_BLOCK - 1, CRC_BLOCK, CRC_BLOCK + 1, 2 * CRC_BLOCK, 9 * (1 << 20) + 7])
def test_crc32c_is_the_plain_crc32c_at_every_block_boundary(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert checksum(data, CRC32C) == crc32c.crc32c(data.numpy().tobytes())


def test_crc32c_matches_the_castagnoli_check_value():
    # The catalogued check value of CRC-32C (iSCSI, RFC 3720) over the ASCII digits 1-9.
    assert checksum(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8), CRC32C) == 0xE3069283


def test_xxh3_64_is_what_new_writes_record_and_matches_its_reference_values():
    assert DEFAULT_CHECKSUM is XXH3_64 and checksum(torch.arange(4)) == checksum(torch.arange(4), XXH3_64)
    assert sorted(CHECKSUM_KINDS) == ["crc32", "crc32c", "xxh3-64"]
    assert checksum(torch.empty(0, dtype=torch.uint8)) == 0x2D06800538D394C2  # XXH3_64bits of no bytes, seed 0
    assert checksum(torch.empty(0, 3)) == 0x2D06800538D394C2


@pytest.mark.parametrize("nbytes", [1, 3, 16, 17, 128, 129, 240, 241, 1024, CRC_BLOCK + 1, 9 * (1 << 20) + 7])
def test_xxh3_64_of_a_tensor_is_that_of_its_bytes_in_any_dtype_and_layout(nbytes):
    # lengths on both sides of XXH3's short-input, mid-size and streaming-stripe code paths
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    raw = data.numpy().tobytes()
    assert checksum(data, XXH3_64) == xxhash.xxh3_64_intdigest(raw) == xxhash.xxh3_64(raw).intdigest()
    if nbytes % 4 == 0:
        assert checksum(data.view(torch.float32).view(2, -1) if nbytes % 8 == 0 else data.view(torch.float32),
                        XXH3_64) == xxhash.xxh3_64_intdigest(raw)
    flipped = bytearray(raw)
    flipped[nbytes // 2] ^= 1
    assert checksum(torch.frombuffer(flipped, dtype=torch.uint8), XXH3_64) != checksum(data, XXH3_64)


def test_a_checksum_without_a_polynomial_cannot_be_split_over_threads():
    with pytest.raises(ValueError, match="checksum 'x' has no polynomial to join block checksums with"):
        ChecksumKind("x", None, xxhash.xxh3_64_intdigest)
    assert not XXH3_64.threaded and CRC32.threaded


def test_block_crcs_are_the_crc_of_each_block_of_the_bytes_in_any_dtype():
    tensor = torch.arange(3 * CRC_BLOCK // 4 // 2, dtype=torch.float32).view(2, -1)  # 1.5 blocks of bytes
    raw = tensor.numpy().tobytes()
    assert block_crcs(tensor) == [zlib.crc32(raw[:CRC_BLOCK]), zlib.crc32(raw[CRC_BLOCK:])]
    assert block_crcs(tensor, CRC32C) == [crc32c.crc32c(raw[:CRC_BLOCK]), crc32c.crc32c(raw[CRC_BLOCK:])]
    assert crc32(tensor) == checksum(tensor, CRC32) == zlib.crc32(raw)


@pytest.mark.parametrize("kind", [CRC32, CRC32C, XXH3_64], ids=lambda kind: kind.name)
@pytest.mark.parametrize("nbytes", [0, 5, CRC_BLOCK + 3])
def test_the_checksum_of_a_slice_of_mapped_bytes_is_that_of_a_tensor_of_them(kind, nbytes):
    """What the disk store's verification computes: a slice of a buffer's memoryview, no tensor made; across
    crc blocks too (CRC_BLOCK + 3 bytes: two blocks, joined)."""
    data = torch.randint(0, 256, (nbytes + 11,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    raw = data.numpy().tobytes()
    expected = {"crc32": zlib.crc32, "crc32c": crc32c.crc32c, "xxh3-64": xxhash.xxh3_64_intdigest}[kind.name]
    view = memoryview(bytearray(raw))[7:7 + nbytes]
    assert checksum_bytes(view, kind) == checksum(data[7:7 + nbytes], kind) == expected(raw[7:7 + nbytes])
