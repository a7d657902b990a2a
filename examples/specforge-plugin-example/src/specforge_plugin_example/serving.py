"""Export, load and speculative decoding of the example draft.

Export: ``model.safetensors`` (the heads, in the export dtype; the frozen lm_head is left out)
and ``config.json`` naming the strategy and the options it was trained with, written and read
with the core's helpers (atomic write; field-checked read; weights checked by name and shape
against the draft they go into). No serving engine loads this architecture: it is the plugin's
own format (``export_formats = ("example",)``), measured with ``specforge eval``.

Speculative decoding (greedy, lossless)::

    prefill      target over the prompt -> the first token b and the last hidden state h at the last position
    repeat       drafts = argmax of head j on h, j = 0..K-1          (tokens after b)
                 verify = ONE target forward over [b, drafts]
                 accept = the drafts matching the target's own argmax, then the target's next token
                 roll the cache back to the accepted tokens; h = the last hidden state at the last of them
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from specforge_core.export import (ExportError, export_state, load_checked_state, load_weights, open_export,
                                   strategy_fields, write_export_files)
from specforge_core.protocols import SpeculationResult
from specforge_core.speculative import accept_drafts, prompt_outputs, stop_token_ids

from .model import ExampleDraft

ARCHITECTURE = "SpecforgeExampleHeads"


class ExampleExportError(ExportError):
    """An example export is missing, damaged, or does not fit the target."""


def export_draft(model: ExampleDraft, out_dir: str | os.PathLike[str], *, dtype: str | None = None,
                 options: Any = None) -> Path:
    config = {"architectures": [ARCHITECTURE], "num_heads": len(model.heads), "hidden_size": model.lm_head.shape[1],
              "vocab_size": model.lm_head.shape[0], **strategy_fields("example", options)}
    return write_export_files(out_dir, export_state(model, dtype), config, error=ExampleExportError)


def load_draft(path: str | os.PathLike[str], frozen_parts: Mapping[str, torch.Tensor]) -> ExampleDraft:
    config = open_export(path, what="an example draft", error=ExampleExportError)
    config.expect_identity(ARCHITECTURE, "example")
    hidden, vocab = config.value("hidden_size", int), config.value("vocab_size", int)
    if tuple(frozen_parts["lm_head"].shape) != (vocab, hidden):
        raise config.fail(f"describes a draft for a target with vocabulary {vocab} and hidden size {hidden}, but this "
                          f"target's lm_head is {list(frozen_parts['lm_head'].shape)}; use the target it was trained for")
    model = ExampleDraft(hidden, config.value("num_heads", int), frozen_parts["lm_head"])
    # dtypes=False: the heads were exported in the serving dtype and run here in float32
    return load_checked_state(model, load_weights(path, error=ExampleExportError), str(config.source),
                              error=ExampleExportError, dtypes=False)


@torch.no_grad()
def speculate(model: ExampleDraft, session: Any, prompt_ids: Any, *, max_new_tokens: int,
              eos_token_id: int | Iterable[int] | None = None) -> SpeculationResult:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    stop = stop_token_ids(eos_token_id)
    if max_new_tokens <= 0:
        return SpeculationResult(tokens=[], target_forwards=0, accept_lengths=[])
    out = prompt_outputs(session, prompt)  # the session's prefill: the prompt's logits and last hidden states
    tokens, hidden = [int(out["logits"][-1].argmax())], out["last_hidden"][-1]
    accept_lengths = [1]  # the prefill forward yields the first token
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        position = session.length  # where the last token (not yet run by the target) goes
        drafts = model(hidden.to(model.lm_head.device)).argmax(-1).cpu()  # [K]: the tokens after tokens[-1]
        out = session.extend(torch.cat([torch.tensor([tokens[-1]]), drafts]))
        # the drafts matching the target's own next tokens, then the target's token after them
        accepted, new = accept_drafts(drafts.tolist(), out["logits"].argmax(-1).tolist(), stop=stop,
                                      budget=max_new_tokens - len(tokens))
        session.truncate(position + accepted + 1)  # keep the last token and the accepted drafts
        hidden = out["last_hidden"][accepted]
        tokens.extend(new)
        accept_lengths.append(len(new))
    return SpeculationResult(tokens=tokens, target_forwards=len(accept_lengths), accept_lengths=accept_lengths)
