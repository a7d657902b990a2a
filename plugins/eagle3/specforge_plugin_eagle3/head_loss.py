"""The draft vocabulary head and its soft cross-entropy, fused: no ``[B, S, Vd]`` tensor per unroll step.

For the rows r a step supervises (its hidden rows x_r, already final-normed, and the teacher
rows p_r)::

    z_r   = x_r W^T                                   [R, Vd] logits, computed a chunk of rows at a time
    S     = sum_r (logsumexp(z_r) - p_r . z_r)        = sum_r CE(p_r, z_r), since p_r sums to 1
    dz_r  = softmax(z_r) - p_r
    dx    = dz W,   dW = dz^T x                       two GEMMs over all rows, in forward

Each chunk's logits stay in the CPU's caches while the logsumexp, the dot product, the
argmax and the gradient run over them (written straight into the rows of ``dz``), and rows
the step does not supervise are never computed: every row given is counted, so a chunk's
``sum_r p_r . z_r`` is one dot product over its rows' logits (a BLAS pass reading both, where a
dot product per row multiplies into a temporary and sums it: 256 rows of 4096, 0.30 ms instead
of 0.63 on one Xeon core), and its gradient needs no pass to scale rows. A chunk is at least
:data:`MIN_CHUNK_ROWS` rows, however wide the vocabulary: each chunk's GEMM passes over the whole head. The input
gradients are computed in forward and only scaled in backward, so what a step keeps for
backward is ``dx [R, h]``, not its logits. The unroll steps share the head: given a
:class:`HeadGradSum` and the step's coefficient c_k in the loss (``sum_k c_k S_k``), each step
adds ``c_k dW_k`` into that one ``[Vd, h]`` sum as its GEMM (``dW`` accumulated in place), and the
first step backward reaches hands the sum to autograd, the others nothing; without one, each step
keeps its own ``dW`` and autograd adds them up. On CUDA the same ops run on
cuBLAS and elementwise kernels;
bf16/fp16 on a CPU whose own bf16 GEMM is the slower runs its GEMMs in float32
(:func:`specforge_core.nn.upcasts`).
"""

from __future__ import annotations

import attrs
import torch

from specforge_core.nn import Linear, add_product_, mm_wide, softmax_logsumexp_, upcasts

#: Elements of one chunk's float32 logits (4 MiB): rows per chunk = this / Vd, at least MIN_CHUNK_ROWS.
CHUNK_ELEMENTS = 1 << 20
#: Every chunk's GEMM reads (and the CPU's BLAS packs) the whole ``[Vd, h]`` head, so a chunk needs
#: enough rows to amortise that pass: measured on one thread, fused loss forward + backward over
#: 384 rows of a 49152 x 576 head took 1.26 s at 16 rows a chunk and 0.97-0.99 s from 128 rows
#: (920 rows, 4096 x 256: 92 ms at 16, 83 at 128, 78-80 at 256-512).
MIN_CHUNK_ROWS = 128


#: What :class:`HeadGradSum` needs of the loss, said when a backward pass shows otherwise.
_CONTRACT = "every step's loss must enter the total once, times its coefficient"


class HeadGradSum:
    """The head weight's gradient over the unroll steps of one loss ``L = g * sum_k c_k S_k``, summed as the steps
    run: ``sum_k c_k dW_k`` in one ``[Vd, h]`` tensor (the sums' dtype), where each step would otherwise keep its
    own ``dW_k`` (a 32000-row head at SmolLM2's width: 74 MB a step in float32) for autograd to scale and add.

    Backward reaches every step with the gradient ``c_k g`` of its ``S_k``; the first step it reaches returns the
    sum times ``g``, the others return nothing. That holds only while every step's ``S_k`` enters the loss as
    ``c_k S_k`` and nowhere else (the unrolled loss builds it so, :func:`.loss.ttt_loss`): on CPU each later step
    checks its ``g`` against the first's, and at the end of every backward pass (on any device) the sum checks
    that the pass reached each step that added to it. A step with ``c_k = 0`` adds nothing and is not counted. A
    graph backpropagated again (``retain_graph``) hands the sum over again on its next pass; passes are told apart
    by autograd's graph task, so a pass refused midway (it never reaches its end) leaves nothing to the next.
    """

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.steps = 0  # the steps that added to the sum
        self._pass: int | None = None  # autograd's graph task of the running backward pass
        self._scale: torch.Tensor | None = None  # that pass's g
        self._reached = 0  # the steps that pass has reached

    def add(self, dz: torch.Tensor, x: torch.Tensor, coefficient: float, dtype: torch.dtype) -> None:
        """``grad += coefficient * dz^T x``, the sum kept in ``dtype``."""
        if coefficient == 0:
            return
        if self.grad is None:
            self.grad = torch.zeros(dz.shape[1], x.shape[1], dtype=dtype, device=x.device)
        add_product_(self.grad, dz.t(), x if coefficient == 1 else x * coefficient)  # scale the narrow side
        self.steps += 1

    def take(self, grad_total: torch.Tensor, coefficient: float, dtype: torch.dtype) -> torch.Tensor | None:
        """A step's weight gradient in backward, ``grad_total`` being ``dL/dS_k``: the whole sum times ``g`` at
        the first step backward reaches in a pass, else None."""
        if coefficient == 0 or self.grad is None:
            return None
        scale = grad_total / coefficient
        task = torch._C._current_graph_task_id()
        if task != self._pass:  # the first step this pass reaches (told by the pass, as one that ended in an error
            # never reached its end); the pass's end checks it reached them all
            self._pass, self._scale, self._reached = task, scale, 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
            return (self.grad * scale.to(self.grad.dtype)).to(dtype)
        self._reached += 1
        if scale.device.type == "cpu" and not torch.allclose(scale, self._scale, rtol=1e-4, atol=0):
            raise RuntimeError(
                f"the unroll steps' head gradients are summed for a loss sum_k c_k S_k, but a step with c_k = "
                f"{coefficient} got dL/dS_k = {float(grad_total):.6g}, {float(scale):.6g} per unit of c_k where the "
                f"first step got {float(self._scale):.6g}: {_CONTRACT}")
        return None

    def _end_pass(self) -> None:
        reached, self._pass, self._scale, self._reached = self._reached, None, None, 0
        if reached != self.steps:
            raise RuntimeError(f"backward reached {reached} of the {self.steps} unroll steps whose head gradients "
                               f"were summed, and handed all {self.steps} steps' sum to the head: {_CONTRACT}")


