"""What the built-in feature stores share: input checks, refs, errors and bookkeeping.

:class:`BaseFeatureStore` implements the public ``put / get / release / abort / stats /
close`` of the feature store protocol once: it checks every input, builds the
:class:`~specforge_core.contracts.SampleRef`, keeps the counters and words the errors. A
subclass only says where bytes live (``_store``, ``_load``, ``_release``, ``_drop``,
``_resident``). Third-party stores may subclass it too; they do not have to.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from ..contracts import FeatureSpec, SampleRef
from ..dtypes import dtype_name
from ..checksums import TensorCheck, TensorChecks, copies_checking
from ..errors import FeatureStoreError, RecordError, SampleNotFoundError, StaleRefError, UnknownFeatureError

T = TypeVar("T")

#: How many released / aborted sample ids a store remembers to explain a failed get.
#: Bounded so that a long online run does not grow without limit; past it the message
#: falls back to "released, aborted or never stored".
_REMEMBERED_GONE = 65536

#: A safetensors header reserves this key, so no store accepts it as a feature name.
_RESERVED_NAME = "__metadata__"


def format_bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def owned_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached from autograd, copied only when it does not own exactly its bytes.

    A slice of a padded batch is a view that keeps the whole batch's storage alive; kept as
    it is, one stored sample would pin the batch for as long as the sample lives. Such views
    (and non-contiguous tensors) are replaced by a compact contiguous copy; a tensor that
    already owns exactly ``numel * itemsize`` bytes is kept without copying.
    """
    tensor = tensor.detach()
    exact = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == exact:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def prepare_tensors(sample_id: Any, tensors: Any) -> dict[str, torch.Tensor]:
    """Check a put's arguments and return the tensors the store may keep (see :func:`owned_contiguous`).

    Raises :class:`FeatureStoreError` naming the offending feature before anything is stored.
    """
    if not isinstance(sample_id, str) or not sample_id:
        raise FeatureStoreError(f"sample_id must be a non-empty string, got {sample_id!r}")
    if not isinstance(tensors, Mapping):
        raise FeatureStoreError(
            f"put({sample_id!r}): tensors must be a mapping of feature name to torch.Tensor, "
            f"got {type(tensors).__name__}"
        )
    if not tensors:
        raise FeatureStoreError(f"put({sample_id!r}) got no tensors; a sample needs at least one feature")
    for name, value in tensors.items():
        where = f"put({sample_id!r}): feature {name!r}"
        if not isinstance(name, str) or not name or name == _RESERVED_NAME:
            raise FeatureStoreError(f"{where}: feature names must be non-empty strings other than {_RESERVED_NAME!r}")
        if not isinstance(value, torch.Tensor):
            raise FeatureStoreError(
                f"{where} is a {type(value).__name__}, not a torch.Tensor; convert it with torch.as_tensor "
                "before putting (metadata belongs in meta=...)"
            )
        if value.layout != torch.strided or value.device.type == "meta":
            raise FeatureStoreError(f"{where} is a {value.layout} tensor on {value.device}; stores hold dense tensors "
                                    "with data (call .to_dense() or materialize it first)")
        try:
            dtype_name(value.dtype)
        except RecordError as exc:
            raise FeatureStoreError(f"{where}: {exc}") from None
    return {name: owned_contiguous(value) for name, value in tensors.items()}


