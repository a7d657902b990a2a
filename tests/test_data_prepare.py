"""Data preparation: which tokens a chat row supervises, and what happens to bad rows.

The masks are pinned by decoding the supervised tokens back to text, with small offline
tokenizers in the ChatML and Llama-3 turn formats (tests/data_tokenizers.py).
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import pytest
from data_tokenizers import CHATML_TEMPLATE, REASONING_TEMPLATE, UNSTABLE_TEMPLATE, chatml_tokenizer, llama3_tokenizer
from specforge_core.data.prepare import (BadRowError, ChatTemplateError, DataError, PrepareReport, iter_samples,
                                         normalize_row, prepare_file, tokenize_messages)
from specforge_core.errors import SpecforgeError

TWO_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ok"},
]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def chatml():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def llama3():
    return llama3_tokenizer()


def supervised_segments(tokenizer, ids, mask):
    """The decoded text of each run of consecutive supervised tokens."""
    runs, run = [], []
    for token, flag in zip(ids, mask):
        if flag:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    return [tokenizer.decode(r) for r in runs]


def write_jsonl(tmp_path, lines, name="data.jsonl"):
    """One line per item: a str or bytes is written as it is, anything else as JSON."""
    path = tmp_path / name
    with open(path, "wb") as fh:
        for line in lines:
            if not isinstance(line, (str, bytes)):
                line = json.dumps(line)
            fh.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


# --------------------------------------------------------------------------- what is supervised

FORMATS = [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")]


@pytest.mark.parametrize("tokenizer_name, marker", FORMATS)
def test_each_assistant_turn_is_supervised_with_its_end_of_turn_marker(request, tokenizer_name, marker):
    tok = request.getfixturevalue(tokenizer_name)
    ids, mask = tokenize_messages(tok, TWO_TURNS)
    assert supervised_segments(tok, ids, mask) == [f"hello there{marker}", f"ok{marker}"]
    assert tok.decode(ids) == tok.apply_chat_template(TWO_TURNS, tokenize=False)


@pytest.mark.parametrize("tokenizer_name, marker", FORMATS)
def test_last_turn_only_supervises_the_final_assistant_turn(request, tokenizer_name, marker):
    tok = request.getfixturevalue(tokenizer_name)
    ids, mask = tokenize_messages(tok, TWO_TURNS, last_turn_only=True)
    assert supervised_segments(tok, ids, mask) == [f"ok{marker}"]
    assert ids == tokenize_messages(tok, TWO_TURNS)[0]


@pytest.mark.parametrize("tokenizer_name, marker", FORMATS)
def test_a_system_prompt_is_never_supervised(request, tokenizer_name, marker):
    tok = request.getfixturevalue(tokenizer_name)
    ids, mask = tokenize_messages(tok, [SYSTEM, *TWO_TURNS])
    assert supervised_segments(tok, ids, mask) == [f"hello there{marker}", f"ok{marker}"]
    assert "helpful" in tok.decode(ids)


def test_the_newline_after_im_end_is_not_supervised(chatml):
    ids, mask = tokenize_messages(chatml, TWO_TURNS)
    tokens = chatml.convert_ids_to_tokens(ids)
    ends = [i for i, token in enumerate(tokens) if token == "<|im_end|>"]
    assert [mask[i] for i in ends] == [0, 1, 0, 1]  # user, assistant, user, assistant
    assert [chatml.decode([ids[i + 1]]) for i in ends] == ["\n"] * 4
    assert [mask[i + 1] for i in ends] == [0] * 4


def test_the_template_bos_is_written_once_and_not_supervised(llama3):
    ids, mask = tokenize_messages(llama3, TWO_TURNS)
    bos = llama3.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1
    assert mask[0] == 0


def test_a_reasoning_template_supervises_past_turns_as_it_renders_them():
    # Earlier assistant turns lose their reasoning once a later user message follows; each
    # turn is supervised exactly as the whole conversation renders it.
    tok = chatml_tokenizer(REASONING_TEMPLATE)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nok bye\n</think>\n\nhello there"},
             {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"}]
    text = tok.apply_chat_template(turns, tokenize=False)
    assert "ok bye" not in text and "hello there<|im_end|>" in text  # the past turn's reasoning is gone
    ids, mask = tokenize_messages(tok, turns)
    assert tok.decode(ids) == text
    assert supervised_segments(tok, ids, mask) == ["hello there<|im_end|>", "<think>\n\n</think>\n\nok<|im_end|>"]
    ids_last, mask_last = tokenize_messages(tok, turns, last_turn_only=True)
    assert ids_last == ids and supervised_segments(tok, ids_last, mask_last) == ["<think>\n\n</think>\n\nok<|im_end|>"]


def test_a_reasoning_template_keeps_the_final_turns_reasoning_supervised():
    tok = chatml_tokenizer(REASONING_TEMPLATE)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nok bye\n</think>\n\nhello"}]
    ids, mask = tokenize_messages(tok, turns)
    assert supervised_segments(tok, ids, mask) == ["<think>\nok bye\n</think>\n\nhello<|im_end|>"]


CUT = {"finish_reason": "length"}


@pytest.mark.parametrize("tokenizer_name, marker", FORMATS)
def test_a_reply_cut_at_the_token_budget_is_supervised_without_the_end_of_turn_marker(request, tokenizer_name,
                                                                                      marker):
    tok = request.getfixturevalue(tokenizer_name)
    turns = [TWO_TURNS[0], {**TWO_TURNS[1], **CUT}, TWO_TURNS[2], TWO_TURNS[3]]
    ids, mask = tokenize_messages(tok, turns)
    assert supervised_segments(tok, ids, mask) == ["hello there", f"ok{marker}"]
    assert ids == tokenize_messages(tok, TWO_TURNS)[0]  # the text is the same: only the mask differs
    # the final turn cut, and other finish reasons (a reply the target ended) as if none were given
    ids, mask = tokenize_messages(tok, [TWO_TURNS[0], {**TWO_TURNS[1], "finish_reason": "stop"}, TWO_TURNS[2],
                                        {**TWO_TURNS[3], **CUT}])
    assert supervised_segments(tok, ids, mask) == [f"hello there{marker}", "ok"]


def test_a_cut_reply_keeps_its_trailing_whitespace_and_its_reasoning(chatml):
    # whitespace the target generated before the cut is its output; a cut inside the reasoning block keeps it all
    ids, mask = tokenize_messages(chatml, [TWO_TURNS[0], {"role": "assistant", "content": "hello there\n", **CUT}])
    assert supervised_segments(chatml, ids, mask) == ["hello there\n"]
    # a template that trims replies: the reply as it renders, up to its last word
    trims = chatml_tokenizer(CHATML_TEMPLATE.replace("message['content']", "message['content'] | trim"))
    ids, mask = tokenize_messages(trims, [TWO_TURNS[0], {"role": "assistant", "content": "  hello there ", **CUT}])
    assert supervised_segments(trims, ids, mask) == ["hello there"]
    tok = chatml_tokenizer(REASONING_TEMPLATE)
    ids, mask = tokenize_messages(tok, [TWO_TURNS[0], {"role": "assistant", "content": "<think>\nok b", **CUT}])
    # (this template writes an empty reasoning block before a reply without one: it is in the turn as rendered)
    assert supervised_segments(tok, ids, mask) == ["<think>\n\n</think>\n\n<think>\nok b"]


def test_the_prompt_form_marks_a_cut_reply_on_the_row_and_a_user_turn_is_never_marked(tmp_path, chatml):
    path = write_jsonl(tmp_path, [{"prompt": "hi", "response": "hello there", **CUT},
                                  {"messages": [{**TWO_TURNS[0], **CUT}, TWO_TURNS[1]]}])
    samples, _ = prepare_file(path, chatml)
    assert [supervised_segments(chatml, s.input_ids, s.loss_mask) for s in samples] == [
        ["hello there"], ["hello there<|im_end|>"]]
    assert normalize_row({"prompt": "hi", "response": "hello there", **CUT})[1] == {**TWO_TURNS[1], **CUT}


def test_a_template_rewriting_past_turns_without_an_end_marker_is_refused():
    # Without an end-of-turn marker a rewritten past turn cannot be delimited: refused, not guessed.
    template = REASONING_TEMPLATE.replace("+ answer + '<|im_end|>", "+ answer + '")
    assert template != REASONING_TEMPLATE
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
             {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ChatTemplateError, match=r"^the chat template is not prefix-stable: rendering messages\[:2\] "
                                                r"is not a prefix of rendering the whole conversation"):
        tokenize_messages(chatml_tokenizer(template), turns)


def test_a_template_closing_the_conversation_with_eos_supervises_each_turn_up_to_its_own_marker():
    # Phi-3-style: every message ends with its marker, and the conversation's end gets an EOS token too. Each
    # turn, past or final, is supervised up to its own marker: not the newline and EOS after the last one (decoding
    # stops at the marker), and no past turn runs on to the EOS at the conversation's end.
    template = CHATML_TEMPLATE.replace("{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
                                       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                                       "{% else %}{{ '<|endoftext|>' }}{% endif %}")
    tok = chatml_tokenizer(template)
    ids, mask = tokenize_messages(tok, TWO_TURNS)
    assert template != CHATML_TEMPLATE and tok.decode(ids).endswith("ok<|im_end|>\n<|endoftext|>")
    assert supervised_segments(tok, ids, mask) == ["hello there<|im_end|>", "ok<|im_end|>"]
    ids, mask = tokenize_messages(tok, TWO_TURNS, last_turn_only=True)
    assert supervised_segments(tok, ids, mask) == ["ok<|im_end|>"]


def test_a_past_turn_whose_end_cannot_be_found_before_the_next_message_is_refused_not_misread():
    # A template that marks a reply's end one way when it is the last message and another way before later
    # messages: the last-message marker is found only at the next user turn's end, so the span would run over
    # that turn. Refused, naming the way out.
    template = CHATML_TEMPLATE.replace("'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'",
                                       "'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                                       "('<|im_end|>' if loop.last or message['role'] != 'assistant' else '<|endoftext|>')")
    assert template != CHATML_TEMPLATE
    with pytest.raises(ChatTemplateError, match=r"^the end of assistant message 1 could not be found before the "
                                                r"message after it: .* Use last_turn_only=True"):
        tokenize_messages(chatml_tokenizer(template), TWO_TURNS)
    tok = chatml_tokenizer(template)
    ids, mask = tokenize_messages(tok, TWO_TURNS, last_turn_only=True)  # the final turn alone is located
    assert supervised_segments(tok, ids, mask) == ["ok<|im_end|>"]


def test_an_empty_assistant_reply_supervises_only_the_marker(chatml):
    ids, mask = tokenize_messages(chatml, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}])
    assert supervised_segments(chatml, ids, mask) == ["<|im_end|>"]


def test_indentation_inside_a_reply_is_supervised_even_with_trimmed_offsets(chatml):
    code = "def f(x):\n    return x + 1\n\n  ok"
    ids, mask = tokenize_messages(chatml, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": code}])
    assert supervised_segments(chatml, ids, mask) == [code + "<|im_end|>"]


# --------------------------------------------------------------------------- row formats


def test_sharegpt_and_messages_rows_give_identical_samples(tmp_path, chatml):
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                for m in [SYSTEM, *TWO_TURNS]]
    path = write_jsonl(tmp_path, [{"conversations": sharegpt}, {"messages": [SYSTEM, *TWO_TURNS]},
                                  {"conversations": [SYSTEM, *TWO_TURNS], "id": "x"}])
    samples, report = prepare_file(path, chatml)
    assert report.kept == 3
    assert samples[0].input_ids == samples[1].input_ids == samples[2].input_ids
    assert samples[0].loss_mask == samples[1].loss_mask == samples[2].loss_mask
    assert normalize_row({"conversations": sharegpt}) == [SYSTEM, *TWO_TURNS]


def test_prompt_response_rows_are_one_user_turn_and_its_reply(tmp_path, chatml):
    turn = TWO_TURNS[:2]
    path = write_jsonl(tmp_path, [{"prompt": turn[0]["content"], "response": turn[1]["content"]},
                                  {"prompt": turn[0]["content"], "completion": turn[1]["content"]},
                                  {"messages": turn},
                                  {"system": SYSTEM["content"], "prompt": turn[0]["content"],
                                   "response": turn[1]["content"]}])
    samples, report = prepare_file(path, chatml)
    assert report.kept == 4
    assert samples[0].input_ids == samples[1].input_ids == samples[2].input_ids
    assert samples[0].loss_mask == samples[1].loss_mask == samples[2].loss_mask
    assert normalize_row({"system": "s", "prompt": "p", "response": "r"}) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    assert supervised_segments(chatml, samples[3].input_ids, samples[3].loss_mask) == [
        turn[1]["content"] + "<|im_end|>"]


def test_messages_after_the_last_assistant_turn_are_dropped(chatml):
    assert normalize_row({"messages": [*TWO_TURNS, {"role": "user", "content": "more?"}]}) == TWO_TURNS


def test_pre_tokenized_rows_pass_through_and_truncate(tmp_path, chatml):
    path = write_jsonl(tmp_path, [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]}])
    (sample,), report = prepare_file(path, chatml)
    assert (sample.input_ids, sample.loss_mask, report.truncated) == ([5, 6, 7, 8], [0, 1, 1, 0], 0)
    (sample,), report = prepare_file(path, chatml, max_length=2)
    assert (sample.input_ids, sample.loss_mask, report.truncated) == ([5, 6], [0, 1], 1)


def test_a_long_conversation_loses_its_tail(tmp_path, chatml):
    full_ids, full_mask = tokenize_messages(chatml, TWO_TURNS)
    ids, mask = tokenize_messages(chatml, TWO_TURNS, max_length=len(full_ids) - 3)
    assert (ids, mask) == (full_ids[:-3], full_mask[:-3])
    (sample,), report = prepare_file(write_jsonl(tmp_path, [{"messages": TWO_TURNS}]), chatml,
                                     max_length=len(full_ids) - 3)
    assert sample.input_ids == ids and report.truncated == 1
    assert report.tokens == len(ids) and report.supervised_tokens == sum(mask)


def test_a_row_whose_supervised_tokens_all_lie_beyond_max_length_is_skipped(tmp_path, chatml):
    first = tokenize_messages(chatml, TWO_TURNS)[1].index(1)
    path = write_jsonl(tmp_path, [{"messages": TWO_TURNS}])
    samples, report = prepare_file(path, chatml, max_length=first)
    assert samples == []
    assert report.skipped == {"no supervised token within max_length": 1}
    assert report.examples == [f"{path}:1: no supervised token within max_length: the first supervised "
                               f"token is at position {first}, max_length is {first}"]


# --------------------------------------------------------------------------- bad rows

# (row as written on its line, reason it is counted under, the message after "file:line: ")
BAD_ROWS = [
    ("not json{", "not JSON", "not JSON: Expecting value at column 1"),
    (b'{"messages": "\xff"}', "not JSON", "not JSON: the line is not UTF-8 text (invalid start byte at byte 14)"),
    ([1, 2], "not a JSON object", "not a JSON object: the line holds an array"),
    ({"text": "hi"}, "unknown row format", "unknown row format: found keys ['text']; expected one of 'messages' "
                                           "(OpenAI: role/content); 'conversations' (ShareGPT: from/value, or "
                                           "role/content); 'prompt' with 'response' or 'completion'; 'input_ids' "
                                           "with 'loss_mask' (pre-tokenized)"),
    ({"prompt": ["hi"], "response": "x"}, "bad message", "bad message: 'prompt' must be a string, not an array"),
    ({"prompt": "hi"}, "no assistant turn", "no assistant turn: the conversation has nothing to supervise"),
    ({"prompt": "hi", "response": "x", "finish_reason": True}, "bad message",
     "bad message: 'finish_reason' must be a string, not a boolean"),
    ({"messages": [TWO_TURNS[0], {**TWO_TURNS[1], "finish_reason": 1}]}, "bad message",
     "bad message 1: 'finish_reason' must be a string, not a number"),
    ({"messages": "hi"}, "unknown row format", "unknown row format: 'messages' must be a list of messages, "
                                               "not a string"),
    ({"conversations": []}, "empty conversation", "empty conversation: 'conversations' is an empty list"),
    ({"messages": ["hi"]}, "bad message", "bad message 0: expected an object, not a string"),
    ({"messages": [{"content": "hi"}]}, "bad message", "bad message 0: it has neither 'role' nor ShareGPT 'from'"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "bad message",
     "bad message 0: unknown role 'tool' (known: system, user, assistant, human, gpt)"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "bad message",
     "bad message 0: unknown from 'bot' (known: system, user, assistant, human, gpt)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}]}, "bad message",
     "bad message 1: 'content' must be a string, not an array"),
    ({"conversations": [{"from": "human"}]}, "bad message", "bad message 0: it has no 'value'"),
    ({"messages": TWO_TURNS[1:]}, "bad role order",
     "bad role order: message 0 is assistant where user was expected (after an optional system message, "
     "turns alternate user, assistant, user, ...)"),
    ({"messages": [TWO_TURNS[0], TWO_TURNS[2], TWO_TURNS[3]]}, "bad role order",
     "bad role order: message 1 is user where assistant was expected (after an optional system message, "
     "turns alternate user, assistant, user, ...)"),
    ({"messages": [TWO_TURNS[0], SYSTEM, TWO_TURNS[1]]}, "bad role order",
     "bad role order: message 1 is a system message; a system message may only come first"),
    ({"messages": [SYSTEM, TWO_TURNS[0]]}, "no assistant turn",
     "no assistant turn: the conversation has nothing to supervise"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "bad pre-tokenized row",
     "bad pre-tokenized row: 'input_ids' has 3 tokens but 'loss_mask' has 2 values"),
    ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "bad pre-tokenized row",
     "bad pre-tokenized row: 'loss_mask' values must be 0 or 1, found 2"),
    ({"input_ids": [1, 2], "loss_mask": [False, True]}, "bad pre-tokenized row",
     "bad pre-tokenized row: 'loss_mask' must be a list of integers"),
    ({"input_ids": [1, 2]}, "bad pre-tokenized row", "bad pre-tokenized row: 'loss_mask' must be a list of integers"),
    ({"input_ids": [], "loss_mask": []}, "bad pre-tokenized row", "bad pre-tokenized row: 'input_ids' is empty"),
    ({"input_ids": [1, -1], "loss_mask": [0, 1]}, "bad pre-tokenized row",
     "bad pre-tokenized row: 'input_ids' holds the negative id -1"),
    ({"input_ids": [1, 10**6], "loss_mask": [0, 1]}, "bad pre-tokenized row",
     "bad pre-tokenized row: token id 1000000 is outside the tokenizer's vocabulary of {vocab} "
     "(tokenized with another tokenizer?)"),
    ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "no supervised token within max_length",
     "no supervised token within max_length: the loss mask is all 0"),
]


@pytest.mark.parametrize("line, reason, message", BAD_ROWS, ids=[row[2].split(":")[0] + f"-{i}"
                                                                for i, row in enumerate(BAD_ROWS)])
def test_strict_mode_raises_at_a_bad_row_naming_file_line_and_reason(tmp_path, chatml, line, reason, message):
    path = write_jsonl(tmp_path, [{"messages": TWO_TURNS}, "", line])
    samples = iter_samples(path, chatml, strict=True)
    assert next(samples).source == f"{path}:1"  # streamed: the good row comes before the bad one is read
    with pytest.raises(BadRowError) as caught:
        next(samples)
    assert str(caught.value) == f"{path}:3: " + message.format(vocab=len(chatml))
    assert (caught.value.reason, caught.value.source) == (reason, f"{path}:3")
    assert isinstance(caught.value, DataError) and isinstance(caught.value, SpecforgeError)


def test_bad_rows_are_skipped_and_counted_by_reason_with_the_first_locations(tmp_path, chatml):
    path = write_jsonl(tmp_path, [{"messages": TWO_TURNS}, *(row[0] for row in BAD_ROWS), "  "])
    samples, report = prepare_file(path, chatml)
    assert [s.source for s in samples] == [f"{path}:1"]
    assert (report.rows, report.kept) == (1 + len(BAD_ROWS), 1)  # the blank last line is not a row
    assert report.skipped == dict(collections.Counter(row[1] for row in BAD_ROWS))
    assert report.examples == [f"{path}:{line}: {message}" for line, (_, _, message) in enumerate(BAD_ROWS[:5], 2)]


def test_the_report_summary(tmp_path, chatml):
    path = write_jsonl(tmp_path, [{"messages": TWO_TURNS}, "{", {"messages": [TWO_TURNS[0]]}, "}"])
    (sample,), report = prepare_file(path, chatml)
    tokens, supervised = len(sample.input_ids), sum(sample.loss_mask)
    distinct = len({t for t, m in zip(sample.input_ids, sample.loss_mask) if m})
    assert 1 < distinct < supervised
    assert report.summary() == (
        f"4 rows read: 1 kept, 3 skipped; {tokens} tokens, {supervised} supervised "
        f"({100 * supervised / tokens:.1f}%, {distinct} distinct); 0 truncated to max_length\n"
        "  skipped 2: not JSON\n"
        "  skipped 1: no assistant turn\n"
        f"  e.g. {path}:2: not JSON: Expecting property name enclosed in double quotes at column 2\n"
        f"  e.g. {path}:3: no assistant turn: the conversation has nothing to supervise\n"
        f"  e.g. {path}:4: not JSON: Expecting value at column 1")


def test_one_report_accumulates_over_several_files(tmp_path, chatml):
    report = PrepareReport()
    for name in ("a.jsonl", "b.jsonl"):
        list(iter_samples(write_jsonl(tmp_path, [{"messages": TWO_TURNS}, "x"], name), chatml, report=report))
    assert (report.rows, report.kept, report.skipped) == (4, 2, {"not JSON": 2})


# --------------------------------------------------------------------------- ids, files, templates


def test_sample_ids_are_stable_across_runs_and_unique(tmp_path, chatml):
    path = write_jsonl(tmp_path, [{"messages": TWO_TURNS}] * 3)
    first, _ = prepare_file(path, chatml)
    again, _ = prepare_file(path, chatml)
    ids = [s.sample_id for s in first]
    assert ids == [s.sample_id for s in again]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(rf"data\.jsonl:{n}:[0-9a-f]{{12}}", i) for n, i in enumerate(ids, 1))
    # the hash names the tokens: another max_length gives another id for the same line
    shorter, _ = prepare_file(path, chatml, max_length=len(first[0].input_ids) - 1)
    assert shorter[0].sample_id != ids[0]


def test_a_template_that_is_not_prefix_stable_is_refused():
    tok = chatml_tokenizer(UNSTABLE_TEMPLATE)
    with pytest.raises(ChatTemplateError) as caught:
        tokenize_messages(tok, TWO_TURNS)
    assert str(caught.value) == (
        "the chat template is not prefix-stable: rendering messages[:1] with add_generation_prompt=True is not "
        "a prefix of rendering messages[:2] (at character 25: '1<|im_end|>\\n<|im_start|>user\\nhi<|im_end|' "
        "vs '2<|im_end|>\\n<|im_start|>user\\nhi<|im_end|'), so the assistant turn at message 1 cannot be "
        "located. The template renders earlier text differently depending on what follows it (the message "
        "count, the position of the last user message, a generation prompt unlike the assistant header it "
        "writes, ...). Give the tokenizer a prefix-stable chat_template, or try last_turn_only=True (only the "
        "final turn is located).")


def test_a_template_that_rewrites_replies_is_refused_naming_the_file_and_line(tmp_path, chatml):
    class Shouting:
        """ChatML, but assistant replies are upper-cased: the mask would cover words the data never had."""

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            shout = [dict(m, content=m["content"].upper()) if m["role"] == "assistant" else m for m in messages]
            return chatml.apply_chat_template(shout, tokenize=False, add_generation_prompt=add_generation_prompt)

        def __call__(self, *args, **kwargs):
            return chatml(*args, **kwargs)

        def __len__(self):
            return len(chatml)

    path = write_jsonl(tmp_path, [{"messages": TWO_TURNS}])
    with pytest.raises(ChatTemplateError, match=f"^{path}:1: the chat template's rendering of assistant message 1 "
                                                 "does not contain the end of its content"):
        prepare_file(path, Shouting())


def test_a_template_error_is_fatal_and_names_the_row_even_when_not_strict(tmp_path):
    path = write_jsonl(tmp_path, ["x", {"messages": TWO_TURNS}])
    report = PrepareReport()
    with pytest.raises(ChatTemplateError, match=rf"^{re.escape(str(path))}:2: the chat template is not "
                                                r"prefix-stable: rendering messages\[:3\] with"):
        list(iter_samples(path, chatml_tokenizer(UNSTABLE_TEMPLATE), last_turn_only=True, report=report))
    assert report.skipped == {"not JSON": 1}


def test_a_tokenizer_without_a_chat_template_is_a_template_error():
    with pytest.raises(ChatTemplateError, match="^the tokenizer's chat template failed to render 2 messages: "
                                                "ValueError: .*chat_template"):
        tokenize_messages(chatml_tokenizer(template=None), TWO_TURNS[:2])


def test_a_missing_file_and_a_bad_max_length_are_data_errors(tmp_path, chatml):
    with pytest.raises(DataError, match="^cannot read data file .*nope.jsonl: No such file or directory$"):
        list(iter_samples(tmp_path / "nope.jsonl", chatml))
    with pytest.raises(DataError, match="^max_length must be at least 1, got 0$"):
        list(iter_samples(write_jsonl(tmp_path, []), chatml, max_length=0))


def test_importing_the_module_does_not_import_transformers():
    code = "import sys, specforge_core.data.prepare; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
