"""Data preparation: chat JSONL rows -> token ids + assistant loss mask.

One JSONL line is one row, in one of these forms (keys are looked for in this order):

* ``{"conversations": [...]}`` or ``{"messages": [...]}``, each item either
  ``{"role": ..., "content": ...}`` with role ``system`` / ``user`` / ``assistant``, or
  ShareGPT ``{"from": ..., "value": ...}`` with from ``system`` / ``human`` / ``gpt``
  (``human`` is read as ``user``, ``gpt`` as ``assistant``). Other keys are ignored.
* ``{"prompt": "...", "response": "..."}`` (or ``"completion"`` for the reply), optionally
  with ``"system"``: one user turn and its assistant reply. A prompt without a reply is a
  conversation with no assistant turn (``specforge regenerate`` writes one).
* ``{"input_ids": [...], "loss_mask": [...]}``, already tokenized: equal lengths,
  non-negative integer ids inside the tokenizer's vocabulary, mask values 0 or 1. Passed
  through as given (only truncated).

A conversation is good when its content values are strings, an optional ``system``
message comes first and only first, and the rest alternates ``user``, ``assistant``,
``user``, ... with at least one assistant turn. Messages after the last assistant turn are
dropped: they could only add unsupervised tokens at the tail.

**What is supervised** (``loss_mask == 1``): the text of each assistant turn as the
tokenizer's own chat template renders it, *after* the assistant header / generation prompt,
up to and including the template's end-of-turn marker (``<|im_end|>`` for ChatML,
``<|eot_id|>`` for Llama-3). Whitespace the template writes after the marker (ChatML's
``"\\n"``) is **not** supervised: the model stops at the marker and never generates it.
(The turn's rendering is right-stripped, so with a template that writes no marker at all a
reply's own trailing whitespace is not supervised either.) A reply cut at a token budget,
marked ``"finish_reason": "length"`` on its message (on the row for the ``prompt`` form, as
``specforge regenerate`` writes it), is supervised up to the end of its content only: the
marker after it is not what the target produced there.
Everything else is 0: system and user turns, role headers, BOS, and any template text
before the first turn.

How a turn is located, for any template: for assistant message ``i``, ``P`` is the
rendering of ``messages[:i]`` with ``add_generation_prompt=True`` and ``Q`` the rendering of
``messages[:i+1]``; the turn is the characters ``[len(P), len(Q.rstrip()))`` of the full
rendering. That holds only if ``P`` is a prefix of ``Q`` and ``Q`` a prefix of the full
rendering (a *prefix-stable* template). Templates that rewrite a past assistant turn once
later messages follow it (Qwen3 and other reasoning templates drop the ``<think>`` block
of turns before the last user message) fail the second test; for them the turn still
starts at ``len(P)`` and ends after the first end-of-turn marker that follows, the marker
being what the template writes after a sentinel reply in the turn's place. So a past turn
is supervised as the whole conversation shows it (without its reasoning), the last turn
with it. Text a template writes after the conversation's last message only (Phi-3's EOS
token after the final turn's marker) is no turn's: it is cut from each rendering before the
turn is located. Any other mismatch raises :class:`ChatTemplateError` rather than a wrong mask. The strings are rendered per turn, but the full text is tokenized
once (with ``add_special_tokens=False``: the template already writes BOS), and a token is
supervised when its character offsets lie inside a turn.

Rows longer than ``max_length`` tokens lose their tail. A bad row is skipped and counted
by reason in a :class:`PrepareReport` (with the first few ``file:line`` locations), or,
with ``strict=True``, raised as :class:`BadRowError` naming ``file:line``.

The tokenizer is any object with ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=...) -> str`` and ``__call__(text, add_special_tokens=False,
return_offsets_mapping=True)`` returning ``input_ids`` and ``offset_mapping`` (a
``transformers.PreTrainedTokenizerFast`` does); this module does not import transformers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from array import array
from typing import Any, Callable, Iterator, Sequence, Union

import attrs

from ..errors import SpecforgeError

# Reasons a row is skipped: the keys of PrepareReport.skipped. Each BadRowError message
# starts with its reason, then says what exactly is wrong.
NOT_JSON = "not JSON"
NOT_OBJECT = "not a JSON object"
UNKNOWN_FORMAT = "unknown row format"
EMPTY_CONVERSATION = "empty conversation"
BAD_MESSAGE = "bad message"
BAD_ROLE_ORDER = "bad role order"
NO_ASSISTANT = "no assistant turn"
BAD_TOKENS = "bad pre-tokenized row"
NO_SUPERVISED = "no supervised token within max_length"

#: An assistant message's (or a prompt row's) ``finish_reason`` saying its reply was cut at the token budget
#: rather than ended by the target (``specforge regenerate`` writes it; OpenAI's API reports it so).
CUT_AT_LENGTH = "length"

#: Known speaker names, ``role`` and ShareGPT ``from`` alike, and the role each means.
_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}

Messages = list[dict[str, str]]
TokenRow = tuple[list[int], list[int]]


class DataError(SpecforgeError):
    """Training data, or the tokenizer that prepares it, cannot become training samples."""


class ChatTemplateError(DataError):
    """The chat template cannot be used to locate assistant turns. Fatal: it is not one row's fault."""


