"""The object layout, without Mooncake: what a put writes is what a get checks."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
import xxhash
from safetensors.torch import load

from specforge_core.contracts import FeatureSpec
from specforge_core.testing.feature_store_suite import assert_same_tensors, make_tensor, sample_tensors
from specforge_plugin_mooncake import layout


def _object(tensors, sample_id="s", generation=7, checksums=True) -> bytes:
    header, parts = layout.encode(sample_id, generation, tensors, checksums=checksums)
    return b"".join(chunk.numpy().tobytes() for chunk in [header, *parts])


def load_header(blob) -> dict:
    """The object's ``__metadata__``."""
    return json.loads(bytes(blob[8:8 + int.from_bytes(blob[:8], "little")]).decode())["__metadata__"]


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


def test_a_flipped_byte_fails_the_xxh3_64_check_naming_the_feature():
    tensors = {"hidden_states": torch.ones(16, 8)}
    blob = bytearray(_object(tensors))
    assert json.loads(load_header(blob)["specforge.checksums"]) == {
        "hidden_states": xxhash.xxh3_64_intdigest(tensors["hidden_states"].numpy().tobytes())}
    blob[-5] ^= 0x01
    with pytest.raises(layout.LayoutError, match="'hidden_states' fails its xxh3-64 check: its bytes changed after "
                                                 "the put"):
        _decode(bytes(blob), tensors)


def _format_1_object(tensors, sample_id="s", generation=7) -> bytes:
    """An object exactly as format specforge-mooncake/1 (earlier releases) laid it out: zlib crc32s per 4 MiB block."""
    header, parts = layout.encode(sample_id, generation, tensors, checksums=False)
    text = bytes(header[8:].numpy()).decode().rstrip()
    raw = json.loads(text)
    raw["__metadata__"]["specforge.format"] = "specforge-mooncake/1"
    raw["__metadata__"]["specforge.crc32"] = json.dumps(
        {name: [zlib.crc32(flat[i:i + layout.CRC_BLOCK].numpy().tobytes())
                for i in range(0, max(1, flat.numel()), layout.CRC_BLOCK)]
         for name, flat in zip(sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)), parts)})
    return _blob(raw, parts)


def _blob(raw: dict, parts) -> bytes:
    """An object of header ``raw`` (a dict) and tensor bytes ``parts``, laid out as :func:`layout.encode` does."""
    text = json.dumps(raw).encode()
    padded = -(-(8 + len(text)) // 64) * 64 - 8
    return padded.to_bytes(8, "little") + text + b" " * (padded - len(text)) + b"".join(
        part.numpy().tobytes() for part in parts)


def test_an_object_of_format_1_is_read_and_checked_by_its_crc32s_per_block():
    tensors = {"hidden_states": make_tensor("float32", (layout.CRC_BLOCK // 4 + 3,)), "input_ids": torch.arange(9)}
    blob = bytearray(_format_1_object(tensors))
    assert_same_tensors(_decode(bytes(blob), tensors), tensors)
    blob[-5] ^= 0x01  # in hidden_states' second crc block, its last 12 bytes (input_ids, 8-byte elements, go first)
    with pytest.raises(layout.LayoutError, match="'hidden_states' fails its crc32 check"):
        _decode(bytes(blob), tensors)


@pytest.mark.parametrize(("metadata", "message"), [
    ({"specforge.format": "specforge-mooncake/3"}, r"its format is 'specforge-mooncake/3', not one of "
                                                    r"'specforge-mooncake/1', 'specforge-mooncake/2' \(an object a "
                                                    r"later release wrote"),
    ({"specforge.checksum": "sha3"}, r"records checksums of kind 'sha3', which this specforge does not know"),
    ({"specforge.checksums": "[1, 2]"}, r"its recorded checksums are not a map"),
    ({"specforge.checksums": "{"}, r"its recorded checksums are malformed \(JSONDecodeError"),
], ids=["later-format", "unknown-kind", "not-a-map", "malformed"])
def test_an_object_of_a_later_format_or_unknown_checksums_is_refused(metadata, message):
    tensors = sample_tensors()
    header, parts = layout.encode("s", 7, tensors, checksums=True)
    raw = json.loads(bytes(header[8:].numpy()).decode().rstrip())
    raw["__metadata__"].update(metadata)
    with pytest.raises(layout.LayoutError, match=message):
        _decode(_blob(raw, parts), tensors)


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
    assert b"specforge.checksum" not in blob and b"specforge.crc32" not in blob
    assert_same_tensors(_decode(blob, tensors), tensors)
    with pytest.raises(layout.LayoutError, match="truncated"):
        _decode(blob[:-3], tensors)
