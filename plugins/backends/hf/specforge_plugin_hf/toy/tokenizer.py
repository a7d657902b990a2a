"""The toy target's tokenizer: byte-level BPE trained on the toy corpus, and its chat template.

Byte-level BPE never meets an unknown character, digits are split one per token (so
arithmetic answers are spelled digit by digit, which a small model learns far more easily
than opaque multi-digit tokens), and every chat marker is a single special token.
"""

from __future__ import annotations

from typing import Any, Iterable

BOS = "<|bos|>"
EOS = "<|end|>"  # ends every turn; generation stops on it
PAD = "<|pad|>"
TURN_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *TURN_MARKERS)

#: The toy chat template (Jinja), saved with the tokenizer as ``chat_template.jinja``.
#: The assistant's content and its end-of-turn marker sit inside ``{% generation %}`` so
#: ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly the tokens
#: a model is trained to produce, end-of-turn included.
TOY_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- elif message['role'] in ('system', 'user') -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- else -%}"
    "{{ raise_exception('toy chat template: unknown role ' ~ message['role'] ~ '; use system, user or assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` trained on ``texts``, with special tokens and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(TURN_MARKERS),
        model_max_length=1024,
    )
    wrapped.chat_template = TOY_CHAT_TEMPLATE
    return wrapped