class BadRowError(DataError):
    """One row cannot become a sample. ``reason`` is the category it is counted under,
    ``detail`` the full explanation, ``source`` its ``file:line`` when known."""

    def __init__(self, reason: str, detail: str, source: str = "") -> None:
        self.reason = reason
        self.detail = detail
        self.source = source
        super().__init__(f"{source}: {detail}" if source else detail)


@attrs.frozen
class TokenizedSample:
    """One prepared row. ``loss_mask[t] == 1`` when token ``t`` is a training target.

    ``sample_id`` is ``"{file name}:{line}:{digest}"``, the digest a hash of the ids and
    mask: the same file, tokenizer and options give the same ids on every run, and a row
    whose tokens changed gets a new one (so a control plane never dedups it as done).
    """

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str


@attrs.define
class PrepareReport:
    """Counts for one or more prepared files (pass the same report to several calls)."""

    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = attrs.field(factory=dict)
    #: ``"file:line: message"`` for the first ``max_examples`` skipped rows.
    examples: list[str] = attrs.field(factory=list)
    tokens: int = 0
    supervised_tokens: int = 0
    #: The distinct token ids among the supervised tokens (how much of the vocabulary the data teaches).
    supervised_ids: set[int] = attrs.field(factory=set)
    #: Kept rows that lost their tail to ``max_length``.
    truncated: int = 0
    max_examples: int = 5

    def add_skipped(self, error: BadRowError) -> None:
        self.skipped[error.reason] = self.skipped.get(error.reason, 0) + 1
        if len(self.examples) < self.max_examples:
            self.examples.append(str(error))

    def add_kept(self, sample: TokenizedSample, truncated: bool) -> None:
        self.kept += 1
        self.tokens += len(sample.input_ids)
        self.supervised_tokens += sum(sample.loss_mask)
        self.supervised_ids.update(t for t, m in zip(sample.input_ids, sample.loss_mask) if m)
        self.truncated += truncated

    def summary(self) -> str:
        """A few lines for a log: totals, skipped rows by reason (most first), first examples."""
        share = 100.0 * self.supervised_tokens / self.tokens if self.tokens else 0.0
        lines = [f"{self.rows} rows read: {self.kept} kept, {self.rows - self.kept} skipped; "
                 f"{self.tokens} tokens, {self.supervised_tokens} supervised ({share:.1f}%, "
                 f"{len(self.supervised_ids)} distinct); {self.truncated} truncated to max_length"]
        for reason, count in sorted(self.skipped.items(), key=lambda item: (-item[1], item[0])):
            lines.append(f"  skipped {count}: {reason}")
        lines.extend(f"  e.g. {example}" for example in self.examples)
        return "\n".join(lines)


