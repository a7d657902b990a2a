"""What a toy target is made of: corpus, tokenizer, model shape and training, as one record.

The recipe's digest (plus the digest of the generated corpus) names the cache folder, so
changing any field, the corpus generator, or :data:`CODE_VERSION` builds a new target
rather than reusing one made by other code.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs

#: Bump when the build code changes what it produces for an unchanged recipe.
CODE_VERSION = 2


@attrs.frozen(kw_only=True)
class ToyRecipe:
    """Everything that determines a toy target build."""

    variant: str
    # corpus
    seed: int = 20240601
    n_conversations: int = 6000
    # tokenizer
    vocab_size: int = 1024
    # model (Llama architecture, untied embeddings like most large targets)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    # training
    steps: int = 700
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    code_version: int = CODE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def digest(self, corpus_digest: str) -> str:
        """Short hex digest of this recipe and the corpus it generates."""
        text = json.dumps({"recipe": self.to_dict(), "corpus": corpus_digest}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def model_config(self, tokenizer: Any) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


#: The embedded default target (trained in about two minutes on one CPU thread) and a
#: much smaller one built in seconds for tests.
VARIANTS: dict[str, ToyRecipe] = {
    "default": ToyRecipe(variant="default"),
    "tiny": ToyRecipe(variant="tiny", n_conversations=400, vocab_size=384, hidden_size=32, num_layers=4,
                      num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=256,
                      steps=30, batch_size=16, lr=1e-2, warmup_steps=5),
}


def recipe_for(variant: str) -> ToyRecipe:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown toy target variant {variant!r}; choose one of {', '.join(VARIANTS)}") from None
