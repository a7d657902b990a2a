"""Offline feature sets: a disk store of captured samples plus a manifest.

``specforge capture`` writes one; ``specforge run --features DIR`` trains from it for many
epochs without the target model. Layout of ``DIR``::

    DIR/manifest.json               what was captured: strategy, capture plan, target info,
                                    the frozen parts' fingerprint, sample counts and ids per
                                    split (a run checks the store against them)
    DIR/frozen_parts.safetensors    the target's embedding / lm_head / norm weights the draft
                                    reuses (so training needs no target model)
    DIR/token_counts.safetensors    how often each token id is supervised in the train split
    DIR/store/                      the ``disk`` feature store (one safetensors file per sample,
                                    moved into DIR/store/packs/ at the end of a capture)

Every sample's ref carries ``meta["split"]`` (``train`` or ``eval``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs

from .contracts import FeatureSpec, SampleRef
from .errors import SpecforgeError
from .fileio import atomic_write, atomic_write_text
from .protocols import BuildContext, CapturePlan, DataStats, TargetInfo

MANIFEST = "manifest.json"
FROZEN = "frozen_parts.safetensors"
TOKEN_COUNTS = "token_counts.safetensors"
STORE_DIR = "store"
FORMAT = "specforge-features"
VERSION = 1


class FeatureSetError(SpecforgeError):
    """A features directory is missing, incomplete, or does not fit the strategy."""


def frozen_fingerprint(parts: Mapping[str, Any]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the frozen target tensors."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(parts):
        tensor = parts[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def plan_to_dict(plan: CapturePlan) -> dict[str, Any]:
    return {"layer_ids": list(plan.layer_ids), "hidden_feature": plan.hidden_feature, "last_hidden": plan.last_hidden,
            "features": {k: (v.to_dict() if isinstance(v, FeatureSpec) else v) for k, v in plan.features.items()}}


def plan_from_dict(data: Mapping[str, Any]) -> CapturePlan:
    return CapturePlan(layer_ids=tuple(data["layer_ids"]), hidden_feature=data["hidden_feature"],
                       last_hidden=data["last_hidden"],
                       features={k: FeatureSpec.from_dict(v) for k, v in data["features"].items()})


def _store_options(path: Path, consume_once: bool = False, verify_checksums: bool = False) -> Any:
    from .builtin import DiskStoreOptions

    return DiskStoreOptions(path=str(path), consume_once=consume_once, verify_checksums=verify_checksums)


@attrs.define
class FeatureSet:
    """An opened features directory."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> FeatureSet:
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.exists():
            raise FeatureSetError(f"{path} is not a features directory (no {MANIFEST}); "
                                  "create one with `specforge capture`")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise FeatureSetError(f"{manifest_path} is not valid JSON: {exc}") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise FeatureSetError(f"{manifest_path} is not a {FORMAT} v{VERSION} manifest")
        if not (path / FROZEN).exists():
            raise FeatureSetError(f"{path} has no {FROZEN}: the capture did not finish")
        return cls(path=path, manifest=manifest)

    @property
    def target(self) -> TargetInfo:
        return TargetInfo(**self.manifest["target"])

    @property
    def plan(self) -> CapturePlan:
        return plan_from_dict(self.manifest["capture_plan"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["frozen_fingerprint"]

    def frozen_parts(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(self.path / FROZEN))

    def stats(self) -> DataStats:
        from safetensors.torch import load_file

        path = self.path / TOKEN_COUNTS
        counts = load_file(str(path))["token_counts"] if path.exists() else None
        return DataStats(token_counts=counts, num_samples=int(self.manifest.get("samples", {}).get("train", 0)))

    def open_store(self, context: BuildContext, *, consume_once: bool = False, verify_checksums: bool = False) -> Any:
        """The directory's disk store (``consume_once``: a release deletes the sample's file; ``verify_checksums``:
        every get checks each tensor's checksum)."""
        from .feature_stores.disk import DiskFeatureStore

        return DiskFeatureStore(_store_options(self.path / STORE_DIR, consume_once, verify_checksums), context)

    def check_complete(self) -> None:
        """Refuse a capture that did not finish."""
        if not self.manifest.get("complete"):
            raise FeatureSetError(f"the capture into {self.path} did not finish (its manifest is not complete): run "
                                  "the same `specforge capture` command again to complete it")

    def refs_by_split(self, store: Any) -> dict[str, list[SampleRef]]:
        """Refs per split (one directory scan), each in a stable order (sorted by sample id)."""
        splits: dict[str, list[SampleRef]] = {"train": [], "eval": []}
        for ref in sorted(store.scan(), key=lambda r: r.sample_id):
            splits.setdefault(ref.meta.get("split", "train"), []).append(ref)
        return splits

    def listed_refs(self, store: Any, *, missing: str = "fail") -> tuple[dict[str, list[SampleRef]], str | None]:
        """Refs per split of the samples the manifest lists, checked against ``store``; (refs, report).

        Refuses a capture that did not finish. A listed sample the store lacks (its file was
        deleted or moved) fails the open with ``missing="fail"``; with ``"skip"`` it is left
        out and the report (else None) names it. Files the manifest does not list are left out.
        """
        self.check_complete()
        splits = self.refs_by_split(store)
        listed = self.manifest.get("sample_ids")
        lacking: dict[str, list[str]] = {}
        if listed is not None:
            for split, ids in listed.items():
                held = {ref.sample_id for ref in splits.get(split, [])}
                lacking[split] = [sid for sid in ids if sid not in held]
                wanted = set(ids)
                splits[split] = [ref for ref in splits.get(split, []) if ref.sample_id in wanted]
        else:  # a manifest written before sample ids were listed: its counts still tell
            for split, count in self.manifest.get("samples", {}).items():
                lacking[split] = ["?"] * max(0, int(count) - len(splits.get(split, [])))
        total = sum(len(ids) for ids in lacking.values())
        if not total:
            return splits, None
        listed_total = sum(int(n) for n in self.manifest.get("samples", {}).values())
        detail = "; ".join(f"{split}: {len(ids)} missing" + (f", e.g. {', '.join(ids[:3])}" if ids[0] != "?" else "")
                           for split, ids in sorted(lacking.items()) if ids)
        what = f"{self.path / STORE_DIR} lacks {total} of the {listed_total} samples its manifest lists ({detail})"
        if missing != "skip":
            raise FeatureSetError(f"{what}: their files were deleted or moved. Run the same `specforge capture` "
                                  "command again to capture them anew, or pass --set data.missing_samples=skip to "
                                  "train without them")
        return splits, f"warning: {what}; training without them (data.missing_samples=skip)"

    def check_plan(self, plan: CapturePlan, strategy: str) -> None:
        """Fail unless the stored features provide what the strategy's capture plan needs."""
        stored = self.plan
        for name, want in plan.features.items():
            have = stored.features.get(name)
            if have is None:
                raise FeatureSetError(f"{self.path} has no feature '{name}' that strategy '{strategy}' needs "
                                      f"(it has: {', '.join(sorted(stored.features))}); capture again with "
                                      f"--strategy {strategy}")
            if not want.accepts(have):
                raise FeatureSetError(f"feature '{name}' in {self.path} is {have.to_dict()}, strategy '{strategy}' "
                                      f"needs {want.to_dict()}")
        if tuple(plan.layer_ids) != tuple(stored.layer_ids):
            raise FeatureSetError(f"{self.path} holds target layers {list(stored.layer_ids)}, strategy '{strategy}' "
                                  f"needs {list(plan.layer_ids)}; capture again with the same options")


def _unshared(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` on the CPU, contiguous, none sharing memory with another (safetensors refuses shared
    storage: a target with tied embeddings gives one tensor as both ``embed_tokens`` and ``lm_head``)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def create_feature_set(path: str | os.PathLike[str], *, strategy: str, strategy_options: Mapping[str, Any],
                       plan: CapturePlan, target: TargetInfo, frozen_parts: Mapping[str, Any],
                       context: BuildContext) -> tuple[Path, Any]:
    """Start (or reopen, to resume a capture) a features directory; returns (path, disk store).

    The manifest is written first with ``complete: false``; call :func:`finish_feature_set`
    when the capture is done.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fingerprint = frozen_fingerprint(frozen_parts)
    manifest_path = path / MANIFEST
    kept: dict[str, Any] = {}
    if manifest_path.exists():
        existing = json.loads(manifest_path.read_text())
        if existing.get("frozen_fingerprint") != fingerprint or existing.get("strategy") != strategy:
            raise FeatureSetError(f"{path} already holds features of another target or strategy "
                                  f"({existing.get('strategy')}); use a new --output directory")
        # a restarted stream producer keeps its stream record: consumers may read it meanwhile
        if "stream" in existing:
            kept["stream"] = existing["stream"]
    manifest = {**kept,
        "format": FORMAT, "version": VERSION, "strategy": strategy, "strategy_options": dict(strategy_options),
        "capture_plan": plan_to_dict(plan), "target": attrs.asdict(target), "frozen_fingerprint": fingerprint,
        "complete": False, "samples": {},
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    if not (path / FROZEN).exists():
        parts = _unshared(frozen_parts)
        atomic_write(path / FROZEN, lambda tmp: save_file(parts, tmp))
    from .feature_stores.disk import DiskFeatureStore

    return path, DiskFeatureStore(_store_options(path / STORE_DIR), context)


def finish_feature_set(path: str | os.PathLike[str], sample_ids: Mapping[str, Sequence[str]],
                       extra: Mapping[str, Any] | None = None) -> None:
    """Mark a capture complete, listing the ids of its samples per split (checked when a run opens it)."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    listed = {split: sorted(ids) for split, ids in sample_ids.items()}
    manifest.update({"complete": True, "samples": {split: len(ids) for split, ids in listed.items()},
                     "sample_ids": listed, **dict(extra or {})})
    atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))


def save_token_counts(path: str | os.PathLike[str], counts: Any) -> None:
    from safetensors.torch import save_file

    atomic_write(Path(path) / TOKEN_COUNTS, lambda tmp: save_file({"token_counts": counts.contiguous()}, tmp))