# --------------------------------------------------------------------------- row formats


def normalize_row(obj: Any) -> Union[Messages, TokenRow]:
    """Detect a parsed row's format and check it.

    Returns the conversation as ``[{"role", "content"}, ...]`` (roles ``system`` / ``user`` /
    ``assistant``, cut after the last assistant turn), or, for a pre-tokenized row, the
    ``(input_ids, loss_mask)`` pair. Raises :class:`BadRowError` for a bad row.
    """
    if not isinstance(obj, dict):
        raise BadRowError(NOT_OBJECT, f"{NOT_OBJECT}: the line holds {_json_kind(obj)}")
    if "input_ids" in obj or "loss_mask" in obj:
        return _normalize_tokens(obj.get("input_ids"), obj.get("loss_mask"))
    messages = conversation_messages(obj)
    last_assistant = _check_turn_order(messages)
    if last_assistant < 0:
        raise BadRowError(NO_ASSISTANT, f"{NO_ASSISTANT}: the conversation has nothing to supervise")
    return messages[:last_assistant + 1]


#: The row formats, by the key that identifies each (for messages and docs).
ROW_FORMATS = ("'messages' (OpenAI: role/content)", "'conversations' (ShareGPT: from/value, or role/content)",
               "'prompt' with 'response' or 'completion'", "'input_ids' with 'loss_mask' (pre-tokenized)")


def row_format(obj: Any) -> str:
    """Which conversation format a parsed row is in: ``messages``, ``conversations`` or ``prompt``.

    Raises :class:`BadRowError` for anything else (pre-tokenized rows included: they hold no text).
    """
    if not isinstance(obj, dict):
        raise BadRowError(NOT_OBJECT, f"{NOT_OBJECT}: the line holds {_json_kind(obj)}")
    for key in ("conversations", "messages", "prompt"):
        if key in obj:
            return key
    raise BadRowError(UNKNOWN_FORMAT, f"{UNKNOWN_FORMAT}: found keys {sorted(obj)}; expected one of "
                                      f"{'; '.join(ROW_FORMATS)}")


def conversation_messages(obj: Any) -> Messages:
    """A parsed conversation row (any text format) as checked ``[{"role", "content"}, ...]``.

    Roles alternate user/assistant after an optional system message; the conversation may
    end on a user turn and may have no assistant turn at all (callers that train need one).
    """
    key = row_format(obj)
    if key == "prompt":
        return _prompt_messages(obj)
    items = obj[key]
    if not isinstance(items, list):
        raise BadRowError(UNKNOWN_FORMAT, f"{UNKNOWN_FORMAT}: '{key}' must be a list of messages, "
                                          f"not {_json_kind(items)}")
    if not items:
        raise BadRowError(EMPTY_CONVERSATION, f"{EMPTY_CONVERSATION}: '{key}' is an empty list")
    messages = [_normalize_message(index, item) for index, item in enumerate(items)]
    _check_turn_order(messages)
    return messages


def _prompt_messages(obj: dict[str, Any]) -> Messages:
    """``{"prompt", "response" | "completion", "system"?}`` as messages (no assistant turn without a reply)."""
    reply_key = next((key for key in ("response", "completion") if key in obj), None)
    fields = [("system", "system")] if "system" in obj else []
    fields += [("prompt", "user")] + ([(reply_key, "assistant")] if reply_key else [])
    messages = []
    for key, role in fields:
        value = obj[key]
        if not isinstance(value, str):
            raise BadRowError(BAD_MESSAGE, f"{BAD_MESSAGE}: '{key}' must be a string, not {_json_kind(value)}")
        messages.append({"role": role, "content": value})
    _with_finish_reason(messages[-1], obj.get("finish_reason"), BAD_MESSAGE)
    return messages


