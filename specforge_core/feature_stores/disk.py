"""The ``disk`` feature store: a directory of safetensors files, one per sample generation.

Layout of the directory ``ROOT``::

    ROOT/STORE.json                                    format, version, sha256 of the token
    ROOT/ab/cd/<slug>.<digest>.<generation>.safetensors
    ROOT/ab/cd/.<slug>.<digest>.<random>.tmp           a put in progress (or one that crashed)
    ROOT/packs/pack-<id>.data                          packed samples: their files, back to back
    ROOT/packs/pack-<id>.json                          a pack's index, written last (its commit)

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

A finished store (an offline feature set) can be packed (:meth:`DiskFeatureStore.pack`): its
sample files are copied, checksums verified, back to back into pack files of about 1 GiB,
each file's bytes unchanged and starting on a 64-byte boundary, and then deleted. A reader maps
each pack once, for as long as the store is open, so reading a packed sample is a copy out
of pages already mapped: no open, map, header parse (a pack's headers are parsed once),
page faults after the first epoch or unmap per sample, which at 1 MiB cost more than the
copy itself (``bench/feature_stores.py``). Packed samples are read-only: putting or
aborting one raises, releasing one keeps it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import attrs
import torch
from safetensors.torch import save_file

from ..contracts import SampleRef
from ..dtypes import SAFETENSORS_DTYPES, torch_dtype
from ..checksums import CHECKSUM_KINDS, CRC32, DEFAULT_CHECKSUM, ChecksumKind, TensorCheck, TensorChecks, checksum, \
    checksum_bytes
from ..fileio import atomic_write_text, fsync_dir
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
_PACKS = "packs"
_PACK_INDEX = re.compile(r"^pack-([0-9a-f]{12})\.json$")
_PACK_FORMAT = "specforge-disk-pack"
_PACK_VERSION = 1
_PACK_ALIGN = 64  # each packed file starts on a cache line: its tensors keep the alignment they had in the file
#: default largest pack (a sample larger than this gets a pack of its own)
PACK_BYTES = 1 << 30


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
      the feature loader calls) checks each tensor just before the collate copies it
      (:func:`~specforge_core.checksums.copy_checked`, which ``pad_right`` copies with), so
      the copy reads the bytes from the CPU cache, and the tensors the collate did not copy
      after it; it
      raises, and the collate's batch is never returned, if a sample fails (see
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
        self._packs = _Packs(os.path.join(self.root, _PACKS))

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
        by_id = {ref.sample_id: ref for ref in refs}
        self._packs.refresh()
        for sample_id, packed in self._packs.samples.items():
            if sample_id not in by_id or by_id[sample_id].generation <= packed.generation:
                by_id[sample_id] = attrs.evolve(packed.ref, store=self.uri)
        return sorted(by_id.values(), key=lambda ref: ref.sample_id)

    def path_of(self, ref: SampleRef) -> str:
        """The file that holds (or held) ``ref``'s generation of its sample: its pack, if it is packed."""
        packed = self._packs.find(ref)
        return packed.pack.path if packed is not None else self._file(ref.sample_id, ref.generation)

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
        self._refuse_packed(draft.sample_id, "put")
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

    def _load_deferred(self, ref: SampleRef, names: list[str]) -> tuple[dict[str, torch.Tensor], TensorChecks | None]:
        # the checksum pass, if any, is left to the caller: get runs it at once, get_batch in the collate's copies
        header, mapped, tensors = self._map(ref, names)
        if not self.verify_checksums:
            return tensors, None
        return tensors, _tensor_checks(header, mapped, tensors, *_recorded_crcs(header))

    def _map(self, ref: SampleRef, names: list[str]) -> tuple[_Header, mmap.mmap, dict[str, torch.Tensor]]:
        """The file's header, its private map and ``names``' tensors over that map, every check but the
        checksums done."""
        # Kept to few Python steps and syscalls on purpose: with the CPU caches flushed by the
        # previous sample's copy, a get's cost is mostly its interpreter work
        # (bench/feature_stores.py).
        packed = self._packs.find(ref)
        if packed is not None:  # the pack's map, kept; the header parsed and checked once
            header, mapped = packed.header(), packed.pack.mapped()
        else:
            header, mapped = self._map_file(ref)
            if header is None:  # the file went into a pack after this store looked at the packs
                self._packs.refresh()
                packed = self._packs.find(ref)
                if packed is None:
                    raise self._gone_error(ref)
                header, mapped = packed.header(), packed.pack.mapped()
        # The file name (or the pack's index) gives (sample id, generation); the file's own record
        # of the two must agree. One string compare; files written before that record existed have
        # their stored ref parsed instead.
        if header.metadata.get(_KEY_KEY) != f"{ref.generation}:{ref.sample_id!a}":
            _check_stored_ref(header, ref)
        entries, features, data_start = header.entries, ref.features, header.data_start + header.offset
        tensors = {}
        for name in names:
            entry = entries.get(name)
            if entry is None:
                raise _corrupt(header.path, f"it has no tensor {name!r}, which the ref lists")
            dtype, shape, start, end = entry
            want = features[name]
            if shape != want.shape or dtype != want.dtype:
                raise _corrupt(header.path, f"feature {name!r} is {dtype}{list(shape)} but the ref says "
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

    def _map_file(self, ref: SampleRef) -> tuple[_Header | None, mmap.mmap | None]:
        """The header and private map of ``ref``'s own file; ``(None, None)`` if there is no such file and no
        newer generation (it may have been packed)."""
        path = self._file(ref.sample_id, ref.generation)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            newer = [g for g in self._generations(ref.sample_id) if g > ref.generation]
            if newer:
                raise stale_error(ref, max(newer)) from None
            return None, None
        # Map first, then read the header out of the map: no fstat or pread syscalls. A private
        # (copy-on-write) map: nothing is read until touched, writes stay in this process, and
        # the tensors outlive the file.
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except ValueError:  # an empty file cannot be mapped
            raise _corrupt(path, "it is 0 bytes, shorter than a safetensors header") from None
        finally:
            os.close(fd)
        return _Header.parse(path, mapped, len(mapped)), mapped

    def _gone_error(self, ref: SampleRef) -> Exception:
        packed = self._packs.samples.get(ref.sample_id)
        if packed is not None and packed.generation > ref.generation:
            return stale_error(ref, packed.generation)
        return self._not_found(ref, f" (no file {self._file(ref.sample_id, ref.generation)})")

    def _release(self, ref: SampleRef) -> bool:
        path = self._file(ref.sample_id, ref.generation)
        if self._packs.find(ref) is not None:  # packs are read-only: a packed sample stays (a leftover file goes)
            if self.consume_once:
                _remove(path)
            return True
        if not self.consume_once:
            return os.path.exists(path)
        return _remove(path)

    def _refuse_packed(self, sample_id: str, op: str) -> None:
        packed = self._packs.samples.get(sample_id)
        if packed is not None:
            raise FeatureStoreError(
                f"{op}({sample_id!r}): the sample is packed in {packed.pack.path}, and packs are read-only; "
                f"nothing was changed (capture such samples into a new features directory)")

    def _drop(self, sample_id: str) -> bool:
        self._refuse_packed(sample_id, "abort")
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
        self._packs.refresh()
        stems.update(self._locate(sample_id)[1] for sample_id in self._packs.samples)
        return len(stems), nbytes + sum(pack.size for pack in self._packs.packs)

    # -- packs ----------------------------------------------------------------------------

    def pack(self, *, max_bytes: int = PACK_BYTES,
             progress: Callable[[int, int], Any] | None = None) -> dict[str, int]:
        """Move every sample file into packs of at most ``max_bytes`` (see the module docstring).

        For a finished store that nothing writes to meanwhile (run one pack at a time). Each file
        is read, its header checked and its checksums verified before it is copied: a damaged file
        raises :class:`CorruptFeatureError` naming it, and the packs committed before it stay. A pack
        is committed by its index, written after its data is synced; only then are its files
        deleted. A crash leaves either the files or the pack (or both, which read the same), never
        neither. ``progress(nbytes, total)`` is called as each file is copied (``total``: the bytes of all
        the files to pack). Returns the counts:
        ``packs``, ``samples`` and ``bytes`` (the files' bytes) packed now.
        """
        self._check_open("pack")
        packs_dir = self._packs.dir
        os.makedirs(packs_dir, exist_ok=True)
        names = set(os.listdir(packs_dir))
        for name in names:  # what a pack left that crashed before its index was written
            if name.startswith(".pack-") or (name.endswith(".data") and name[:-len(".data")] + ".json" not in names):
                _remove(os.path.join(packs_dir, name))
        self._packs.refresh()
        files = []  # (sample id, generation, path, size) of every file to pack
        newest: dict[str, tuple[int, os.DirEntry]] = {}
        for stem, generation, entry in self._walk():
            if generation > newest.get(stem, (-1, None))[0]:
                newest[stem] = (generation, entry)
        for generation, entry in newest.values():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                stored = self._stored_ref(_Header.read(entry.path, fd))
            finally:
                os.close(fd)
            packed = self._packs.samples.get(stored.sample_id)
            if packed is not None and packed.generation >= generation:  # left by a pack that crashed before
                _remove(entry.path)  # deleting it (or older than a packed generation)
                continue
            files.append((stored.sample_id, generation, entry.path, size))
        files.sort()
        counts = {"packs": 0, "samples": len(files), "bytes": sum(item[3] for item in files)}
        report = None if progress is None else functools.partial(progress, total=counts["bytes"])
        group: list[tuple[str, int, str, int]] = []
        total = 0
        for item in files:
            if group and total + item[3] > max_bytes:
                self._write_pack(group, report)
                counts["packs"] += 1
                group, total = [], 0
            group.append(item)
            total += -(-item[3] // _PACK_ALIGN) * _PACK_ALIGN
        if group:
            self._write_pack(group, report)
            counts["packs"] += 1
        return counts

    def _write_pack(self, files: list[tuple[str, int, str, int]], progress: Callable[[int], Any] | None) -> None:
        """One pack of ``files`` (sample id, generation, path, size): data, then index, then the files deleted."""
        packs_dir = self._packs.dir
        name = f"pack-{uuid.uuid4().hex[:12]}"
        tmp = os.path.join(packs_dir, f".{name}.data.tmp")
        samples, offset = [], 0
        try:
            with open(tmp, "wb") as out:
                for sample_id, generation, path, size in files:
                    with open(path, "rb") as fh:
                        data = fh.read()
                    if len(data) != size:
                        raise _corrupt(path, f"it changed size while being packed ({size} then {len(data)} bytes)")
                    header = _Header.parse(path, data, size)
                    _verify(header, data, header.entries)
                    stored = self._stored_ref(header)
                    out.write(data)
                    padding = -size % _PACK_ALIGN
                    out.write(b"\0" * padding)
                    samples.append([sample_id, generation, offset, size, stored.to_json()])
                    offset += size + padding
                    if progress is not None:
                        progress(size)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, os.path.join(packs_dir, f"{name}.data"))
            index = {"format": _PACK_FORMAT, "version": _PACK_VERSION, "data": f"{name}.data", "bytes": offset,
                     "samples": samples}
            atomic_write_text(os.path.join(packs_dir, f"{name}.json"), json.dumps(index), fsync=True)
            fsync_dir(packs_dir)
        finally:
            _remove(tmp)
        self._packs.refresh()
        for _sample_id, _generation, path, _size in files:
            _remove(path)
        for directory in sorted({os.path.dirname(path) for *_rest, path, _size in files}):
            for empty in (directory, os.path.dirname(directory)):  # ab/cd, then ab, once nothing is left in them
                try:
                    os.rmdir(empty)
                except OSError:
                    break

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


# -- packs ----------------------------------------------------------------------------------


class _Pack:
    """One committed pack's data file, mapped on first use and kept mapped while the store is open.

    The map is private (copy-on-write), as a sample file's: the tensors handed out are views of it,
    and a caller writing into one changes only this process's copy of the page.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def mapped(self) -> mmap.mmap:
        if self._map is None:
            with self._lock:
                if self._map is None:
                    try:
                        fd = os.open(self.path, os.O_RDONLY)
                    except FileNotFoundError:
                        index = os.path.basename(self.path)[:-len(".data")] + ".json"
                        raise FeatureStoreError(
                            f"{self.path} is gone but its index {index} is still there: delete the index too and run "
                            "the same `specforge capture` again, which captures the pack's samples again") from None
                    try:
                        if os.fstat(fd).st_size != self.size:
                            raise _corrupt(self.path, f"it is {os.fstat(fd).st_size} bytes, but its index says "
                                                      f"{self.size}")
                        self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                    finally:
                        os.close(fd)
        return self._map


class _Packed(NamedTuple):
    """Where one packed sample lies: its generation, pack, offset and size, and its stored ref."""

    generation: int
    pack: _Pack
    offset: int
    size: int
    ref: SampleRef
    headers: dict  # the pack's parsed headers, by sample id (shared by the pack's samples)

    def header(self) -> _Header:
        """The sample's header, parsed from the pack and checked on first use, then kept."""
        header = self.headers.get(self.ref.sample_id)
        if header is None:
            mapped, label = self.pack.mapped(), f"{self.pack.path} (sample {self.ref.sample_id!r})"
            length = int.from_bytes(mapped[self.offset:self.offset + 8], "little") if self.size >= 8 else 0
            head = mapped[self.offset:self.offset + 8 + min(length, max(self.size - 8, 0))]
            header = _Header.parse(label, head, self.size)._replace(offset=self.offset, pack=self.pack.path)
            self.headers[self.ref.sample_id] = header
        return header


class _Packs:
    """The committed packs of a store's ``packs`` directory, by sample id; :meth:`refresh` reads new indexes."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.packs: list[_Pack] = []
        self.samples: dict[str, _Packed] = {}
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.refresh()

    def find(self, ref: SampleRef) -> _Packed | None:
        packed = self.samples.get(ref.sample_id)
        return packed if packed is not None and packed.generation == ref.generation else None

    def refresh(self) -> None:
        try:
            names = sorted(name for name in os.listdir(self.dir) if _PACK_INDEX.match(name))
        except FileNotFoundError:
            return
        with self._lock:
            for name in names:
                if name not in self._seen:
                    self._load(os.path.join(self.dir, name))
                    self._seen.add(name)

    def _load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as fh:
                index = json.load(fh)
            if index.get("format") != _PACK_FORMAT or index.get("version") != _PACK_VERSION:
                raise ValueError(f"format {index.get('format')!r} version {index.get('version')!r}, not "
                                 f"{_PACK_FORMAT!r} version {_PACK_VERSION}")
            pack = _Pack(os.path.join(self.dir, os.path.basename(index["data"])), int(index["bytes"]))
            headers: dict[str, _Header] = {}
            entries = [_Packed(int(generation), pack, int(offset), int(size), SampleRef.from_json(ref), headers)
                       for _sample_id, generation, offset, size, ref in index["samples"]]
        except (OSError, ValueError, TypeError, KeyError, RecordError) as exc:
            raise CorruptFeatureError(f"{path}: the pack index cannot be read ({exc}); restore it, or delete it "
                                      "with its .data file and capture those samples again") from None
        for packed in entries:
            if packed.offset % _PACK_ALIGN or packed.offset + packed.size > pack.size:
                raise CorruptFeatureError(f"{path}: sample {packed.ref.sample_id!r} lies outside its pack")
            current = self.samples.get(packed.ref.sample_id)
            if current is None or current.generation < packed.generation:
                self.samples[packed.ref.sample_id] = packed
        self.packs.append(pack)


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
    offset: int = 0  # where the file starts in what is read: a packed file's place in its pack
    pack: str | None = None  # the pack's path, for a packed file

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
                             f"match {'the pack index' if header.pack else 'its file name'}")
    if stored_id != ref.sample_id:  # two ids with one digest: never seen, but never wrong data
        raise _corrupt(path, f"it holds sample {stored_id!r}, not {ref.sample_id!r}")


def _verify(header: _Header, data: Any, names: Iterable[str]) -> None:
    """Raise :class:`CorruptFeatureError` unless each of ``names``' bytes in ``data`` (the file's contents,
    its map) has the checksum its file records. Hashes the bytes where they lie, no tensor made."""
    kind, crcs = _recorded_crcs(header)
    view, entries, data_start = memoryview(data), header.entries, header.offset + header.data_start
    for name in names:
        _dtype, _shape, start, end = entries[name]
        actual = checksum_bytes(view[data_start + start:data_start + end], kind)
        if actual != crcs.get(name):
            raise _failure(header, name, kind, crcs, actual)


def _tensor_checks(header: _Header, data: Any, tensors: dict[str, torch.Tensor], kind: ChecksumKind,
                   crcs: dict[str, int]) -> TensorChecks:
    """:func:`_verify` of ``tensors`` (over ``data``, the file's or pack's map; ``kind`` and ``crcs`` its recorded
    checksums) as one check per tensor; one that fails is told apart as :func:`_diagnosis` does (the collate it
    runs in may have written into the tensor)."""
    view, data_start = memoryview(data), header.offset + header.data_start
    checks = TensorChecks()
    for name, tensor in tensors.items():
        _dtype, _shape, start, end = header.entries[name]
        checks.append(TensorCheck(tensor, view[data_start + start:data_start + end], kind, crcs.get(name),
                                  functools.partial(_failure_in_map, header, name)))
    return checks


def _failure(header: _Header, name: str, kind: ChecksumKind, crcs: dict, actual: int) -> CorruptFeatureError:
    return _corrupt(header.path, f"feature {name!r} fails its {kind.name} check (recorded {crcs.get(name)}, "
                                 f"read {actual}): its bytes changed after they were written")


def _failure_in_map(header: _Header, name: str, actual: int) -> Exception:
    try:
        return _diagnosis(header, [name])
    except OSError:  # the file is gone (released by another process): what the map holds is all there is
        kind, crcs = _recorded_crcs(header)
        return _failure(header, name, kind, crcs, actual)


def _diagnosis(header: _Header, names: list[str]) -> Exception:
    """The error of a sample whose bytes in this process's map of its file or pack fail their check: the file's
    or pack's if they fail there too, else a caller's write into tensors a get returned or a collate was given."""
    fd = os.open(header.pack or header.path, os.O_RDONLY)
    try:
        end = max(header.entries[name][3] for name in names)
        on_disk = os.pread(fd, header.data_start + end, header.offset)
    finally:
        os.close(fd)
    try:
        _verify(header._replace(offset=0), on_disk, names)
    except CorruptFeatureError as damaged:  # the file or pack itself is damaged
        return damaged
    return FeatureStoreError(
        f"{header.path}: the sample's bytes in this process's map of the {'pack' if header.pack else 'file'} "
        "differ from the file, which is intact: a caller wrote into tensors a get returned or a collate was given "
        "(they must only be read)")


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


_PACKED_LABEL = re.compile(r"^(.*)[/\\](pack-[0-9a-f]{12})\.data( \(sample .*\))?$", re.DOTALL)


def _corrupt(path: str, what: str) -> CorruptFeatureError:
    packed = _PACKED_LABEL.match(path)  # a pack, or one of its samples: "DIR/pack-<id>.data (sample 'x')"
    if packed:
        return CorruptFeatureError(
            f"{path}: {what}. The pack is damaged: delete {packed.group(2)}.data and {packed.group(2)}.json from "
            f"{packed.group(1)} and run the same `specforge capture` again, which captures its samples again")
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
