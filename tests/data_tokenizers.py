"""Small chat tokenizers built offline, for pinning loss masks in tests.

Each is a byte-level BPE trained with the ``tokenizers`` library on a few sentences (so it
needs no download), wrapped in ``transformers.PreTrainedTokenizerFast`` with a Jinja chat
template that mirrors a real model family's turn format:

* :func:`chatml_tokenizer` — Qwen-style ChatML, ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.
* :func:`llama3_tokenizer` — Llama-3, ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``
  after one ``<|begin_of_text|>``.

The turn markers are special tokens, as in the real tokenizers, so a mask test can check
that the end-of-turn marker is one supervised token.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

_CORPUS = [
    "hello there, how are you today?",
    "hi! I am fine, thank you. ok bye",
    "You are a helpful assistant. Answer briefly.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "def f(x):\n    return x + 1\n",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Renders a different system header depending on how many messages there are, so the
# rendering of a conversation's first turns is not a prefix of the rendering of the whole:
# the kind of template the assistant-span computation must refuse.
UNSTABLE_TEMPLATE = (
    "{{ '<|im_start|>system\nturns=' + (messages | length | string) + '<|im_end|>\n' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3-style reasoning template (our own minimal version): an assistant turn after the last
# user message is written with its reasoning in a <think> block (empty when it has none);
# earlier assistant turns are written with the reasoning dropped. Rendering a conversation's
# first turns is therefore not a prefix of rendering the whole once it has two assistant turns.
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set answer = m['content'].split('</think>')[-1].lstrip('\n') -%}"
    "{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\n')"
    " if '</think>' in m['content'] else '' -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + answer + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def _byte_level_bpe(special_tokens: list[str], *, trim_offsets: bool) -> Tokenizer:
    """Train a tiny byte-level BPE; ``trim_offsets`` as the real model's post-processor has it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def chatml_tokenizer(template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A Qwen-style ChatML tokenizer (offsets trimmed of spaces, to exercise that case)."""
    tok = _byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], trim_offsets=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=template)


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-3-style tokenizer whose template starts with ``<|begin_of_text|>`` (offsets untrimmed)."""
    tok = _byte_level_bpe(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                          trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   chat_template=LLAMA3_TEMPLATE)