def _normalize_message(index: int, item: Any) -> dict[str, str]:
    if not isinstance(item, dict):
        raise BadRowError(BAD_MESSAGE, f"{BAD_MESSAGE} {index}: expected an object, not {_json_kind(item)}")
    role_key, content_key = ("role", "content") if "role" in item else ("from", "value")
    if role_key not in item:
        raise BadRowError(BAD_MESSAGE, f"{BAD_MESSAGE} {index}: it has neither 'role' nor ShareGPT 'from'")
    role = item[role_key]
    if not isinstance(role, str) or role not in _ROLES:
        raise BadRowError(BAD_MESSAGE, f"{BAD_MESSAGE} {index}: unknown {role_key} {role!r} "
                                       f"(known: {', '.join(_ROLES)})")
    if content_key not in item:
        raise BadRowError(BAD_MESSAGE, f"{BAD_MESSAGE} {index}: it has no '{content_key}'")
    content = item[content_key]
    if not isinstance(content, str):
        raise BadRowError(BAD_MESSAGE, f"{BAD_MESSAGE} {index}: '{content_key}' must be a string, "
                                       f"not {_json_kind(content)}")
    return _with_finish_reason({"role": _ROLES[role], "content": content}, item.get("finish_reason"),
                               f"{BAD_MESSAGE} {index}")


def _with_finish_reason(message: dict[str, str], finish: Any, where: str) -> dict[str, str]:
    """``message``, marked as a reply cut at the token budget when ``finish`` is ``"length"`` (see
    :data:`CUT_AT_LENGTH`); other finish reasons say the reply ended as the target ended it. A ``finish`` that is
    neither None nor a string is a bad message (``where`` starts the error's text)."""
    if finish is not None and not isinstance(finish, str):
        raise BadRowError(BAD_MESSAGE, f"{where}: 'finish_reason' must be a string, not {_json_kind(finish)}")
    if finish == CUT_AT_LENGTH and message["role"] == "assistant":
        message["finish_reason"] = CUT_AT_LENGTH
    return message


def _check_turn_order(messages: Messages) -> int:
    """Check system-first and user/assistant alternation; return the last assistant's index (-1: none)."""
    first = 1 if messages[0]["role"] == "system" else 0
    last_assistant = -1
    for index in range(first, len(messages)):
        role = messages[index]["role"]
        expected = "user" if (index - first) % 2 == 0 else "assistant"
        if role == "system":
            raise BadRowError(BAD_ROLE_ORDER, f"{BAD_ROLE_ORDER}: message {index} is a system message; "
                                              "a system message may only come first")
        if role != expected:
            raise BadRowError(BAD_ROLE_ORDER, f"{BAD_ROLE_ORDER}: message {index} is {role} where {expected} "
                                              "was expected (after an optional system message, turns "
                                              "alternate user, assistant, user, ...)")
        if role == "assistant":
            last_assistant = index
    return last_assistant


def _normalize_tokens(ids: Any, mask: Any) -> TokenRow:
    for name, values in (("input_ids", ids), ("loss_mask", mask)):
        # type() rather than isinstance(): JSON true/false arrive as bool, a subclass of int.
        if not isinstance(values, list) or not all(type(value) is int for value in values):
            raise BadRowError(BAD_TOKENS, f"{BAD_TOKENS}: '{name}' must be a list of integers")
    if not ids:
        raise BadRowError(BAD_TOKENS, f"{BAD_TOKENS}: 'input_ids' is empty")
    if len(ids) != len(mask):
        raise BadRowError(BAD_TOKENS, f"{BAD_TOKENS}: 'input_ids' has {len(ids)} tokens but 'loss_mask' "
                                      f"has {len(mask)} values")
    if min(ids) < 0:
        raise BadRowError(BAD_TOKENS, f"{BAD_TOKENS}: 'input_ids' holds the negative id {min(ids)}")
    odd = next((value for value in mask if value not in (0, 1)), None)
    if odd is not None:
        raise BadRowError(BAD_TOKENS, f"{BAD_TOKENS}: 'loss_mask' values must be 0 or 1, found {odd}")
    return ids, mask


