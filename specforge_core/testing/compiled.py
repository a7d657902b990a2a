"""A check for plugins with a ``compile`` option: the compiled draft's step equals the eager one's.

    check_compiled_step(lambda model, batch: strategy.forward_loss(model, batch, ctx).loss,
                        eager, compiled, batches)

Runs each batch through both models (built alike, one with its layers compiled), compares the loss
and every gradient, and checks that the last batch (new lengths) compiled no new graph: a layer
that recompiles for every length would cost a compile per batch. Imports torch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def _step(loss_of: Callable[[Any, Any], torch.Tensor], model: torch.nn.Module, batch: Any):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, batch)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_compiled_step(loss_of: Callable[[Any, Any], torch.Tensor], eager: torch.nn.Module,
                        compiled: torch.nn.Module, batches: Sequence[Any], *, rtol: float = 1e-4,
                        atol: float = 1e-5) -> list[float]:
    """Assert that ``compiled`` gives ``eager``'s loss and gradients on every batch and that the last batch
    compiled nothing new; return the eager losses. Resets torch.compile's caches first."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert list(compiled.state_dict()) == list(eager.state_dict()), "compiling changed the parameter names"
    losses, graphs = [], []
    for batch in batches:
        loss, grads = _step(loss_of, eager, batch)
        compiled_loss, compiled_grads = _step(loss_of, compiled, batch)
        assert abs(compiled_loss - loss) <= rtol * abs(loss), (compiled_loss, loss)
        assert sorted(compiled_grads) == sorted(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=rtol, atol=atol, msg=name)
        losses.append(loss)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing ran compiled"
    assert len(graphs) < 3 or graphs[-1] == graphs[-2], f"new lengths compiled new graphs: {graphs}"
    return losses