@attrs.frozen
class SoftTargets:
    """What a step's loss reads: ``p [R, Vd]`` float teacher rows, row r the target distribution of hidden
    row r (read in place, a chunk at a time), every row counted; with ``weight_grad``, the step's
    ``coefficient`` in the loss and the :class:`HeadGradSum` its head's weight gradient goes to."""

    p: torch.Tensor
    coefficient: float = 1.0
    weight_grad: HeadGradSum | None = None


def chunk_rows(vocab: int) -> int:
    """Rows per chunk of logits for a ``vocab``-wide head."""
    return max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(1, vocab))


class HeadSoftCrossEntropy(torch.autograd.Function):
    """``(S, argmax)`` of the module docstring for ``x [R, h]``, ``weight [Vd, h]`` and the teacher rows
    ``p [R, Vd]``; the argmax (draft ids, ``[R]``) carries no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, coefficient: float = 1.0,
                shared: HeadGradSum | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows, vocab = x.shape[0], weight.shape[0]
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        gemm = torch.float32 if upcasts(rows, weight) else weight.dtype
        acc = torch.promote_types(gemm, torch.float32)  # the logits' and the sums' dtype
        x_g, w_g = x.to(gemm), weight.to(gemm)
        step = chunk_rows(vocab)
        # With gradients every row's dz is kept, in the GEMMs' dtype, for the two gradient GEMMs; a chunk's
        # logits are computed in the sums' dtype, in dz's rows when that is the same, else in a scratch chunk
        # whose dz is rounded into its rows while still in cache.
        dz = torch.empty(rows, vocab, dtype=gemm, device=x.device) if grads else None
        scratch = None if grads and gemm == acc else torch.empty(min(rows, step), vocab, dtype=acc, device=x.device)
        draft = torch.empty(rows, dtype=torch.long, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        for start in range(0, rows, step):
            end = min(start + step, rows)
            z = dz[start:end] if scratch is None else scratch[:end - start]
            if gemm == acc:
                mm_wide(x_g[start:end], w_g, out=z)
            else:
                z.copy_(x_g[start:end] @ w_g.t())
            p_c = p[start:end].to(acc)
            dot = torch.dot(p_c.reshape(-1), z.reshape(-1))  # sum_r p_r . z_r, before z is overwritten
            lse, draft[start:end] = softmax_logsumexp_(z)  # z now holds softmax(z): one exp per logit
            total += lse.sum() - dot
            if grads:  # dz = softmax - p, in place
                z.sub_(p_c)
                if scratch is not None:
                    dz[start:end] = z
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (dz @ w_g).to(x.dtype)
        ctx.shared = None
        if ctx.needs_input_grad[1]:
            if shared is None:
                grad_w = (dz.t() @ x_g).to(weight.dtype)
            else:  # into the steps' one sum, as a GEMM accumulating in place
                shared.add(dz, x_g, coefficient, acc)
                ctx.shared, ctx.coefficient, ctx.weight_dtype = shared, coefficient, weight.dtype
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(draft)
        return total, draft

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_draft: torch.Tensor | None):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_total
        if ctx.shared is not None:
            grad_w = ctx.shared.take(grad_total, ctx.coefficient, ctx.weight_dtype)
        elif grad_w is not None:
            grad_w = grad_w * scale.to(grad_w.dtype)
        return None if grad_x is None else grad_x * scale.to(grad_x.dtype), grad_w, None, None, None


def head_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor,
                            targets: SoftTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_r CE(p_r, x_r W^T), argmax_r x_r W^T)`` (see :class:`HeadSoftCrossEntropy`)."""
    return HeadSoftCrossEntropy.apply(x, weight, targets.p, targets.coefficient, targets.weight_grad)


class DraftHead(Linear):
    """The draft's ``lm_head``: a :class:`~specforge_core.nn.Linear` (same parameter, same state-dict key)
    whose call with ``targets`` returns the fused loss and draft ids of :func:`head_soft_cross_entropy`
    instead of logits. Being the module's own call, it sees the weight as FSDP2 gathers it for forward."""

    def forward(self, x: torch.Tensor, targets: SoftTargets | None = None):  # type: ignore[override]
        if targets is None:
            return super().forward(x)
        return head_soft_cross_entropy(x, self.weight, targets)
