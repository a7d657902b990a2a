"""Real acceptance measurement: speculative decoding against the target, checked lossless.

For each held-out prompt, the target's plain greedy decode is the reference; the
strategy's ``speculate`` loop (draft proposes, target verifies in one forward, accept the
matching prefix plus the target's bonus token) must produce exactly the same tokens. The
real mean acceptance length ``accept_len_real`` (formerly ``tau_real``) is tokens generated
per target verification forward, **bonus token included** — the number serving reports call
acceptance length. The prefill forward (which yields the first token before any draft runs)
is not a verification and is left out of both counts.

Both decodes are timed, so the same measurement gives the wall-clock ``speedup`` of
speculative decoding over plain greedy decoding on this engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from .errors import SpecforgeError
from .nn import argmax_last
from .protocols import CapturePlan

TAU_REAL_CONVENTION = ("tokens per target verification forward, bonus token included; the prompt's prefill "
                       "forward and the first token it yields are not counted, as serving engines report it")
TAU_SIM_CONVENTION = ("the former simulated figure, kept one release: expected accepted draft tokens per round "
                      "from per-step eval accuracy, bonus token excluded; read accept_len_sim instead")
SPEEDUP_CONVENTION = ("wall-clock new tokens per second of speculative decoding over the target's plain greedy "
                      "decode, batch 1, same engine, prompts and threads, prefill included in both; measured on "
                      "this machine's engine, it is not a serving engine's speedup on a GPU")

#: The plan of the target's plain greedy decode, the reference eval times speculative decoding against: no
#: layer captured, no last hidden state copied (a draft's features are speculative decoding's own cost).
PLAIN_DECODE = CapturePlan()


class LosslessError(SpecforgeError):
    """Speculative decoding produced different tokens than the target's greedy decode."""


