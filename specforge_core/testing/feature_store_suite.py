"""FeatureStoreConformance: the feature store contract, as tests a store plugin inherits.

A store plugin tests itself by subclassing and saying how to build a store::

    from specforge_core.testing.feature_store_suite import FeatureStoreConformance

    class TestMyStore(FeatureStoreConformance):
        consume_once = True

        def make_store(self, tmp_path):
            return MyStore(MyOptions(consume_once=True), BuildContext(run_id="conformance"))

Class attributes describe what the store under test does:

- ``consume_once``: ``release`` frees the sample (True) or keeps it for more reads (False);
- ``persistent``: a second ``make_store(tmp_path)`` opens the same store (same ``uri``), and
  refs from the first still read their samples;
- ``dtypes``: the dtype names the store holds (the suite checks each).

The suite needs pytest and torch, nothing else. Every bad-input test checks both the
error's wording and that nothing stored was lost.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest
import torch

from ..contracts import SampleRef
from ..errors import FeatureStoreError, RecordError, SampleNotFoundError, StaleRefError, UnknownFeatureError

ALL_DTYPES = ("float32", "bfloat16", "int64", "bool")


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A deterministic tensor: the same arguments give equal tensors, so tests compare
    what a store returns with a fresh copy rather than with the object they put."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.startswith(("int", "uint")):
        return torch.randint(0, 1000, shape, generator=generator, dtype=getattr(torch, dtype))
    return torch.randn(shape, generator=generator).to(getattr(torch, dtype))


def sample_tensors(tokens: int = 6, width: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A captured sample as a strategy would put it: token ids, hidden states, a loss mask."""
    return {
        "input_ids": make_tensor("int64", (tokens,), seed),
        "hidden_states": make_tensor("bfloat16", (tokens, width), seed + 1),
        "loss_mask": make_tensor("bool", (tokens,), seed + 2),
    }