def draft_ref(*, store: str, run_id: str, sample_id: str, tensors: Mapping[str, torch.Tensor],
              meta: Mapping[str, Any] | None) -> SampleRef:
    """The ref a put will return, with generation 0 until the store assigns one.

    Building it before storing anything means a bad ``meta`` (a tensor in it, a non-JSON
    value) fails the put with :class:`RecordError` while the store is still untouched.
    ``num_tokens`` comes from ``meta["num_tokens"]``, else the first dimension of
    ``input_ids``, else 0; ``strategy`` from ``meta["strategy"]``.
    """
    if meta is not None and not isinstance(meta, Mapping):
        raise FeatureStoreError(f"put({sample_id!r}): meta must be a mapping or None, got {type(meta).__name__}")
    meta = dict(meta or {})
    num_tokens = meta.get("num_tokens")
    if num_tokens is None:
        ids = tensors.get("input_ids")
        num_tokens = int(ids.shape[0]) if ids is not None and ids.dim() > 0 else 0
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise FeatureStoreError(f"put({sample_id!r}): meta['num_tokens'] must be a non-negative int, got {num_tokens!r}")
    features = {name: FeatureSpec(tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
    return SampleRef(sample_id=sample_id, run_id=run_id, store=store, features=features,
                     strategy=str(meta.get("strategy", "")), num_tokens=num_tokens, meta=meta)


def select_features(ref: SampleRef, keys: Sequence[str] | str | None) -> list[str]:
    """The feature names a get returns: all of the ref's, or ``keys`` after checking each exists."""
    if keys is None:
        return list(ref.features)
    if isinstance(keys, str):  # get(ref, "hidden_states") is a natural slip; it means one key
        keys = [keys]
    for key in keys:
        if key not in ref.features:
            raise UnknownFeatureError(
                f"sample {ref.sample_id!r} has no feature {key!r}; available: {sorted(ref.features)}"
            )
    return list(dict.fromkeys(keys))


def token_hash(token: str | None) -> str | None:
    """What a store records of its shared token: its sha256, never the token itself."""
    return None if token is None else hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_token(recorded: Any, token: str | None, *, store: str, place: str, fresh: str) -> None:
    """Raise unless ``token`` matches the ``recorded`` hash (None: the store was made without one).

    ``store`` names the store in the messages, ``place`` is what the user picked it by (a
    directory, a namespace) and ``fresh`` where to go instead.
    """
    want = token_hash(token)
    if recorded is None and want is not None:
        raise FeatureStoreError(f"{store} was created without a token, but a token was given; drop the token "
                                f"option or use {fresh}")
    if recorded is not None and want is None:
        raise FeatureStoreError(f"{store} is protected by a token and none was given; pass the token it was "
                                "created with (--set feature_store.token=...)")
    if recorded is not None and not hmac.compare_digest(str(recorded), want):
        raise FeatureStoreError(f"the token does not match the one {store} was created with; check that this job "
                                f"should use this {place} and pass that store's token")


def stale_error(ref: SampleRef, current: int) -> StaleRefError:
    return StaleRefError(
        f"ref to sample {ref.sample_id!r} is stale: it names generation {ref.generation}, but the sample was put "
        f"again as generation {current}; use the ref returned by the latest put (or published after it)"
    )


def _then_checked(samples: list[dict[str, torch.Tensor]], checks: list[TensorCheck], then: Callable[[list], T]) -> T:
    """``then(samples)`` with ``checks`` run by ``then``'s copies (those it did not copy after it). Raises the first
    failed check, and ``then``'s result is never returned; a ``then`` that fails on its own is told apart from one
    that read damaged bytes: a check that fails then is raised instead (from ``then``'s error)."""
    if not checks:
        return then(samples)
    copies = copies_checking(checks)
    try:
        with copies:
            result = then(samples)
    except Exception as exc:
        if copies.failed:  # a check raised in its copy: that is the error
            raise
        for check in copies.unchecked():
            try:
                check()
            except Exception as damaged:  # noqa: BLE001 - the damage the collate's error came from
                raise damaged from exc
        raise
    TensorChecks(copies.unchecked())()
    return result


class BaseFeatureStore:
    """The checks and bookkeeping of a feature store; subclasses say where bytes live.

    Thread-safe as long as the subclass hooks are: a producer thread may put while the
    training thread gets and releases. ``self._lock`` guards the counters and may be used
    by subclasses for their own state.

    Hooks a subclass implements:

    - ``_store(draft, tensors) -> SampleRef``: keep ``tensors`` under a new generation and
      return ``draft`` with that generation;
    - ``_load(ref, names) -> dict``: the named tensors of exactly ``ref.generation``; raise
      :meth:`_not_found` or :func:`stale_error` when it is gone;
    - ``_release(ref) -> bool``: free the sample if ``consume_once``; whether ``ref`` was current;
    - ``_drop(sample_id) -> bool``: delete every generation; whether anything was there;
    - ``_resident() -> (samples, bytes)``; ``_close()``.
    """

    uri: str

    def __init__(self, *, run_id: str, consume_once: bool) -> None:
        self.run_id = run_id
        self.consume_once = consume_once
        self._lock = threading.Lock()
        self._counts = {"puts": 0, "gets": 0, "releases": 0, "aborts": 0}
        self._gone: OrderedDict[str, str] = OrderedDict()  # sample_id -> "released" | "aborted"
        self._closed = False

    # -- the protocol ---------------------------------------------------------------------

    def put(self, sample_id: str, tensors: Mapping[str, torch.Tensor],
            meta: Mapping[str, Any] | None = None) -> SampleRef:
        """Store one sample's tensors (unpadded, as given) and return its ref.

        Putting a ``sample_id`` again stores a new generation and makes older refs stale.
        Bad input raises before anything is stored.
        """
        self._check_open("put")
        prepared = prepare_tensors(sample_id, tensors)
        draft = draft_ref(store=self.uri, run_id=self.run_id, sample_id=sample_id, tensors=prepared, meta=meta)
        ref = self._store(draft, prepared)
        with self._lock:
            self._counts["puts"] += 1
            self._gone.pop(sample_id, None)
        return ref

    def get(self, ref: SampleRef, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The sample's tensors (or only ``keys``), exactly as they were put.

        Callers must not modify the returned tensors: a store may hand out the tensors it keeps.
        """
        self._check_ref(ref, "get")
        tensors = self._load(ref, select_features(ref, keys))
        with self._lock:
            self._counts["gets"] += 1
        return tensors

    def get_batch(self, refs: Sequence[SampleRef], keys: Sequence[str] | None, then: Callable[[list], T]) -> T:
        """``then`` of the samples' tensors (each as :meth:`get` returns them), as one batch read.

        ``then`` (a collate) must only read the tensors. A store whose reads have a check of each tensor
        (:meth:`_load_deferred`; the disk store's checksums) runs each in ``then``, just before ``then`` copies
        that tensor with :func:`~specforge_core.checksums.copy_checked` (as ``pad_right`` does), so that the copy
        reads from the CPU cache; the checks of tensors ``then`` did not copy run after it, here. A sample that
        fails raises in ``then`` or after it, even if ``then`` caught the error, and ``then``'s result is never
        returned; a ``then`` that fails on its own while a sample is damaged gets the check's error, raised from
        its own. Any other error raises as :meth:`get`'s.
        The samples are dropped here as ``get_batch`` returns (a disk store's maps unmapped); tensors ``then``
        kept stay valid. Unmapping them on the checks' thread instead slowed a stream of batches: each unmap
        there stalled this thread's next maps and page faults (1 MiB samples in batches of 8 read 1.34x as fast
        with the unmapping here; docs/benchmarks.md).
        """
        samples: list[dict[str, torch.Tensor]] = []
        checks: list[TensorCheck] = []
        for ref in refs:
            self._check_ref(ref, "get")
            loaded, check = self._load_deferred(ref, select_features(ref, keys))
            samples.append(loaded)
            checks += check or ()
        with self._lock:
            self._counts["gets"] += len(samples)
        return _then_checked(samples, checks, then)

    def release(self, ref: SampleRef) -> None:
        """Say the sample was consumed: a consume-once store frees it, a retaining store keeps it.

        Idempotent: releasing a sample that is already gone, or a stale ref (which must not
        free the newer generation), does nothing and is not counted.
        """
        self._check_ref(ref, "release")
        if self._release(ref):
            self._count_and_forget("releases", ref.sample_id, "released" if self.consume_once else None)

    def abort(self, sample_id: str) -> None:
        """Drop every generation of ``sample_id`` (a failed or retried capture). Idempotent."""
        self._check_open("abort")
        if not isinstance(sample_id, str) or not sample_id:
            raise FeatureStoreError(f"abort needs a sample_id string, got {sample_id!r}")
        if self._drop(sample_id):
            self._count_and_forget("aborts", sample_id, "aborted")

    def stats(self) -> dict[str, int]:
        """``samples`` and ``bytes_resident`` now held, and counts of successful puts, gets,
        releases and aborts made through this instance."""
        samples, nbytes = self._resident()
        with self._lock:
            return {"samples": samples, "bytes_resident": nbytes, **self._counts}

    def close(self) -> None:
        """Stop serving; later calls raise :class:`FeatureStoreError`. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> BaseFeatureStore:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r}, consume_once={self.consume_once})"

    # -- helpers for subclasses -----------------------------------------------------------

    def _not_found(self, ref: SampleRef, detail: str = "") -> SampleNotFoundError:
        """The error for a sample this store does not hold, saying why when it knows."""
        with self._lock:
            reason = self._gone.get(ref.sample_id)
        if reason == "released":
            why = ("it was released, and this store is consume-once (each sample is freed by its release); "
                   "use consume_once=False to read samples more than once")
        elif reason == "aborted":
            why = "it was aborted; use the ref of a put made after the abort"
        else:
            why = ("it was released, aborted or never stored; check that the ref comes from a put into this "
                   "store and that no other consumer released it")
        return SampleNotFoundError(
            f"sample {ref.sample_id!r} (generation {ref.generation}) is not in {self.uri}{detail}: {why}"
        )

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise FeatureStoreError(f"{op} on {self.uri}, which is closed; build a new store to use it again")

    def _check_ref(self, ref: SampleRef, op: str) -> None:
        self._check_open(op)
        if not isinstance(ref, SampleRef):
            raise FeatureStoreError(f"{op} needs a SampleRef, got {type(ref).__name__}")
        if ref.store != self.uri:
            raise FeatureStoreError(
                f"{op}: the ref to sample {ref.sample_id!r} belongs to store {ref.store}, not to this store "
                f"{self.uri}; read it through the store that put it (same feature_store settings on both sides)"
            )

    def _count_and_forget(self, counter: str, sample_id: str, reason: str | None) -> None:
        with self._lock:
            self._counts[counter] += 1
            if reason is not None:
                self._gone[sample_id] = reason
                self._gone.move_to_end(sample_id)
                while len(self._gone) > _REMEMBERED_GONE:
                    self._gone.popitem(last=False)

    # -- hooks ----------------------------------------------------------------------------

    def _store(self, draft: SampleRef, tensors: dict[str, torch.Tensor]) -> SampleRef:
        raise NotImplementedError

    def _load_deferred(self, ref: SampleRef, names: list[str]) -> tuple[dict[str, torch.Tensor], TensorChecks | None]:
        """The tensors of :meth:`_load`, and the checks of them that :meth:`get_batch` runs as the collate copies
        them (raising what :meth:`_load` would have), or None when the read checked everything."""
        return self._load(ref, names), None

    def _load(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _release(self, ref: SampleRef) -> bool:
        raise NotImplementedError

    def _drop(self, sample_id: str) -> bool:
        raise NotImplementedError

    def _resident(self) -> tuple[int, int]:
        raise NotImplementedError

    def _close(self) -> None:
        pass