def _json_kind(value: Any) -> str:
    """How JSON would name the value's type, for messages about a wrong one."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


# --------------------------------------------------------------------------- tokenization


def tokenize_messages(tokenizer: Any, messages: Sequence[dict[str, str]], *, max_length: int = 2048,
                      last_turn_only: bool = False) -> TokenRow:
    """Render ``messages`` with the tokenizer's chat template; return ``(input_ids, loss_mask)``.

    ``messages`` are checked ones, as :func:`normalize_row` returns them. Only the last
    assistant turn is supervised when ``last_turn_only``. The result is cut to ``max_length``
    tokens. Raises :class:`ChatTemplateError` for a template whose turns cannot be located and
    :class:`BadRowError` when no supervised token is left.
    """
    ids, mask = _encode_conversation(tokenizer, messages, last_turn_only)
    return _truncate(ids, mask, max_length)[:2]


def _encode_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], last_turn_only: bool) -> TokenRow:
    text, spans = _render_with_spans(tokenizer, messages, last_turn_only)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoding["offset_mapping"]
    return list(encoding["input_ids"]), _mask_from_spans(offsets, spans)


def _render_with_spans(tokenizer: Any, messages: Sequence[dict[str, str]],
                       last_turn_only: bool) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the ``[start, end)`` character span of each supervised turn."""
    messages = list(messages)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    closing = _conversation_closing(tokenizer, str(getattr(tokenizer, "chat_template", None)))
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    spans = []
    for index in turns[-1:] if last_turn_only else turns:
        prompt = _render(tokenizer, messages[:index], add_generation_prompt=True)
        upto = text if index == len(messages) - 1 else _render(tokenizer, messages[:index + 1],
                                                                add_generation_prompt=False)
        upto = _without_closing(upto, closing)  # the turn ends before what closes the conversation
        _require_prefix(prompt, upto, index, f"messages[:{index}] with add_generation_prompt=True",
                        f"messages[:{index + 1}]")
        if text.startswith(upto):
            # Whitespace after the end-of-turn marker is not generated by the model: leave it out.
            span = (len(prompt), max(len(prompt), len(upto.rstrip())))
        else:
            # The turn renders differently once later messages follow it (Qwen3-style templates
            # drop the reasoning of assistant turns before the last user message). The turn
            # still starts where its prompt ends; it ends at the template's end-of-turn marker.
            end = _history_turn_end(tokenizer, messages, index, prompt, text, closing)
            if end is None:
                _require_prefix(upto, text, index, f"messages[:{index + 1}]", "the whole conversation")
            span = (len(prompt), end)
            _require_turn_before_next(text, span, messages, index)
        _require_reply_inside(text[span[0]:span[1]], messages[index]["content"], index)
        if messages[index].get("finish_reason") == CUT_AT_LENGTH:
            span = _cut_reply_span(text, span, messages[index]["content"])
        spans.append(span)
    return text, spans


def _answer(content: str) -> str:
    """A reply's answer: its text after a reasoning block (``<think>...</think>``), which templates may drop."""
    return content.rsplit("</think>", 1)[-1]


def _reply_tail(content: str) -> str:
    """The last words of a reply's answer, by which its turn is found in a rendering (whitespace stripped, as
    templates may trim it)."""
    return _answer(content).strip()[-24:]


