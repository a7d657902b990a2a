"""Train the toy target: a small Llama causal LM fitted to the toy corpus on CPU."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator, Sequence

import torch

from ..padding import right_pad
from .corpus import Conversation
from .recipe import ToyRecipe


def encode(tokenizer: Any, conversations: Sequence[Conversation]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, assistant_mask) per conversation, through the chat template."""
    out = []
    for conversation in conversations:
        enc = tokenizer.apply_chat_template(conversation["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def _pad(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask and assistant mask of (input_ids, assistant_mask) rows."""
    ids, attention = right_pad([row for row, _ in rows], pad_id)
    assistant, _ = right_pad([mask for _, mask in rows], 0)
    return ids, attention, assistant


def _token_nll(model: Any, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Per-position next-token NLL [B, S-1]; positions predicting padding are 0."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return nll * attention[:, 1:]


def _lr_factor(step: int, recipe: ToyRecipe) -> float:
    """Linear warmup, then cosine decay to 10% of the peak learning rate."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_model(recipe: ToyRecipe, tokenizer: Any, train: Sequence[Conversation], *,
                progress: bool = True) -> tuple[Any, dict[str, float]]:
    """A freshly initialised Llama trained for ``recipe.steps`` steps; returns (model, metrics)."""
    with _single_thread():
        return _train(recipe, tokenizer, train, progress)


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """Train on one CPU thread, whatever the machine.

    The result then does not depend on the core count (matmul rounding does), so a
    recipe gives the same weights everywhere; and it stays fast on a busy machine, where
    two OpenMP threads on two contended cores run ~5x slower than one (they spin-wait on
    each other), while on an idle 2-core machine two threads are only ~1.6x faster.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _train(recipe: ToyRecipe, tokenizer: Any, train: Sequence[Conversation], progress: bool) -> tuple[Any, dict[str, float]]:
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    config = recipe.model_config(tokenizer)
    config._attn_implementation = "sdpa"  # fastest on CPU for training; not saved with the model
    with torch.random.fork_rng():  # seed the init without disturbing the caller's global RNG
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config)
    rows = encode(tokenizer, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay,
                                  betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, recipe))
    generator = torch.Generator().manual_seed(recipe.seed)
    order: list[int] = []
    started = time.perf_counter()
    model.train()
    bar = tqdm(range(recipe.steps), desc=f"training toy target ({recipe.variant})", unit="step",
               disable=not progress)
    loss_value = float("nan")
    for _step in bar:
        if len(order) < recipe.batch_size:
            order.extend(torch.randperm(len(rows), generator=generator).tolist())
        batch, order = order[:recipe.batch_size], order[recipe.batch_size:]
        ids, attention, _ = _pad([rows[i] for i in batch], tokenizer.pad_token_id)
        nll = _token_nll(model, ids, attention)
        loss = nll.sum() / attention[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}")
    bar.close()
    model.eval()
    return model, {"train_loss": loss_value, "train_seconds": time.perf_counter() - started}


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, conversations: Sequence[Conversation], batch_size: int = 64) -> dict[str, float]:
    """Mean next-token NLL over all tokens and over assistant tokens only, in nats."""
    total = assistant_total = 0.0
    count = assistant_count = 0
    rows = encode(tokenizer, conversations)
    for start in range(0, len(rows), batch_size):
        ids, attention, assistant = _pad(rows[start:start + batch_size], tokenizer.pad_token_id)
        nll = _token_nll(model, ids, attention)
        total += nll.sum().item()
        count += int(attention[:, 1:].sum())
        assistant_total += (nll * assistant[:, 1:]).sum().item()
        assistant_count += int(assistant[:, 1:].sum())
    return {"eval_loss": total / max(1, count), "eval_assistant_loss": assistant_total / max(1, assistant_count),
            "eval_tokens": count, "log_vocab": math.log(len(tokenizer))}
