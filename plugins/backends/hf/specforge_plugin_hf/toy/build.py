"""Build the toy target into a folder, or find it in (and add it to) the user's cache.

A build writes into a hidden staging folder next to its destination and renames it into
place in one step, with ``toy_target.json`` written last: a folder that has the manifest
is complete, and a crash or a concurrent build never leaves a half-written target behind.
Concurrent builds of the same recipe also take a file lock, so the second process waits
and reuses the first one's result instead of training again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import ToyTargetError
from .corpus import corpus_digest, generate_corpus, write_corpus
from .recipe import ToyRecipe, recipe_for

#: The file that marks a complete toy target and records how it was made.
MANIFEST = "toy_target.json"


def cache_root() -> Path:
    """``$SPECFORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specforge``, else ``~/.cache/specforge``."""
    override = os.environ.get("SPECFORGE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specforge"


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a complete toy target folder, or None if ``path`` is not one."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _plan(variant: str, recipe: ToyRecipe | None) -> tuple[ToyRecipe, dict[str, list], str]:
    recipe = recipe if recipe is not None else recipe_for(variant)
    splits = generate_corpus(recipe.n_conversations, recipe.seed)
    return recipe, splits, recipe.digest(corpus_digest(splits))


def toy_target_dir(variant: str = "default", *, recipe: ToyRecipe | None = None) -> Path:
    """Where the cached toy target of this recipe lives (whether or not it is built yet)."""
    recipe, _splits, digest = _plan(variant, recipe)
    return cache_root() / "toy-target" / f"{recipe.variant}-{digest}"


def ensure_toy_target(variant: str = "default", *, recipe: ToyRecipe | None = None, progress: bool = True) -> Path:
    """The cached toy target folder for ``variant`` (or ``recipe``), building it on first use."""
    recipe, splits, digest = _plan(variant, recipe)
    final = cache_root() / "toy-target" / f"{recipe.variant}-{digest}"
    if _is_built(final, digest):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final.parent / f".{final.name}.lock"):
        if not _is_built(final, digest):  # another process may have finished while we waited
            _build_into(final, recipe, splits, digest, progress)
    return final


def build_toy_target(output_dir: str | os.PathLike[str], variant: str = "default", *,
                     recipe: ToyRecipe | None = None, progress: bool = True) -> Path:
    """Build the toy target into ``output_dir`` (new or empty), bypassing the cache.

    Returns the folder, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and by
    the ``hf`` engine (``--set target_engine.model=DIR``). A folder that already holds
    this exact recipe is returned as is.
    """
    recipe, splits, digest = _plan(variant, recipe)
    output = Path(output_dir).expanduser().absolute()
    if _is_built(output, digest):
        return output
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ToyTargetError(f"toy target output {output} already exists and is not an empty folder; "
                             "choose a new folder or remove it")
    output.parent.mkdir(parents=True, exist_ok=True)
    _build_into(output, recipe, splits, digest, progress)
    return output


def _is_built(path: Path, digest: str) -> bool:
    manifest = read_manifest(path)
    return manifest is not None and manifest.get("recipe_digest") == digest


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps builds safe
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_into(final: Path, recipe: ToyRecipe, splits: dict[str, list], digest: str, progress: bool) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    try:
        manifest = _build(staging, recipe, splits, digest, progress)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        try:
            os.rename(staging, final)  # atomic; replaces an empty folder, refuses a non-empty one
        except OSError:
            if not _is_built(final, digest):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build(folder: Path, recipe: ToyRecipe, splits: dict[str, list], digest: str, progress: bool) -> dict[str, Any]:
    from .. import __version__
    from .tokenizer import train_tokenizer
    from .train import evaluate, train_model

    started = time.perf_counter()
    files = write_corpus(splits, folder)
    texts = (message["content"] for conversation in splits["train"] for message in conversation["messages"])
    tokenizer = train_tokenizer(texts, recipe.vocab_size)
    model, metrics = train_model(recipe, tokenizer, splits["train"], progress=progress)
    metrics.update(evaluate(model, tokenizer, splits["eval"]))
    model.generation_config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "variant": recipe.variant,
        "recipe": recipe.to_dict(),
        "recipe_digest": digest,
        "data": {name: path.name for name, path in files.items()},
        "conversations": {name: len(items) for name, items in splits.items()},
        "metrics": metrics,
        "build_seconds": time.perf_counter() - started,
        "built_by": f"specforge-plugin-hf {__version__}",
    }
