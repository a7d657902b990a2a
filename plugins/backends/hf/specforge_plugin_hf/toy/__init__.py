"""The toy target: a small Llama trained in about two minutes on CPU on our own generated corpus.

It is the embedded default target (``specforge run`` with no ``--target-model``) and the
test fixture of everything downstream. It is for trying the pipeline end to end and for
tests; it is not a useful language model.

Heavy imports (torch, transformers, tokenizers) happen inside the functions that need them.
"""

from .build import MANIFEST, build_toy_target, cache_root, ensure_toy_target, read_manifest, toy_target_dir
from .corpus import generate_corpus
from .recipe import CODE_VERSION, VARIANTS, ToyRecipe, recipe_for
from .tokenizer import TOY_CHAT_TEMPLATE

__all__ = [
    "CODE_VERSION", "MANIFEST", "TOY_CHAT_TEMPLATE", "VARIANTS", "ToyRecipe", "build_toy_target", "cache_root",
    "ensure_toy_target", "generate_corpus", "read_manifest", "recipe_for", "toy_target_dir",
]