def stop_token_ids(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    """``eos_token_id`` as a set: a tokenizer or generation config may name none, one, or several."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(i) for i in eos_token_id)


def accept_drafts(drafts: Sequence[int], target_next: Sequence[int], *, stop: frozenset[int] = frozenset(),
                  budget: int | None = None) -> tuple[int, list[int]]:
    """Greedy verification of one round: ``(accepted, new tokens)``.

    ``drafts`` are the n drafted tokens the target just verified after the last token;
    ``target_next`` its n+1 argmax tokens, one after each verified position. ``accepted`` is
    the length of the drafts' prefix that matches; the new tokens are those drafts and then the
    target's own next token (the bonus), cut after the first token in ``stop`` and to at most
    ``budget`` tokens. Every emitted token is the target's argmax given the ones before it,
    which is why the decode equals the target's greedy decode. Roll the session back to the
    last token plus the ``accepted`` drafts.
    """
    drafts, target_next = [int(t) for t in drafts], [int(t) for t in target_next]
    if len(target_next) != len(drafts) + 1:
        raise ValueError(f"accept_drafts needs one target token per verified position: {len(drafts)} drafts and "
                         f"the token before them, so {len(drafts) + 1}, got {len(target_next)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_next[accepted]:
        accepted += 1
    new = drafts[:accepted] + [target_next[accepted]]
    for index, token in enumerate(new):
        if token in stop:
            new = new[: index + 1]
            break
    return accepted, new if budget is None else new[:budget]


def prompt_outputs(session: Any, prompt: torch.Tensor) -> dict[str, Any]:
    """The target's outputs for ``prompt`` (1-D token ids), for a strategy's ``speculate``: the
    session's ``prefill`` (engines run the prompt when they open a session on it), or an
    ``extend`` of a session opened empty."""
    if session.prefill is not None and session.length == prompt.numel():
        return session.prefill
    if session.length == 0:
        return session.extend(prompt)
    raise ValueError(f"speculate needs a session holding exactly the prompt ({prompt.numel()} tokens, with its "
                     f"outputs in session.prefill) or an empty one; this one holds {session.length} positions")


@torch.no_grad()
def greedy_decode(engine: Any, prompt_ids: list[int], plan: CapturePlan, *, max_new_tokens: int,
                  eos_token_id: int | Sequence[int] | None) -> list[int]:
    """The target's own greedy continuation of ``prompt_ids`` (the reference output): one forward for the
    prompt and one for each new token but the last, whose logits nothing reads."""
    stop = stop_token_ids(eos_token_id)
    session = engine.session(torch.tensor(prompt_ids, dtype=torch.long), plan)
    logits = session.prefill["logits"][-1]
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        token = int(argmax_last(logits))
        tokens.append(token)
        if token in stop or len(tokens) == max_new_tokens:
            break
        logits = session.extend(torch.tensor([token], dtype=torch.long))["logits"][-1]
    return tokens


def prompts_from_jsonl(path: str | Path, tokenizer: Any, *, limit: int) -> list[list[int]]:
    """Held-out prompts: each conversation up to its last user turn, with the generation prompt."""
    from .data.prepare import normalize_row

    prompts: list[list[int]] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if len(prompts) >= limit:
                break
            if not line.strip():
                continue
            try:
                messages = normalize_row(json.loads(line))
            except Exception:  # noqa: BLE001 - a bad row is simply not a prompt
                continue
            if not isinstance(messages, list):
                continue
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last_user is None:
                continue
            text = tokenizer.apply_chat_template(messages[: last_user + 1], tokenize=False, add_generation_prompt=True)
            prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def prompts_from_token_rows(rows: Iterable[tuple[Sequence[int], Sequence[int]]], *, limit: int) -> list[list[int]]:
    """Held-out prompts from prepared samples: each ``(input_ids, loss_mask)`` cut where its last
    supervised turn starts (the conversation up to its last user turn and the generation prompt,
    as the tokenizer rendered it). Rows with nothing supervised give no prompt."""
    prompts: list[list[int]] = []
    for ids, mask in rows:
        if len(prompts) >= limit:
            break
        mask = list(mask)
        if 1 not in mask:
            continue
        start = len(mask) - 1
        while mask[start] == 0:  # back to the last supervised token, then to its turn's start
            start -= 1
        while start > 0 and mask[start - 1] == 1:
            start -= 1
        if start > 0:
            prompts.append([int(t) for t in ids[:start]])
    return prompts


def measure_acceptance(strategy: Any, model: Any, engine: Any, prompts: Iterable[list[int]], *,
                       max_new_tokens: int = 64, progress: bool = True) -> dict[str, Any]:
    """Speculative decoding on every prompt, timed against the target's plain greedy decode.

    Raises :class:`LosslessError` on any mismatch. Besides the acceptance length, reports the
    wall-clock speed of both decodes on the same engine, prompts and threads: new tokens per
    second of each (prefill included in both, the first token too) and their ratio, the
    ``speedup`` (see :data:`SPEEDUP_CONVENTION`). One untimed warm-up of each decode on the first
    prompt comes first, so one-time costs (allocator growth, lazy kernels) are not timed.
    """
    import time

    from tqdm import tqdm

    target = engine.info()
    plan = strategy.capture_plan(target)
    # Both decodes stop on every token that ends a reply (the tokenizer's EOS and the generation config's, as
    # regenerate stops the eval replies); an engine that names no such set stops on its EOS.
    eos = target.extra.get("stop_token_ids") or target.extra.get("eos_token_id")
    model.eval()
    prompts = list(prompts)

    def greedy(prompt: list[int], limit: int) -> list[int]:  # plain: it captures none of the draft's features
        return greedy_decode(engine, prompt, PLAIN_DECODE, max_new_tokens=limit, eos_token_id=eos)

    def speculative(prompt: list[int], limit: int) -> Any:
        session = engine.session(torch.tensor(prompt, dtype=torch.long), plan)
        return strategy.speculate(model, session, prompt, max_new_tokens=limit, eos_token_id=eos)

    if prompts:  # warm-up, untimed
        greedy(prompts[0], min(8, max_new_tokens))
        speculative(prompts[0], min(8, max_new_tokens))
    tokens = forwards = generated = 0
    greedy_s = speculative_s = 0.0
    per_prompt = []
    for index, prompt in enumerate(tqdm(prompts, desc="speculative decoding", unit="prompt", disable=not progress)):
        start = time.perf_counter()
        reference = greedy(prompt, max_new_tokens)
        middle = time.perf_counter()
        result = speculative(prompt, max_new_tokens)
        end = time.perf_counter()
        if list(result.tokens) != reference:
            first = next((i for i, (a, b) in enumerate(zip(result.tokens, reference)) if a != b),
                         min(len(result.tokens), len(reference)))
            raise LosslessError(f"prompt {index}: speculative output differs from the target's greedy decode at "
                                f"new token {first} (speculative {list(result.tokens)[first:first + 5]}, target "
                                f"{reference[first:first + 5]}); the draft's speculate loop is not lossless")
        # The strategy counts the prefill as a forward yielding the first token: leave it out.
        tokens += max(0, len(result.tokens) - 1)
        forwards += max(0, result.target_forwards - 1)
        generated += len(reference)
        greedy_s += middle - start
        speculative_s += end - middle
        per_prompt.append({"tokens": len(result.tokens), "target_forwards": result.target_forwards,
                           "greedy_s": round(middle - start, 6), "speculative_s": round(end - middle, 6),
                           "_rounds": list(result.accepted_drafts)
                           or [n - 1 for n in result.accept_lengths[1:]]})
    from .acceptance import accept_rates

    accept_len = tokens / forwards if forwards else 0.0
    baseline = generated / greedy_s if greedy_s else 0.0
    fast = generated / speculative_s if speculative_s else 0.0
    rounds = [n for p in per_prompt for n in p.pop("_rounds")]
    return {
        "accept_len_real": accept_len,
        "tau_real": accept_len,  # the former name, kept one release
        "accept_rates": accept_rates(rounds, max(rounds, default=0)),
        "convention": TAU_REAL_CONVENTION,
        "prompts": len(prompts),
        "tokens": tokens,
        "target_forwards": forwards,
        "identical_to_target_greedy": True,
        "max_new_tokens": max_new_tokens,
        "generated_tokens": generated,
        "greedy_tokens_per_s": baseline,
        "speculative_tokens_per_s": fast,
        "speedup": fast / baseline if baseline else 0.0,
        "speedup_convention": SPEEDUP_CONVENTION,
        "per_prompt": per_prompt,
    }