def _require_reply_inside(turn: str, content: str, index: int) -> None:
    """Refuse a turn whose supervised text does not end with the reply's own last words.

    A template that rewrites or drops a reply's text would otherwise train the draft on the
    template's words under the reply's mask. Only the tail of the reply's answer is compared:
    templates may legitimately drop a reasoning block (``<think>...</think>``) or trim whitespace.
    """
    tail = _reply_tail(content)
    if tail and tail not in turn:
        raise ChatTemplateError(
            f"the chat template's rendering of assistant message {index} does not contain the end of its content "
            f"({tail!r}); the supervised text would be {turn[:60]!r}. The template rewrites replies, so the loss "
            "mask cannot follow them: fix the template, or pass pre-tokenized input_ids with loss_mask rows")


def _cut_reply_span(text: str, span: tuple[int, int], content: str) -> tuple[int, int]:
    """The supervised part of a turn whose reply was cut at the token budget: up to the end of its content.

    The end-of-turn marker the template writes after a cut reply is not what the target produced there (it
    would have gone on), so a draft trained on it would learn to end replies at arbitrary lengths.
    """
    answer, tail = _answer(content), _reply_tail(content)  # the tail: found inside the span (_require_reply_inside)
    if not tail:
        return span[0], span[0]
    end = text.rfind(tail, span[0], span[1]) + len(tail)
    trailing = answer[len(answer.rstrip()):]  # whitespace the target generated before the cut, where kept
    if trailing and text.startswith(trailing, end) and end + len(trailing) <= span[1]:
        end += len(trailing)
    return span[0], end


def _require_turn_before_next(text: str, span: tuple[int, int], messages: Messages, index: int) -> None:
    """Refuse a past turn's span that runs into the message after it: the marker that ends a reply as the
    conversation's last message was not found until later (a template that writes an EOS token after the
    final message only, as Phi-3's does), and the span would supervise the next user turn."""
    if index + 1 >= len(messages):
        return
    tail = _reply_tail(messages[index]["content"])
    at_tail = text.find(tail, span[0]) if tail else -1
    after = at_tail + len(tail) if at_tail >= 0 else span[0]
    following = messages[index + 1]["content"].strip()
    at = text.find(following, after) if following else -1
    if 0 <= at < span[1]:
        raise ChatTemplateError(
            f"the end of assistant message {index} could not be found before the message after it: the chat "
            "template ends a reply differently when it is the conversation's last message (an EOS token written "
            "after the final message only, for example), so the supervised text would run into the next turn. "
            "Use last_turn_only=True (only the final turn is supervised), or pass pre-tokenized input_ids with "
            "loss_mask rows")


_SENTINEL = "SpecforgeTurnSentinel7f3a"


def _history_turn_end(tokenizer: Any, messages: Messages, index: int, prompt: str, text: str,
                      closing: str = "") -> int | None:
    """Where assistant turn ``index`` ends inside ``text`` when the template renders it
    differently as a past turn: the end of the first end-of-turn marker after ``prompt``.

    The marker is learned by rendering a sentinel reply in the turn's place (what the
    template writes after a reply's content). None when ``prompt`` is not a prefix of
    ``text``, the template writes no marker, or the marker is not found.
    """
    if not text.startswith(prompt):
        return None
    probe = _render(tokenizer, [*messages[:index], {"role": "assistant", "content": _SENTINEL}],
                    add_generation_prompt=False)
    at = probe.find(_SENTINEL, len(prompt)) if probe.startswith(prompt) else -1
    marker = _without_closing(probe, closing)[at + len(_SENTINEL):].rstrip() if at >= 0 else ""
    found = text.find(marker, len(prompt)) if marker else -1
    return None if found < 0 else found + len(marker)