def assert_same_tensors(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert tuple(got[name].shape) == tuple(tensor.shape), name
        assert torch.equal(got[name].cpu(), tensor), name


def counts(stats: dict[str, int]) -> dict[str, int]:
    """The contract's part of ``stats()`` (a store may report more keys)."""
    return {key: stats[key] for key in ("samples", "bytes_resident", "puts", "gets", "releases", "aborts")}


def assert_message_names(error: pytest.ExceptionInfo, *parts: Any) -> None:
    """The error's text mentions every one of ``parts``."""
    text = str(error.value)
    for part in parts:
        assert str(part) in text, f"{part!r} not in error message: {text}"


class FeatureStoreConformance:
    """The feature store contract; subclass it and override :meth:`make_store`."""

    consume_once = True
    persistent = False
    dtypes: tuple[str, ...] = ALL_DTYPES

    def make_store(self, tmp_path: Any) -> Any:
        """Return a fresh, empty store (for a persistent store: the store kept under ``tmp_path``)."""
        raise NotImplementedError("override make_store(self, tmp_path) to return the store under test")

    @pytest.fixture
    def store(self, tmp_path):
        store = self.make_store(tmp_path)
        yield store
        store.close()

    # -- put and get ------------------------------------------------------------------------

    def test_put_returns_a_ref_naming_this_store_with_each_feature_shape_and_dtype(self, store):
        ref = store.put("s1", sample_tensors(tokens=6, width=4))
        assert isinstance(ref, SampleRef)
        assert ref.sample_id == "s1"
        assert ref.store == store.uri
        assert {name: (spec.shape, spec.dtype) for name, spec in ref.features.items()} == {
            "input_ids": ((6,), "int64"), "hidden_states": ((6, 4), "bfloat16"), "loss_mask": ((6,), "bool"),
        }

    @pytest.mark.parametrize("dtype", ALL_DTYPES)
    def test_get_returns_exactly_the_tensors_that_were_put(self, store, dtype):
        if dtype not in self.dtypes:
            pytest.skip(f"this store does not hold {dtype}")
        shapes = {"vector": (7,), "matrix": (5, 3), "cube": (2, 3, 4)}
        ref = store.put(f"s-{dtype}", {name: make_tensor(dtype, shape, seed=i) for i, (name, shape) in
                                       enumerate(shapes.items())})
        want = {name: make_tensor(dtype, shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}
        assert_same_tensors(store.get(ref), want)
        assert all(spec.dtype == dtype for spec in ref.features.values())

    def test_zero_length_and_scalar_features_roundtrip(self, store):
        tensors = {"empty_rows": torch.zeros(0, 8), "no_tokens": torch.zeros(0, dtype=torch.int64),
                   "scalar": torch.tensor(2.5)}
        ref = store.put("edge", tensors)
        assert ref.features["empty_rows"].shape == (0, 8)
        assert ref.features["scalar"].shape == ()
        assert_same_tensors(store.get(ref), {"empty_rows": torch.zeros(0, 8),
                                             "no_tokens": torch.zeros(0, dtype=torch.int64),
                                             "scalar": torch.tensor(2.5)})

    def test_num_tokens_comes_from_meta_else_from_input_ids_length(self, store):
        assert store.put("by-ids", sample_tensors(tokens=9)).num_tokens == 9
        assert store.put("by-meta", sample_tensors(tokens=9), {"num_tokens": 4}).num_tokens == 4
        assert store.put("neither", {"hidden_states": torch.zeros(3, 2)}).num_tokens == 0

    def test_meta_travels_on_the_ref_and_through_its_json(self, store):
        meta = {"source": "chats.jsonl", "line": 17, "tags": ["a", "b"]}
        ref = store.put("m", sample_tensors(), meta)
        assert ref.meta == meta
        again = SampleRef.from_json(ref.to_json())
        assert again == ref
        assert_same_tensors(store.get(again), sample_tensors())

    def test_keys_select_a_subset_of_features(self, store):
        ref = store.put("s", sample_tensors())
        got = store.get(ref, keys=["loss_mask", "input_ids"])
        want = sample_tensors()
        assert_same_tensors(got, {"loss_mask": want["loss_mask"], "input_ids": want["input_ids"]})

    def test_a_batch_read_hands_then_what_get_returns_in_ref_order(self, store):
        get_batch = getattr(store, "get_batch", None)
        if get_batch is None:
            pytest.skip("this store has no get_batch (the loader calls get)")
        refs = [store.put(f"b{i}", sample_tensors(seed=i)) for i in range(3)]
        got = get_batch(refs[::-1], ["input_ids", "loss_mask"],
                        lambda samples: [{name: t.clone() for name, t in s.items()} for s in samples])
        for tensors, i in zip(got, (2, 1, 0)):
            want = sample_tensors(seed=i)
            assert_same_tensors(tensors, {"input_ids": want["input_ids"], "loss_mask": want["loss_mask"]})
        assert get_batch([], None, len) == 0

    def test_unknown_feature_name_raises_listing_the_available_ones(self, store):
        ref = store.put("s", sample_tensors())
        with pytest.raises(UnknownFeatureError) as error:
            store.get(ref, keys=["input_ids", "target_logits"])
        assert_message_names(error, "target_logits", "'hidden_states'", "'input_ids'", "'loss_mask'")
        assert_same_tensors(store.get(ref), sample_tensors())

    # -- generations ------------------------------------------------------------------------

    def test_put_again_makes_a_new_generation_and_the_older_ref_stale(self, store):
        old = store.put("s", sample_tensors(seed=1))
        new = store.put("s", sample_tensors(seed=2))
        assert new.generation > old.generation
        with pytest.raises(StaleRefError) as error:
            store.get(old)
        assert_message_names(error, "'s'", old.generation, new.generation)
        assert_same_tensors(store.get(new), sample_tensors(seed=2))
        assert store.stats()["samples"] == 1

    def test_put_after_abort_serves_the_new_data_and_older_refs_stay_stale(self, store):
        old = store.put("s", sample_tensors(seed=1))
        store.abort("s")
        new = store.put("s", sample_tensors(seed=2))
        assert new.generation > old.generation
        with pytest.raises(StaleRefError):
            store.get(old)
        assert_same_tensors(store.get(new), sample_tensors(seed=2))

    def test_failed_put_of_a_stored_sample_leaves_the_stored_generation_current(self, store):
        ref = store.put("s", sample_tensors())
        with pytest.raises((FeatureStoreError, RecordError), match="input_ids"):
            store.put("s", {"input_ids": [1, 2, 3]})
        assert_same_tensors(store.get(ref), sample_tensors())
        assert store.stats()["puts"] == 1

    # -- release and abort ------------------------------------------------------------------

    def test_release_frees_the_sample_in_a_consume_once_store(self, store):
        if not self.consume_once:
            pytest.skip("this store retains samples on release")
        ref = store.put("s", sample_tensors())
        store.get(ref)
        store.release(ref)
        with pytest.raises(SampleNotFoundError) as error:
            store.get(ref)
        assert_message_names(error, "'s'", "released")
        assert store.stats()["samples"] == 0
        assert store.stats()["bytes_resident"] == 0

    def test_release_keeps_the_sample_in_a_retaining_store(self, store):
        if self.consume_once:
            pytest.skip("this store frees samples on release")
        ref = store.put("s", sample_tensors())
        for _epoch in range(3):
            assert_same_tensors(store.get(ref), sample_tensors())
            store.release(ref)
        assert store.stats()["samples"] == 1
        assert store.stats()["releases"] == 3

    def test_release_twice_is_harmless(self, store):
        ref = store.put("s", sample_tensors())
        store.release(ref)
        store.release(ref)
        assert store.stats()["releases"] == (1 if self.consume_once else 2)

    def test_release_of_a_stale_ref_keeps_the_newer_generation(self, store):
        old = store.put("s", sample_tensors(seed=1))
        new = store.put("s", sample_tensors(seed=2))
        store.release(old)
        assert_same_tensors(store.get(new), sample_tensors(seed=2))
        assert store.stats()["releases"] == 0

    def test_abort_drops_the_sample_and_is_idempotent(self, store):
        ref = store.put("s", sample_tensors())
        keep = store.put("other", sample_tensors(seed=5))
        store.abort("s")
        store.abort("s")
        store.abort("never-put")
        with pytest.raises(SampleNotFoundError) as error:
            store.get(ref)
        assert_message_names(error, "'s'", "aborted")
        assert_same_tensors(store.get(keep), sample_tensors(seed=5))
        assert store.stats()["aborts"] == 1
        assert store.stats()["samples"] == 1

    def test_get_of_a_sample_never_stored_says_so(self, store):
        ghost = SampleRef(sample_id="ghost", run_id="conformance", store=store.uri,
                          features={"input_ids": {"shape": [3], "dtype": "int64"}}, generation=1)
        with pytest.raises(SampleNotFoundError) as error:
            store.get(ghost)
        assert_message_names(error, "'ghost'", "never stored")

    # -- stats ------------------------------------------------------------------------------

    def test_stats_count_puts_gets_releases_and_aborts_exactly(self, store):
        assert counts(store.stats()) == {"samples": 0, "bytes_resident": 0, "puts": 0, "gets": 0,
                                         "releases": 0, "aborts": 0}
        a = store.put("a", sample_tensors(seed=1))
        store.put("b", sample_tensors(seed=2))
        b = store.put("b", sample_tensors(seed=3))
        store.put("c", sample_tensors(seed=4))
        store.get(a)
        store.get(b)
        store.get(b, keys=["input_ids"])
        store.release(a)
        store.abort("c")
        stats = store.stats()
        assert {k: stats[k] for k in ("puts", "gets", "releases", "aborts")} == {
            "puts": 4, "gets": 3, "releases": 1, "aborts": 1}
        resident = [b] if self.consume_once else [a, b]
        assert stats["samples"] == len(resident)
        assert stats["bytes_resident"] >= sum(ref.nbytes for ref in resident)
        for ref in resident:
            store.abort(ref.sample_id)
        assert store.stats()["samples"] == 0
        assert store.stats()["bytes_resident"] == 0

    # -- bad input --------------------------------------------------------------------------

    def test_ref_from_another_store_is_rejected_naming_its_store(self, store, tmp_path):
        other = self.make_store(tmp_path / "other")
        try:
            foreign = other.put("s", sample_tensors(seed=1))
            mine = store.put("s", sample_tensors(seed=2))
            assert foreign.store != store.uri
            for call in (store.get, store.release):
                with pytest.raises(FeatureStoreError) as error:
                    call(foreign)
                assert_message_names(error, foreign.store, store.uri)
            assert_same_tensors(other.get(foreign), sample_tensors(seed=1))
            assert_same_tensors(store.get(mine), sample_tensors(seed=2))
        finally:
            other.close()

    def test_non_tensor_feature_is_rejected_and_nothing_is_stored(self, store):
        with pytest.raises((FeatureStoreError, RecordError)) as error:
            store.put("s", {"hidden_states": torch.zeros(2, 2), "input_ids": [1, 2, 3]})
        assert_message_names(error, "'input_ids'", "list")
        assert store.stats()["samples"] == 0
        assert store.stats()["puts"] == 0

    def test_empty_sample_is_rejected_and_nothing_is_stored(self, store):
        with pytest.raises((FeatureStoreError, RecordError), match="no tensors"):
            store.put("s", {})
        assert store.stats()["samples"] == 0

    def test_tensor_in_meta_is_rejected_and_nothing_is_stored(self, store):
        with pytest.raises(RecordError, match=r"meta\.mask .*Tensor"):
            store.put("s", sample_tensors(), {"mask": torch.ones(3)})
        assert store.stats()["samples"] == 0
        assert store.stats()["puts"] == 0

    # -- concurrency, persistence, lifecycle --------------------------------------------------

    def test_a_producer_thread_puts_while_the_consumer_gets_and_releases(self, store):
        refs: queue.Queue = queue.Queue()
        failures: list[BaseException] = []

        def produce():
            try:
                for i in range(40):
                    refs.put(store.put(f"s{i}", sample_tensors(tokens=3 + i % 5, seed=i)))
            except BaseException as exc:  # noqa: BLE001 - reported by the consumer below
                failures.append(exc)
            finally:
                refs.put(None)

        producer = threading.Thread(target=produce)
        producer.start()
        consumed = 0
        while (ref := refs.get(timeout=30)) is not None:
            index = int(ref.sample_id[1:])
            assert_same_tensors(store.get(ref), sample_tensors(tokens=3 + index % 5, seed=index))
            store.release(ref)
            consumed += 1
        producer.join()
        assert not failures, failures
        assert consumed == 40
        assert store.stats()["samples"] == (0 if self.consume_once else 40)

    def test_refs_still_read_after_reopening_a_persistent_store(self, store, tmp_path):
        if not self.persistent:
            pytest.skip("this store does not outlive its instance")
        ref = store.put("s", sample_tensors(), {"line": 3})
        store.close()
        reopened = self.make_store(tmp_path)
        try:
            assert reopened.uri == ref.store
            assert_same_tensors(reopened.get(SampleRef.from_json(ref.to_json())), sample_tensors())
        finally:
            reopened.close()

    def test_closed_store_refuses_calls(self, store):
        ref = store.put("s", sample_tensors())
        store.close()
        store.close()
        with pytest.raises(FeatureStoreError, match="closed"):
            store.get(ref)
        with pytest.raises(FeatureStoreError, match="closed"):
            store.put("t", sample_tensors())
