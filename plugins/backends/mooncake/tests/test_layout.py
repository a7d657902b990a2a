"""The object layout, without Mooncake: what a put writes is what a get checks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from specforge_core.contracts import FeatureSpec
from specforge_core.testing.feature_store_suite import assert_same_tensors, make_tensor, sample_tensors
from specforge_plugin_mooncake import layout


def _object(tensors, sample_id="s", generation=7, checksums=True) -> bytes:
    header, parts = layout.encode(sample_id, generation, tensors, checksums=checksums)
    return b"".join(chunk.numpy().tobytes() for chunk in [header, *parts])


def _features(tensors):
    return {name: FeatureSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}


def _decode(blob: bytes, tensors, sample_id="s", generation=7, room=0):
    buffer = torch.zeros(len(blob) + room, dtype=torch.uint8)
    buffer[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return layout.decode(buffer, len(blob), sample_id=sample_id, generation=generation,
                         features=_features(tensors), names=list(tensors), verify=True)


def test_an_object_is_a_safetensors_blob_with_aligned_tensor_data():
    tensors = sample_tensors(tokens=5, width=3)
    blob = _object(tensors)
    assert (8 + int.from_bytes(blob[:8], "little")) % 64 == 0
    assert_same_tensors(load(blob), tensors)


def test_decode_returns_the_tensors_that_were_encoded_even_in_a_larger_buffer():
    tensors = {**sample_tensors(tokens=9, width=4), "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3),
               "big": make_tensor("float32", (layout.CRC_BLOCK // 4 + 3,))}
    assert_same_tensors(_decode(_object(tensors), tensors, room=100), tensors)


def test_header_room_covers_the_header_of_a_sample_with_many_blocks():
    tensors = {"hidden_states": torch.zeros(3 * layout.CRC_BLOCK // 2, dtype=torch.bfloat16),
               "a_rather_long_feature_name_" * 3: torch.zeros(2, 3, 4, 5)}
    header, _parts = layout.encode("sample-" * 20, 1_700_000_000_000_000, tensors, checksums=True)
    assert header.numel() <= layout.header_room("sample-" * 20, _features(tensors))


@pytest.mark.parametrize("cut", [1, 64, 200])
def test_a_truncated_object_is_refused(cut):
    tensors = sample_tensors()
    blob = _object(tensors)
    with pytest.raises(layout.LayoutError, match=r"truncated|not JSON"):
        _decode(blob[:-cut], tensors)


def test_a_flipped_byte_fails_the_crc32_check_naming_the_feature():
    tensors = {"hidden_states": torch.ones(16, 8)}
    blob = bytearray(_object(tensors))
    blob[-5] ^= 0x01
    with pytest.raises(layout.LayoutError, match="'hidden_states' fails its crc32 check"):
        _decode(bytes(blob), tensors)


def test_an_object_of_another_generation_or_sample_is_refused():
    tensors = sample_tensors()
    with pytest.raises(layout.LayoutError, match=r"records 7:'s' \(generation:sample id\), but the ref names 8:'s'"):
        _decode(_object(tensors), tensors, generation=8)
    with pytest.raises(layout.LayoutError, match=r"records 7:'s' .*names 7:'t'"):
        _decode(_object(tensors), tensors, sample_id="t")


def test_a_shape_that_differs_from_the_ref_is_refused():
    tensors = {"hidden_states": torch.zeros(4, 2)}
    blob = _object(tensors)
    with pytest.raises(layout.LayoutError, match=r"'hidden_states' is float32\[4, 2\] but the ref says float32\[2, 4\]"):
        _decode(blob, {"hidden_states": torch.zeros(2, 4)})


def test_without_checksums_no_crc_is_recorded_and_the_size_checks_still_run():
    tensors = sample_tensors()
    blob = _object(tensors, checksums=False)
    assert b"specforge.crc32" not in blob
    assert_same_tensors(_decode(blob, tensors), tensors)
    with pytest.raises(layout.LayoutError, match="truncated"):
        _decode(blob[:-3], tensors)