@functools.lru_cache(maxsize=8)
def _conversation_closing(tokenizer: Any, template: str) -> str:
    """What the chat template writes after a conversation's last message only, or "" (``template`` keys the
    cache: the same tokenizer may be given another template).

    Phi-3's writes an EOS token there: a reply rendered as the last message then ends with it, although
    decoding stops at the turn's own marker before it. Found by rendering a user turn and a reply, and the same
    with a user turn more: the first rendering's text past what both share, from the start of the token in
    which they part. It is "" unless the two share a whole token after the reply (the turn's marker): where
    they part before (a template that rewrites past replies) or right at its end (one that ends a reply
    differently when more follows), what follows the reply is the turn's, not a closing.
    """
    reply = [{"role": "user", "content": "SpecforgeQuestion"}, {"role": "assistant", "content": _SENTINEL}]
    alone = _render(tokenizer, reply, add_generation_prompt=False)
    more = _render(tokenizer, [*reply, {"role": "user", "content": "SpecforgeFollowUp"}], add_generation_prompt=False)
    shared = len(os.path.commonprefix([alone, more]))
    reply_end = alone.find(_SENTINEL) + len(_SENTINEL)
    if shared == len(alone) or reply_end < len(_SENTINEL) or shared <= reply_end:
        return ""
    offsets = tokenizer(alone, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    start = next((first for first, end in offsets if first <= shared < end), shared)
    # a whole token at least (the turn's own marker) is shared after the reply; else the renderings part in how
    # they end the reply itself, which is not a closing
    return alone[start:] if start > reply_end else ""


def _without_closing(rendering: str, closing: str) -> str:
    return rendering[:-len(closing)] if closing and rendering.endswith(closing) else rendering


def _render(tokenizer: Any, messages: Messages, *, add_generation_prompt: bool) -> str:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]  # the template sees no finish_reason
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a Jinja error, a missing template, ...: say where it came from
        raise ChatTemplateError(f"the tokenizer's chat template failed to render {len(messages)} messages: "
                                f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(..., tokenize=False) returned {type(text).__name__}, "
                                "expected the rendered text as a str")
    return text


def _require_prefix(shorter: str, longer: str, index: int, shorter_name: str, longer_name: str) -> None:
    """Refuse a template whose rendering of a conversation's start changes as it grows."""
    if longer.startswith(shorter):
        return
    at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(shorter))
    raise ChatTemplateError(
        f"the chat template is not prefix-stable: rendering {shorter_name} is not a prefix of rendering "
        f"{longer_name} (at character {at}: {shorter[at:at + 40]!r} vs {longer[at:at + 40]!r}), so the "
        f"assistant turn at message {index} cannot be located. The template renders earlier text "
        "differently depending on what follows it (the message count, the position of the last user "
        "message, a generation prompt unlike the assistant header it writes, ...). Give the tokenizer a "
        "prefix-stable chat_template, or try last_turn_only=True (only the final turn is located).")


