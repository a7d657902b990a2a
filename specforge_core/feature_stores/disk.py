"""The ``disk`` feature store: a directory of safetensors files, one per sample generation.

Layout of the directory ``ROOT``::

    ROOT/STORE.json                                    format, version, sha256 of the token
    ROOT/ab/cd/<slug>.<digest>.<generation>.safetensors
    ROOT/ab/cd/.<slug>.<digest>.<random>.tmp           a put in progress (or one that crashed)

``digest`` is the first 32 hex digits of the sample id's sha256 and ``ab/cd`` its first
four, so a directory holds a few hundred files even for hundreds of millions of samples.
``slug`` is the sample id with every character but ASCII letters, digits, ``-`` and ``_``
replaced by ``_``, cut to 40 characters: it keeps a listing readable while no sample id
can name a path outside ``ROOT``.

Each file's safetensors metadata holds the :class:`SampleRef` as it was put
(``specforge.ref``), its generation and sample id as one short string that a get compares
(``specforge.key``), and a checksum of each tensor's bytes: its kind in
``specforge.checksum`` (``xxh3-64``; files of earlier releases say ``crc32c``) and the
values in ``specforge.checksums``. Files written before crc32c have no
``specforge.checksum`` and zlib crc32s in ``specforge.crc32``. Every one of them is read and
verified as it is. A feature file is data, never code: nothing here
unpickles.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import attrs
import torch
from safetensors.torch import save_file

from ..contracts import SampleRef
from ..dtypes import SAFETENSORS_DTYPES, torch_dtype
from ..checksums import CHECKSUM_KINDS, CRC32, DEFAULT_CHECKSUM, ChecksumKind, checksum, checksum_bytes
from ..fileio import fsync_dir
from ..safetensors_header import HeaderError, check_entries
from ..errors import CorruptFeatureError, FeatureStoreError, RecordError
from .base import BaseFeatureStore, check_token, stale_error, token_hash

if TYPE_CHECKING:
    from ..builtin import DiskStoreOptions
    from ..protocols import BuildContext

_MANIFEST = "STORE.json"
_FORMAT = "specforge-disk-store"
_VERSION = 1
_REF_KEY = "specforge.ref"
_CHECKSUM_KEY = "specforge.checksum"  # the kind of checksums the file records ("xxh3-64", "crc32c")
_CHECKSUMS_KEY = "specforge.checksums"  # {"name": checksum of the tensor's bytes}
_LEGACY_CRC_KEY = "specforge.crc32"  # files written before crc32c: {"name": zlib crc32}
_KEY_KEY = "specforge.key"  # "<generation>:<ascii() of the sample id>", the identity a get checks
_unsafe_sub = re.compile(r"[^A-Za-z0-9_-]").sub
_sha256 = hashlib.sha256
_SEP = os.sep
_SHARD = re.compile(r"^[0-9a-f]{2}$")
_SAMPLE_FILE = re.compile(r"^([A-Za-z0-9_-]*\.[0-9a-f]{32})\.([0-9]+)\.safetensors$")


class DiskFeatureStore(BaseFeatureStore):
    """Feature tensors in a directory, one safetensors file per sample generation.

    Several processes may share the directory (a producer puts, a consumer on the same
    filesystem gets and releases); everything they agree on lives in the files, so no
    process holds state the others need.

    - Puts are atomic: the file is written under a temporary name in the same directory,
      fsynced (``fsync=True``), and published under its final name with a hard link, which
      fails instead of overwriting if another process took the same generation; the
      directory is fsynced before the put returns, and older generations are deleted after
      the new one is in place.
    - Generations are ``max(newest file + 1, microseconds since the epoch)``: derived from
      the files, so they increase across processes, and never reused after every file of a
      sample was deleted, so a ref from before a release or abort cannot read a later put.
    - Reads memory-map the file privately (copy-on-write): a get parses and checks the
      header, then hands out tensors over the map without copying; their bytes come from
      the page cache when first touched (typically by the collate's copy), writing to them
      never changes the file, and they stay valid after a release deletes the file. Files
      are never modified in place; truncating one while its tensors are in use would crash
      the reader (SIGBUS), as with any memory map. ``scan`` reads headers only.
    - A file whose header or size is wrong (the header must cover the file's tensor bytes
      exactly, as safetensors requires), whose tensors differ from the ref's shapes and
      dtypes, or whose bytes fail their checksum raises :class:`CorruptFeatureError`
      naming the file; a short or wrong tensor is never returned. The checksum pass
      (``verify_checksums``, off by default; the size and shape checks always run) reads
      every byte once more: xxh3-64 on the CPU's vector units makes that pass cheaper than
      the copy that follows it. ``get`` runs it before returning; ``get_batch`` (what
      the feature loader calls) runs it on another thread while the collate copies the
      same pages, and raises after the collate if a sample fails (see
      ``bench/feature_stores.py``).
    - ``release`` deletes the file when ``consume_once``; deletions are not fsynced, since a
      file that a crash brings back costs disk space, never correctness (acks decide what
      was trained).
    - ``stats()`` walks the directory (one ``stat`` per file), so call it at log intervals,
      not per sample; its ``puts``/``gets``/``releases``/``aborts`` count this instance only.
    """

    def __init__(self, options: DiskStoreOptions, context: BuildContext) -> None:
        root = options.path
        if root is None:
            if context.output_dir is None:
                raise FeatureStoreError(
                    "the disk feature store needs a directory: set its path option "
                    "(--set feature_store.path=DIR) or give the run an output directory"
                )
            root = os.path.join(context.output_dir, "features")
        super().__init__(run_id=context.run_id, consume_once=options.consume_once)
        self.root = os.path.abspath(root)
        self.uri = "disk://" + self.root
        self.fsync = options.fsync
        self.verify_checksums = options.verify_checksums  # checksum of each tensor on every get
        _attach(self.root, options.token, fsync=self.fsync)

    # -- listing --------------------------------------------------------------------------

    def scan(self) -> list[SampleRef]:
        """A ref to the newest generation of every sample the directory holds, by sample id.

        For offline manifests and resume. Reads file headers only; temporary files of puts
        in progress (or of crashed ones) are skipped. An unreadable header raises
        :class:`CorruptFeatureError` naming the file.
        """
        self._check_open("scan")
        newest: dict[str, tuple[int, str]] = {}
        for stem, generation, entry in self._walk():
            if generation > newest.get(stem, (-1, ""))[0]:
                newest[stem] = (generation, entry.path)
        refs = []
        for _generation, path in newest.values():
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # released, aborted or re-put while we listed
                continue
            try:
                stored = self._stored_ref(_Header.read(path, fd))
            finally:
                os.close(fd)
            refs.append(attrs.evolve(stored, store=self.uri))
        return sorted(refs, key=lambda ref: ref.sample_id)

    def path_of(self, ref: SampleRef) -> str:
        """The file that holds (or held) ``ref``'s generation of its sample."""
        return self._file(ref.sample_id, ref.generation)

    def _walk(self) -> Iterator[tuple[str, int, os.DirEntry]]:
        """(file-name stem, generation, entry) of every published sample file."""
        for level1 in _subdirs(self.root):
            for level2 in _subdirs(level1.path):
                with os.scandir(level2.path) as entries:
                    for entry in entries:
                        match = _SAMPLE_FILE.match(entry.name)
                        if match:
                            yield match.group(1), int(match.group(2)), entry

    def _locate(self, sample_id: str) -> tuple[str, str]:
        """(shard directory, file-name stem) of a sample."""
        digest = _sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()
        # The slug replaces characters one for one, so cutting first gives the same 40.
        return f"{self.root}{_SEP}{digest[:2]}{_SEP}{digest[2:4]}", f"{_unsafe_sub('_', sample_id[:40])}.{digest[:32]}"

    def _file(self, sample_id: str, generation: int) -> str:
        shard, stem = self._locate(sample_id)
        return f"{shard}{_SEP}{stem}.{generation}.safetensors"

    def _generations(self, sample_id: str) -> dict[int, str]:
        """Generation -> path of every published file of one sample, as the directory holds them now."""
        shard, stem = self._locate(sample_id)
        try:
            names = os.listdir(shard)
        except FileNotFoundError:
            return {}
        found = {}
        for name in names:
            match = _SAMPLE_FILE.match(name)
            if match and match.group(1) == stem:
                found[int(match.group(2))] = os.path.join(shard, name)
        return found

    # -- hooks ----------------------------------------------------------------------------

    def _store(self, draft: SampleRef, tensors: dict[str, torch.Tensor]) -> SampleRef:
        tensors = _unshared(tensors)
        crcs = json.dumps({name: checksum(tensor, DEFAULT_CHECKSUM) for name, tensor in tensors.items()})
        shard, stem = self._locate(draft.sample_id)
        tmp = os.path.join(shard, f".{stem}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            self._make_shard(shard)
            while True:
                generation = max(max(self._generations(draft.sample_id), default=-1) + 1, time.time_ns() // 1000)
                ref = attrs.evolve(draft, generation=generation)
                save_file(tensors, tmp, metadata={_REF_KEY: ref.to_json(), _CHECKSUM_KEY: DEFAULT_CHECKSUM.name,
                                                  _CHECKSUMS_KEY: crcs,
                                                  _KEY_KEY: f"{generation}:{draft.sample_id!a}"})
                if self.fsync:
                    fsync_dir(tmp)  # an fsync of the path; works for files too
                if _publish(tmp, self._file(draft.sample_id, generation)):
                    break
                # another writer published this generation first: write again under the next one
        except OSError as exc:
            raise FeatureStoreError(
                f"put({draft.sample_id!r}) could not write to {shard}: {exc}; nothing was stored "
                f"(check free space and permissions of {self.root})"
            ) from exc
        finally:
            _remove(tmp)
        for old, path in self._generations(draft.sample_id).items():
            if old < generation:
                _remove(path)
        if self.fsync:
            fsync_dir(shard)
        return ref

    def _load(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        tensors, check = self._load_deferred(ref, names)
        if check is not None:
            check()
        return tensors

    def _load_deferred(self, ref: SampleRef, names: list[str]) -> tuple[dict[str, torch.Tensor],
                                                                        Callable[[], None] | None]:
        # the checksum pass, if any, is left to the caller: get runs it at once, get_batch beside the collate
        header, mapped, tensors = self._map(ref, names)
        return tensors, (functools.partial(_verify, header, mapped, names) if self.verify_checksums else None)

    def _map(self, ref: SampleRef, names: list[str]) -> tuple[_Header, mmap.mmap, dict[str, torch.Tensor]]:
        """The file's header, its private map and ``names``' tensors over that map, every check but the
        checksums done."""
        # Kept to few Python steps and syscalls on purpose: with the CPU caches flushed by the
        # previous sample's copy, a get's cost is mostly its interpreter work
        # (bench/feature_stores.py).
        path = self._file(ref.sample_id, ref.generation)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            newer = [g for g in self._generations(ref.sample_id) if g > ref.generation]
            if newer:
                raise stale_error(ref, max(newer)) from None
            raise self._not_found(ref, f" (no file {path})") from None
        # Map first, then read the header out of the map: no fstat or pread syscalls. A private
        # (copy-on-write) map: nothing is read until touched, writes stay in this process, and
        # the tensors outlive the file.
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except ValueError:  # an empty file cannot be mapped
            raise _corrupt(path, "it is 0 bytes, shorter than a safetensors header") from None
        finally:
            os.close(fd)
        header = _Header.parse(path, mapped, len(mapped))
        # The file name encodes (sample id digest, generation); the file's own record of the
        # two must agree. One string compare; files written before that record existed have
        # their stored ref parsed instead.
        if header.metadata.get(_KEY_KEY) != f"{ref.generation}:{ref.sample_id!a}":
            _check_stored_ref(header, ref)
        entries, features, data_start = header.entries, ref.features, header.data_start
        tensors = {}
        for name in names:
            entry = entries.get(name)
            if entry is None:
                raise _corrupt(path, f"it has no tensor {name!r}, which the ref lists")
            dtype, shape, start, end = entry
            want = features[name]
            if shape != want.shape or dtype != want.dtype:
                raise _corrupt(path, f"feature {name!r} is {dtype}{list(shape)} but the ref says "
                                     f"{want.dtype}{list(want.shape)}")
            torch_type, itemsize = _TORCH_TYPES[dtype]
            if end == start:
                tensor = torch.empty(shape, dtype=torch_type)
            else:
                tensor = torch.frombuffer(mapped, dtype=torch_type, count=(end - start) // itemsize,
                                          offset=data_start + start)
                if len(shape) != 1:  # frombuffer gives 1-D already: one dispatch less for ids and masks
                    tensor = tensor.view(shape)
            tensors[name] = tensor
        return header, mapped, tensors

    def _release(self, ref: SampleRef) -> bool:
        path = self._file(ref.sample_id, ref.generation)
        if not self.consume_once:
            return os.path.exists(path)
        return _remove(path)

    def _drop(self, sample_id: str) -> bool:
        removed = [_remove(path) for path in self._generations(sample_id).values()]
        return any(removed)

    def _resident(self) -> tuple[int, int]:
        stems, nbytes = set(), 0
        for stem, _generation, entry in self._walk():
            try:
                nbytes += entry.stat().st_size
            except FileNotFoundError:  # released while we walked
                continue
            stems.add(stem)
        return len(stems), nbytes

    # -- reading one file -----------------------------------------------------------------

    def _stored_ref(self, header: _Header) -> SampleRef:
        """The ref recorded in a file, checked against the file's own name."""
        path = header.path
        try:
            stored = SampleRef.from_json(header.metadata[_REF_KEY])
        except (KeyError, ValueError, RecordError) as exc:
            raise _corrupt(path, f"its specforge metadata is missing or malformed ({exc!r})") from None
        if self._file(stored.sample_id, stored.generation) != path:
            raise _corrupt(path, f"its metadata (sample {stored.sample_id!r}, generation {stored.generation}) "
                                 "does not match its file name")
        return stored

    def _make_shard(self, shard: str) -> None:
        if os.path.isdir(shard):
            return
        os.makedirs(shard, exist_ok=True)
        if self.fsync:  # the new directories' own entries must survive a crash too
            fsync_dir(os.path.dirname(shard))
            fsync_dir(self.root)


# -- the directory's manifest ---------------------------------------------------------------


def _attach(root: str, token: str | None, *, fsync: bool) -> None:
    """Create ``root/STORE.json`` on first use, or check the one there against ``token``."""
    os.makedirs(root, exist_ok=True)
    manifest = os.path.join(root, _MANIFEST)
    if not os.path.exists(manifest):
        strays = sorted(name for name in os.listdir(root) if not name.startswith("."))
        if strays:
            raise FeatureStoreError(
                f"{root} is not empty ({', '.join(strays[:3])}{', ...' if len(strays) > 3 else ''}) and has no "
                f"{_MANIFEST}, so it is not a specforge disk store; point the store's path at a new or empty directory"
            )
        body = {"format": _FORMAT, "version": _VERSION, "token_sha256": token_hash(token)}
        tmp = os.path.join(root, f".{_MANIFEST}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(body, fh)
            if fsync:
                fsync_dir(tmp)  # an fsync of the path; works for files too
            _publish(tmp, manifest)  # False: another process created the store first; check theirs below
        finally:
            _remove(tmp)
        if fsync:
            fsync_dir(root)
    _check_manifest(root, manifest, token)


def _check_manifest(root: str, manifest: str, token: str | None) -> None:
    try:
        with open(manifest, encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError) as exc:
        raise FeatureStoreError(f"{manifest} cannot be read ({exc}); restore it or use a new directory") from None
    if not isinstance(info, dict) or info.get("format") != _FORMAT or \
            not isinstance(info.get("token_sha256"), (str, type(None))):
        raise FeatureStoreError(f"{manifest} is not a specforge disk store manifest; use a new or empty directory")
    if info.get("version") != _VERSION:
        raise FeatureStoreError(
            f"{manifest} has version {info.get('version')!r}, this specforge reads version {_VERSION}; "
            "use the specforge release that wrote the store, or capture the features again"
        )
    check_token(info.get("token_sha256"), token, store=f"disk store {root}",
                place="directory (feature_store.path)", fresh="a new directory")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors, one storage each.

    safetensors refuses to write two names over one storage (one tensor put under two
    feature names), because it could not tell them apart on load; a repeat gets a copy.
    """
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.cpu()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer and pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        out[name] = tensor
    return out


_HEADER_LIMIT = 100 * 2**20  # the largest header safetensors itself accepts


_HEAD_READ = 16 * 1024  # one pread covers the length prefix and a typical header


class _Header(NamedTuple):
    """A sample file's safetensors header, checked: ``read`` takes it from an open file
    with one or two ``pread`` (``scan``), ``parse`` from the file's memory map (``get``).

    Our own reader rather than ``safetensors.safe_open``: a get is dominated by fixed costs
    at small sample sizes and this one does less per file. The checks are safetensors'
    own: the header is JSON of ``{name: {dtype, shape, data_offsets}}`` plus
    ``__metadata__``, each tensor's byte range matches its dtype and shape, and the ranges
    tile the bytes after the header exactly, so a truncated or padded file is caught before
    any tensor is read.
    """

    path: str
    metadata: dict[str, str]
    entries: dict[str, tuple]  # name -> (dtype, shape, start, end), offsets relative to data_start
    data_start: int

    @classmethod
    def read(cls, path: str, fd: int) -> _Header:
        """The header of the open file ``fd`` (one or two ``pread``)."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEAD_READ, 0)
        if 8 <= len(head) < 8 + int.from_bytes(head[:8], "little") <= size:
            head += os.pread(fd, 8 + int.from_bytes(head[:8], "little") - len(head), len(head))
        return cls.parse(path, head, size)

    @classmethod
    def parse(cls, path: str, head: Any, size: int) -> _Header:
        """The header from the first bytes of a ``size``-byte file (``head`` may be the whole file)."""
        if size < 8 or len(head) < 8:
            raise _corrupt(path, f"it is {size} bytes, shorter than a safetensors header")
        length = int.from_bytes(head[:8], "little")
        if length > min(size - 8, _HEADER_LIMIT):
            raise _corrupt(path, f"its header claims {length} bytes but the file is {size}")
        if len(head) < 8 + length:
            raise _corrupt(path, f"it ended while reading its {length}-byte header")
        metadata, entries = _parse_header(path, head[8:8 + length], size - 8 - length)
        return cls(path, metadata, entries, 8 + length)


def _check_stored_ref(header: _Header, ref: SampleRef) -> None:
    """Raise unless the ref recorded in ``header`` names ``ref``'s sample and generation."""
    path = header.path
    try:
        stored = json.loads(header.metadata[_REF_KEY])
        stored_id, stored_generation = stored["sample_id"], stored["generation"]
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(path, f"its specforge metadata is missing or malformed ({exc!r})") from None
    if stored_generation != ref.generation:
        raise _corrupt(path, f"its metadata (sample {stored_id!r}, generation {stored_generation}) does not "
                             "match its file name")
    if stored_id != ref.sample_id:  # two ids with one digest: never seen, but never wrong data
        raise _corrupt(path, f"it holds sample {stored_id!r}, not {ref.sample_id!r}")


def _verify(header: _Header, data: Any, names: Iterable[str]) -> None:
    """Raise :class:`CorruptFeatureError` unless each of ``names``' bytes in ``data`` (the file's contents,
    its map) has the checksum its file records. Hashes the bytes where they lie, no tensor made."""
    kind, crcs = _recorded_crcs(header)
    view, entries, data_start = memoryview(data), header.entries, header.data_start
    for name in names:
        _dtype, _shape, start, end = entries[name]
        actual = checksum_bytes(view[data_start + start:data_start + end], kind)
        if actual != crcs.get(name):
            raise _corrupt(header.path, f"feature {name!r} fails its {kind.name} check (recorded {crcs.get(name)}, "
                                        f"read {actual}): its bytes changed after they were written")


def _recorded_crcs(header: _Header) -> tuple[ChecksumKind, dict[str, int]]:
    """The kind of checksum a file records and its value per tensor; files written before
    the kind was recorded hold zlib crc32s under their own key."""
    metadata = header.metadata
    name = metadata.get(_CHECKSUM_KEY)
    if name is None:
        kind, key = CRC32, _LEGACY_CRC_KEY
    elif name in CHECKSUM_KINDS:
        kind, key = CHECKSUM_KINDS[name], _CHECKSUMS_KEY
    else:
        raise _corrupt(header.path, f"it records checksums of kind {name!r}, which this specforge does not know "
                                    f"(known: {', '.join(sorted(CHECKSUM_KINDS))}); read it with the release that "
                                    "wrote it, or turn verify_checksums off")
    try:
        crcs = json.loads(metadata[key])
    except (KeyError, ValueError) as exc:
        raise _corrupt(header.path, f"its specforge metadata is missing or malformed ({exc!r})") from None
    if not isinstance(crcs, dict):
        raise _corrupt(header.path, f"its recorded {kind.name} checksums are not a map")
    return kind, crcs


#: record dtype name -> (torch dtype, bytes per element), for every dtype a header may name
_TORCH_TYPES = {name: (torch_dtype(name), size) for name, size in SAFETENSORS_DTYPES.values()}


def _parse_header(path: str, header: bytes, data_bytes: int) -> tuple[dict[str, str], dict[str, tuple]]:
    """``(metadata, {name: (dtype, shape, start, end)})`` from a safetensors header, checked."""
    try:
        raw = json.loads(header.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise _corrupt(path, f"its header is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise _corrupt(path, "its header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or set(map(type, metadata.values())) - {str}:
        raise _corrupt(path, "its __metadata__ is not a map of strings")
    try:
        entries = check_entries(raw, data_bytes)
    except HeaderError as exc:
        raise _corrupt(path, str(exc)) from None
    return metadata, entries


def _corrupt(path: str, what: str) -> CorruptFeatureError:
    return CorruptFeatureError(
        f"{path}: {what}. The file is damaged or was not written by this store; delete it and capture "
        "the sample again"
    )


def _publish(tmp: str, final: str) -> bool:
    """Give the complete file ``tmp`` the name ``final`` unless that name exists already.

    A hard link never overwrites, so two writers cannot both believe they published one
    name. Filesystems without hard links fall back to check-then-replace, which can only
    lose a race between two concurrent puts of one sample.
    """
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError:
        if os.path.exists(final):
            return False
        os.replace(tmp, final)
        return True
    os.unlink(tmp)
    return True


def _remove(path: str) -> bool:
    """Delete ``path``; whether it was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _subdirs(path: str) -> list[os.DirEntry]:
    """The two-hex-digit shard directories under ``path`` (none if ``path`` vanished)."""
    try:
        with os.scandir(path) as entries:
            return [entry for entry in entries if _SHARD.match(entry.name) and entry.is_dir()]
    except FileNotFoundError:
        return []
