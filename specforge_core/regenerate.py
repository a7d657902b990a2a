"""``specforge regenerate``: rewrite the assistant turns of a conversation file with the target itself.

A draft learns to predict its target; what decides acceptance in serving is how well it
predicts the target's *own* replies. Conversations written by people or by another model
are off-policy: trained on them, a draft learns replies the target would not give, and its
acceptance falls short of published figures. So each assistant turn is replaced by the
target's reply to the conversation so far (earlier turns already regenerated), and a
conversation that ends on a user turn (or a ``prompt`` without a ``response``) gets a
reply appended.

* batched and KV-cached through the target engine's ``generate`` (greedy by default:
  the continuation speculative decoding is measured against; sampled with a temperature);
* resumable: the output is written to ``OUT.partial`` and its progress to
  ``OUT.partial.json`` after every batch (fsynced); a run killed at any point continues
  after the last finished batch, so no row is regenerated twice, and refuses to continue
  a partial output made from another input or other settings. ``OUT`` appears (a rename)
  only once every row is done; an existing ``OUT`` is never overwritten;
* rows are written in their input format (``messages``, ShareGPT ``conversations``, or
  ``prompt``/``response``), other keys kept but ``input_ids`` and ``loss_mask`` (the old
  replies' tokens, which data preparation would read first); a reply cut at
  ``max_new_tokens`` is marked ``"finish_reason": "length"`` (data preparation then supervises
  its text but not the end-of-turn marker after it); a row that cannot be regenerated
  is skipped and counted by reason, as data preparation does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import attrs

from .data.prepare import CUT_AT_LENGTH, BadRowError, DataError, conversation_messages, row_format
from .options import options_to_dict

#: Why a row is not regenerated (besides data preparation's reasons).
PRE_TOKENIZED = "pre-tokenized row (no text to regenerate)"
NO_USER_TURN = "no user turn"


class RegenerateError(DataError):
    """A regeneration cannot start or continue as asked; nothing was overwritten."""


@attrs.define
class RegenerateReport:
    """What a regeneration did, for the log and the result line."""

    rows: int = 0
    written: int = 0
    skipped: dict[str, int] = attrs.field(factory=dict)
    examples: list[str] = attrs.field(factory=list)
    turns: int = 0
    cut: int = 0  # turns that reached max_new_tokens without a stop token
    tokens: int = 0
    seconds: float = 0.0
    resumed_after_line: int = 0

    def skip(self, source: str, error: BadRowError) -> None:
        self.skipped[error.reason] = self.skipped.get(error.reason, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{source}: {error.detail}")

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        lines = [f"{self.rows} rows read: {self.written} written, {self.rows - self.written} skipped; {self.turns} "
                 f"replies generated ({self.cut} cut at max_new_tokens, marked \"finish_reason\": \"length\"), "
                 f"{self.tokens} tokens at {rate:.1f} "
                 "tokens/s"]
        lines += [f"  skipped {count}: {reason}" for reason, count in sorted(self.skipped.items())]
        lines += [f"  e.g. {example}" for example in self.examples]
        return "\n".join(lines)


@attrs.frozen
class _Row:
    line: int
    obj: dict[str, Any]
    key: str  # messages | conversations | prompt
    messages: list[dict[str, str]]


def check_paths(input_path: str, output_path: str) -> None:
    """Raise unless the input can be read and the output written (a new file, in a folder this user can create
    or write): what :func:`run_regenerate` checks first, and the CLI before it loads the target."""
    from .run_directory import check_writable

    source, out = Path(input_path), Path(output_path)
    if source.resolve() == out.resolve():
        raise RegenerateError(f"--output {out} is the input file; write the regenerated conversations elsewhere")
    if out.exists():
        raise RegenerateError(f"{out} already exists; regenerate never overwrites a file: choose another --output "
                              "or remove it")
    if not source.is_file():
        raise RegenerateError(f"cannot read {source}: no such file")
    check_writable(out.parent, "folder of --output")


def run_regenerate(engine: Any, input_path: str, output_path: str, options: Any, *,
                   progress: bool = True) -> RegenerateReport:
    """Regenerate every assistant turn of ``input_path`` into ``output_path`` (see the module doc)."""
    check_paths(input_path, output_path)
    source, out = Path(input_path), Path(output_path)
    partial, progress_file = out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    identity = {"input": str(source.resolve()), "input_digest": _digest(source), "options": options_to_dict(options),
                "target": getattr(engine, "model_id", "")}
    done_line, done_bytes = _resume_point(progress_file, partial, identity)
    report = RegenerateReport(resumed_after_line=done_line)
    started = time.perf_counter()
    from tqdm import tqdm

    total = _count_rows(source)
    bar = tqdm(total=total, desc="regenerate", unit="row", dynamic_ncols=True, mininterval=0.5, disable=not progress)
    with open(partial, "ab") as handle:
        handle.truncate(done_bytes)
        handle.seek(done_bytes)
        for batch, last_line in _batches(source, options.batch_size, report, done_line, bar):
            if batch:
                import torch

                torch.manual_seed(options.seed + batch[0].line)  # a resumed run samples what a whole run would
                for row in _regenerate_batch(engine, batch, options, report):
                    handle.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
                    report.written += 1
            handle.flush()
            os.fsync(handle.fileno())
            _write_progress(progress_file, {**identity, "line": last_line, "bytes": handle.tell()})
            report.seconds = time.perf_counter() - started
            bar.set_postfix_str(f"{report.tokens / max(report.seconds, 1e-9):.1f} tokens/s", refresh=False)
    bar.close()
    os.replace(partial, out)
    progress_file.unlink(missing_ok=True)
    report.seconds = time.perf_counter() - started
    return report


def _resume_point(progress_file: Path, partial: Path, identity: dict[str, Any]) -> tuple[int, int]:
    """(last input line done, bytes of output kept) of an interrupted run, or (0, 0) for a new one."""
    if not progress_file.exists():
        if partial.exists():
            raise RegenerateError(f"{partial} exists without its progress file {progress_file.name}; it is not a "
                                  "regeneration this command can continue: remove it to start over")
        return 0, 0
    try:
        saved = json.loads(progress_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RegenerateError(f"{progress_file} is unreadable ({exc}); remove it and {partial.name} to start "
                              "over") from None
    changed = sorted(key for key in identity if saved.get(key) != identity[key])
    if changed:
        raise RegenerateError(f"{partial} continues a regeneration with other {', '.join(changed)}; run with the "
                              f"same input and settings to continue it, or remove {partial.name} and "
                              f"{progress_file.name} to start over")
    if not partial.exists() or partial.stat().st_size < int(saved["bytes"]):
        raise RegenerateError(f"{partial} is shorter than its progress file says; remove {partial.name} and "
                              f"{progress_file.name} to start over")
    print(f"continuing {partial} after line {saved['line']} of {identity['input']}", file=sys.stderr, flush=True)
    return int(saved["line"]), int(saved["bytes"])


def _batches(source: Path, size: int, report: RegenerateReport, done_line: int,
             bar: Any) -> Iterator[tuple[list[_Row], int]]:
    """Batches of usable rows after ``done_line``, each with the last input line it covers."""
    batch: list[_Row] = []
    last = done_line
    with open(source, "rb") as handle:
        for line, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            if line <= done_line:
                bar.update(1)
                continue
            report.rows += 1
            bar.update(1)
            last = line
            try:
                batch.append(_parse(raw, line))
            except BadRowError as exc:
                report.skip(f"{source}:{line}", exc)
            if len(batch) == size:
                yield batch, last
                batch = []
    yield batch, last


def _parse(raw: bytes, line: int) -> _Row:
    try:
        obj = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRowError("not JSON", f"not JSON: {exc}") from None
    if isinstance(obj, dict) and "input_ids" in obj and not any(k in obj for k in ("messages", "conversations")):
        raise BadRowError(PRE_TOKENIZED, PRE_TOKENIZED)
    key = row_format(obj)
    messages = conversation_messages(obj)
    if not any(m["role"] == "user" for m in messages):
        raise BadRowError(NO_USER_TURN, f"{NO_USER_TURN}: nothing to reply to")
    return _Row(line=line, obj=obj, key=key, messages=messages)


def _regenerate_batch(engine: Any, batch: list[_Row], options: Any, report: RegenerateReport) -> list[dict[str, Any]]:
    """Every row of ``batch`` with its assistant turns regenerated, turn by turn across the batch."""
    tokenizer = engine.tokenizer
    stops = set(engine.stop_token_ids())
    # Each conversation without its assistant turns; replies are generated into it in order.
    convs = [[m for m in row.messages if m["role"] != "assistant"] for row in batch]
    replies: list[list[str]] = [[] for _ in batch]
    cut: list[list[bool]] = [[] for _ in batch]  # per reply: it reached max_new_tokens without a stop token
    turn = 0
    while True:
        todo = [i for i, conv in enumerate(convs) if _user_turns(conv) > turn]
        if not todo:
            break
        prompts = []
        for i in todo:
            history = _with_replies(convs[i], replies[i], upto_user=turn)
            text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        outputs = engine.generate(prompts, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                                  top_p=options.top_p)
        for i, tokens in zip(todo, outputs):
            stopped = bool(tokens) and tokens[-1] in stops
            report.turns += 1
            report.tokens += len(tokens)
            report.cut += not stopped
            replies[i].append(tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=False))
            cut[i].append(not stopped)
        turn += 1
    return [_written(row, _with_replies(conv, reply, upto_user=None), turns_cut)
            for row, conv, reply, turns_cut in zip(batch, convs, replies, cut)]


def _user_turns(conv: list[dict[str, str]]) -> int:
    return sum(1 for m in conv if m["role"] == "user")


def _with_replies(conv: list[dict[str, str]], replies: list[str], *, upto_user: int | None) -> list[dict[str, str]]:
    """``conv`` (system and user turns) with ``replies`` after its user turns; with ``upto_user``, cut after
    that user turn (the prompt of its reply)."""
    out: list[dict[str, str]] = []
    seen = 0
    for message in conv:
        out.append(message)
        if message["role"] != "user":
            continue
        if upto_user is not None and seen == upto_user:
            return out
        if seen < len(replies):
            out.append({"role": "assistant", "content": replies[seen]})
        seen += 1
    return out


#: keys a row may carry that hold its replies' old tokens: dropped from a regenerated row, since data
#: preparation reads them before the conversation and would train on the replies they replaced
STALE_TOKEN_KEYS = ("input_ids", "loss_mask")


def _written(row: _Row, messages: list[dict[str, str]], cut: list[bool]) -> dict[str, Any]:
    """The regenerated conversation in the row's own format, its other keys kept but
    :data:`STALE_TOKEN_KEYS`. A reply ``cut`` at max_new_tokens is marked ``"finish_reason": "length"``
    (on its message; on the row for the ``prompt`` form), which data preparation reads: the end-of-turn
    marker a chat template writes after it is then not supervised."""
    obj = {key: value for key, value in row.obj.items() if key not in STALE_TOKEN_KEYS}
    if row.key == "prompt":
        reply_key = "completion" if "completion" in obj and "response" not in obj else "response"
        obj[reply_key] = messages[-1]["content"]
        obj.pop("finish_reason", None)  # the old reply's
        if cut[-1]:
            obj["finish_reason"] = CUT_AT_LENGTH
        return obj
    original = obj[row.key]
    sharegpt = bool(original) and isinstance(original[0], dict) and "from" in original[0]
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    written, replies = [], iter(cut)
    for m in messages:
        item = {"from": names[m["role"]], "value": m["content"]} if sharegpt else dict(m)
        if m["role"] == "assistant" and next(replies):
            item["finish_reason"] = CUT_AT_LENGTH
        written.append(item)
    obj[row.key] = written
    return obj


def _count_rows(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for raw in handle if raw.strip())


def _digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_progress(path: Path, record: dict[str, Any]) -> None:
    from .fileio import atomic_write_text

    atomic_write_text(path, json.dumps(record, sort_keys=True))