def _mask_from_spans(offsets: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose ``(start, end)`` lies inside a span, in one pass over both.

    ``a <= start and a < end <= b``: an empty token at a span's very start is left out,
    because a tokenizer that trims offsets (byte-level ``trim_offsets=True``) collapses a
    whitespace-only token to its end, and one ending where the turn begins belongs before it.
    """
    mask = [0] * len(offsets)
    current = 0
    for position, (start, end) in enumerate(offsets):
        while current < len(spans) and spans[current][1] < end:
            current += 1
        if current == len(spans):
            break
        span_start, span_end = spans[current]
        if span_start <= start and span_start < end <= span_end:
            mask[position] = 1
    return mask


def _truncate(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int], bool]:
    """Cut to ``max_length`` tokens; a row left without a supervised token is bad."""
    truncated = len(ids) > max_length
    kept_mask = mask[:max_length]
    if 1 not in kept_mask:
        if 1 in mask:
            detail = f"the first supervised token is at position {mask.index(1)}, max_length is {max_length}"
        else:
            detail = "the loss mask is all 0"
        raise BadRowError(NO_SUPERVISED, f"{NO_SUPERVISED}: {detail}")
    if truncated:
        ids, mask = ids[:max_length], kept_mask
    return ids, mask, truncated


# --------------------------------------------------------------------------- files


def iter_samples(path: str | os.PathLike[str], tokenizer: Any, *, max_length: int = 2048,
                 last_turn_only: bool = False, strict: bool = False,
                 report: PrepareReport | None = None,
                 keep_line: Callable[[int], bool] | None = None) -> Iterator[TokenizedSample]:
    """Stream the samples of one JSONL file, one line at a time (constant memory).

    Blank lines are not rows; with ``keep_line``, neither are lines for which it returns
    False (another split's rows). Bad rows are skipped and counted in ``report`` (pass one to
    read the counts) or, when ``strict``, raised as :class:`BadRowError` naming ``file:line``.
    A :class:`ChatTemplateError` is always raised, prefixed with the ``file:line`` that
    revealed it.
    """
    if max_length < 1:
        raise DataError(f"max_length must be at least 1, got {max_length}")
    report = report if report is not None else PrepareReport()
    path = os.fspath(path)
    name = os.path.basename(path)
    vocab_size = _vocab_size(tokenizer)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc.strerror}") from exc
    with handle:
        for line_number, raw in enumerate(handle, 1):
            if not raw.strip() or (keep_line is not None and not keep_line(line_number)):
                continue
            source = f"{path}:{line_number}"
            report.rows += 1
            try:
                ids, mask, truncated = _prepare_line(raw, tokenizer, vocab_size, max_length, last_turn_only)
            except BadRowError as exc:
                located = BadRowError(exc.reason, exc.detail, source)
                if strict:
                    raise located from None
                report.add_skipped(located)
                continue
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"{source}: {exc}") from exc
            sample = TokenizedSample(sample_id=f"{name}:{line_number}:{_digest(ids, mask)}",
                                     input_ids=ids, loss_mask=mask, source=source)
            report.add_kept(sample, truncated)
            yield sample


def prepare_file(path: str | os.PathLike[str], tokenizer: Any, **options: Any) -> tuple[list[TokenizedSample],
                                                                                        PrepareReport]:
    """Every sample of one JSONL file in memory, with its report. ``options`` as for :func:`iter_samples`."""
    report = PrepareReport()
    samples = list(iter_samples(path, tokenizer, report=report, **options))
    return samples, report


def _prepare_line(raw: bytes, tokenizer: Any, vocab_size: int | None, max_length: int,
                  last_turn_only: bool) -> tuple[list[int], list[int], bool]:
    try:
        # Without its line ending, so that a message's column is on this line.
        obj = json.loads(raw.decode("utf-8-sig").rstrip("\r\n"))
    except UnicodeDecodeError as exc:
        raise BadRowError(NOT_JSON, f"{NOT_JSON}: the line is not UTF-8 text ({exc.reason} at byte {exc.start})")
    except json.JSONDecodeError as exc:
        raise BadRowError(NOT_JSON, f"{NOT_JSON}: {exc.msg} at column {exc.colno}")
    row = normalize_row(obj)
    if isinstance(row, tuple):
        ids, mask = row
        if vocab_size is not None and max(ids) >= vocab_size:
            raise BadRowError(BAD_TOKENS, f"{BAD_TOKENS}: token id {max(ids)} is outside the tokenizer's "
                                          f"vocabulary of {vocab_size} (tokenized with another tokenizer?)")
    else:
        ids, mask = _encode_conversation(tokenizer, row, last_turn_only)
    return _truncate(ids, mask, max_length)


def _vocab_size(tokenizer: Any) -> int | None:
    """``len(tokenizer)`` (the vocabulary with added tokens) when the tokenizer has one."""
    try:
        return len(tokenizer)
    except TypeError:
        return None


def _digest(ids: list[int], mask: list[int]) -> str:
    """A short content hash of a sample, the same on every run and machine."""
    packed = array("q", ids)
    if sys.byteorder != "little":  # hash one byte order everywhere
        packed.byteswap()
    return hashlib.blake2b(packed.tobytes() + bytes(mask), digest_size=6).hexdigest()
