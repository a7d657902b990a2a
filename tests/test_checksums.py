"""Checksums of tensor bytes: block crcs computed in threads, joined into the plain crc32 / crc32c."""

import zlib

import crc32c
import pytest
import torch

from specforge_core.checksums import CRC32, CRC32C, CRC_BLOCK, DEFAULT_CHECKSUM, block_crcs, checksum, crc32


@pytest.mark.parametrize("nbytes", [0, 1, CRC_BLOCK - 1, CRC_BLOCK, CRC_BLOCK + 1, 2 * CRC_BLOCK, 9 * (1 << 20) + 7])
def test_crc32_is_the_plain_zlib_crc32_at_every_block_boundary(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert crc32(data) == zlib.crc32(data.numpy())


@pytest.mark.parametrize("nbytes", [0, 1, CRC_BLOCK - 1, CRC_BLOCK, CRC_BLOCK + 1, 2 * CRC_BLOCK, 9 * (1 << 20) + 7])
def test_crc32c_is_the_plain_crc32c_at_every_block_boundary(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert checksum(data, CRC32C) == crc32c.crc32c(data.numpy().tobytes())


def test_crc32c_matches_the_castagnoli_check_value_and_is_what_new_writes_record():
    # The catalogued check value of CRC-32C (iSCSI, RFC 3720) over the ASCII digits 1-9.
    assert checksum(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8), CRC32C) == 0xE3069283
    assert DEFAULT_CHECKSUM is CRC32C


def test_block_crcs_are_the_crc_of_each_block_of_the_bytes_in_any_dtype():
    tensor = torch.arange(3 * CRC_BLOCK // 4 // 2, dtype=torch.float32).view(2, -1)  # 1.5 blocks of bytes
    raw = tensor.numpy().tobytes()
    assert block_crcs(tensor) == [zlib.crc32(raw[:CRC_BLOCK]), zlib.crc32(raw[CRC_BLOCK:])]
    assert block_crcs(tensor, CRC32C) == [crc32c.crc32c(raw[:CRC_BLOCK]), crc32c.crc32c(raw[CRC_BLOCK:])]
    assert crc32(tensor) == checksum(tensor, CRC32) == zlib.crc32(raw)
