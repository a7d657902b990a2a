"""crc32 of tensor bytes: block crcs computed in threads, joined into zlib's plain crc32."""

import zlib

import pytest
import torch

from specforge_core.checksums import CRC_BLOCK, block_crcs, crc32


@pytest.mark.parametrize("nbytes", [0, 1, CRC_BLOCK - 1, CRC_BLOCK, CRC_BLOCK + 1, 2 * CRC_BLOCK, 9 * (1 << 20) + 7])
def test_crc32_is_the_plain_zlib_crc32_at_every_block_boundary(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert crc32(data) == zlib.crc32(data.numpy())


def test_block_crcs_are_the_crc32_of_each_block_of_the_bytes_in_any_dtype():
    tensor = torch.arange(3 * CRC_BLOCK // 4 // 2, dtype=torch.float32).view(2, -1)  # 1.5 blocks of bytes
    raw = tensor.numpy().tobytes()
    assert block_crcs(tensor) == [zlib.crc32(raw[:CRC_BLOCK]), zlib.crc32(raw[CRC_BLOCK:])]
    assert crc32(tensor) == zlib.crc32(raw)
