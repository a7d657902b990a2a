"""Domino's prefix GRU: ``nn.GRU(H -> g, 1 layer, no bias, batch_first)`` with a fused CPU path.

The gates are PyTorch's (r, z, n in that order, as in ``weight_ih_l0`` / ``weight_hh_l0``)::

    gi_t = W_ih x_t                          one GEMM over all T steps at once: [T·M, H] x [H, 3g]
    gh_t = W_hh h_{t-1}                      per step (none at t = 0 from zeros): r and z's rows added onto
                                             gi_t, n's apart (it is kept)
    r, z = σ(gi_r + gh_r), σ(gi_z + gh_z)
    n    = tanh(gi_n + r ⊙ gh_n)
    h_t  = n + z ⊙ (h_{t-1} − n)             = (1 − z) ⊙ n + z ⊙ h_{t-1}

On CPU, autograd through ``nn.GRU`` records every step's cell ops and computes the weight
gradients a step at a time, ``T`` GEMMs with ``K = M`` each. :class:`FusedGRU` keeps the
activations it needs (``r, z, n, gh_n``, time-major so every step's rows are contiguous) and
runs backward by hand: one ``[M, 3g] x [3g, g]`` GEMM per step for the state's gradient, then
each weight gradient as one GEMM over all steps (``K = T·M``) and the input gradient as one; the
gates' derivatives are torch's own ``tanh_backward`` and ``sigmoid_backward``, and ``h_t`` a ``lerp``
(the bench's Domino GRU, 64 sequences of 15 steps, H 128, g 512, forward and backward in float32: 74 ms
instead of 80 with the ops written out one by one). ``tanh`` runs as ``2 σ(2x) - 1`` (:func:`_tanh`):
torch's CPU ``tanh`` is six times slower than its ``sigmoid`` (about 1 ms of the bench's Domino step).
A sequence that starts from zeros skips the first step's ``W_hh`` GEMM in both directions.
The per-step GEMMs of a call share one copy of each part of ``W_hh``
(:class:`specforge_core.nn.ReusedWeight`): packed for oneDNN where float32 GEMMs go there
(:func:`specforge_core.nn.onednn_float32`, AMD's Zen 4: 64 rows through 1024 x 512 at 111 GF/s against
MKL's 88, the bench's GRU 66-68 ms instead of 67-70), else transposed for torch's GEMM.
The gate arithmetic and the state run in float32 (float64 for float64 inputs); the GEMMs run
in the weights' dtype, or in float32 for half precision on CPUs without bf16 GEMM instructions
(:func:`specforge_core.nn.upcasts`); the states are rounded to the input's dtype once, at the
end. Elsewhere — CUDA (cuDNN's fused GRU) and half precision on CPUs with bf16 GEMM
instructions — the module is ``nn.GRU`` as it is (:meth:`FusedGRU.fused`).
"""

from __future__ import annotations

import torch
from torch import nn

from specforge_core.nn import ReusedWeight, half_gemm_far_slower, mm, upcasts


class _Precision:
    """The dtypes a GRU call runs in: ``gemm`` for the matrix products, ``acc`` for the gates and the state."""

    def __init__(self, rows: int, weight: torch.Tensor) -> None:
        self.gemm = torch.float32 if upcasts(rows, weight) else weight.dtype
        self.acc = torch.promote_types(self.gemm, torch.float32)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` computed in ``gemm``, returned in ``acc``."""
        return mm(a.to(self.gemm), b.to(self.gemm)).to(self.acc)


def _tanh(x: torch.Tensor, out: torch.Tensor, minus_one: torch.Tensor) -> None:
    """``tanh(x)`` into ``out`` (may be ``x``) as ``2 σ(2x) - 1``; ``minus_one`` is a -1 scalar tensor of their
    dtype. torch's CPU ``tanh`` took 83 us for 64 x 512 float32 values here, this 21: its ``sigmoid`` is
    vectorised. The two differ by at most a unit in the last place of 1 (float32 2e-7, float64 3e-16),
    absolute, which a GRU's state, of order 1, does not notice."""
    torch.add(minus_one, torch.mul(x, 2, out=out).sigmoid_(), alpha=2, out=out)


class _GRUSequence(torch.autograd.Function):
    """``x [T, M, H]`` (time-major), ``w_ih [3g, H]``, ``w_hh [3g, g]``, ``h0 [M, g]`` or None (zeros) -> the state
    after every step, ``[T, M, g]`` in x's dtype.

    Backward writes each step's gate gradients into one ``[T, M, 4g]`` buffer ordered ``n | r | z | gh_n``, so
    that both weights' operands are strided views of it, in the order GEMMs want them: ``n | r | z``
    (the first ``3g`` columns) for ``W_ih`` (whose rows are then taken as ``n, r, z``), and ``r | z | gh_n``
    (the last ``3g``) for ``W_hh`` in its own row order, one GEMM each for the state's gradient per
    step and for each weight's over all steps.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, h0: torch.Tensor | None) -> torch.Tensor:
        steps, rows, width = x.shape
        g = w_hh.shape[1]
        prec = _Precision(steps * rows, w_hh)
        w_ih_g, w_hh_g = w_ih.to(prec.gemm), w_hh.to(prec.gemm)
        x = x.contiguous()  # time-major rows: step t is rows t·M .. (t+1)·M
        gi = prec.mm(x.view(-1, width), w_ih_g.t()).view(steps, rows, 3 * g)
        out = gi.new_empty(steps, rows, g)
        # per step: r|z, n, and gh_n (none for a step from zeros); the state runs in acc, and W_hh's two parts are
        # held as the per-step GEMMs want them (ReusedWeight: packed for oneDNN, or transposed copies for torch's)
        rz_all, n_all, ghn_all = [], [], []
        w_rz, w_n = (ReusedWeight(w.to(prec.acc), rows) for w in (w_hh_g[:2 * g], w_hh_g[2 * g:]))
        h = None if h0 is None else h0.to(prec.acc)
        minus_one = gi.new_full((), -1.0)
        for t in range(steps):
            gi_t = gi[t]
            if h is None:  # from zeros: gh = 0, h_t = (1 - z) n
                rz = torch.sigmoid(gi_t[:, :2 * g])
                n = gi.new_empty(rows, g)
                _tanh(gi_t[:, 2 * g:], n, minus_one)
                torch.addcmul(n, rz[:, g:], n, value=-1, out=out[t])
            else:
                rz = w_rz.product(h, add=gi_t[:, :2 * g]).sigmoid_()  # r, z = σ(gi + W_hh h)
                ghn_all.append(w_n.product(h))
                n = torch.addcmul(gi_t[:, 2 * g:], rz[:, :g], ghn_all[-1])
                _tanh(n, n, minus_one)
                torch.lerp(n, h, rz[:, g:], out=out[t])  # n + z (h - n)
            rz_all.append(rz)
            n_all.append(n)
            h = out[t]
        ctx.save_for_backward(x, w_ih_g, w_hh_g, None if h0 is None else h0.to(prec.acc), out, *rz_all, *n_all,
                              *ghn_all)
        ctx.prec = prec
        ctx.dtypes = (x.dtype, w_ih.dtype, w_hh.dtype, None if h0 is None else h0.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w_ih, w_hh, h0, out, *per_step = ctx.saved_tensors
        prec = ctx.prec
        steps, rows, g = out.shape
        rz_all, n_all, ghn_all = per_step[:steps], per_step[steps:2 * steps], per_step[2 * steps:]
        first = 0 if h0 is not None else 1  # the first step with a state before it (gh_n kept from it on)
        grad_out = grad_out.to(prec.acc)
        w_state = ReusedWeight(w_hh.to(prec.acc).t(), rows)  # d h_{t-1} = d(r|z|gh_n) W_hh
        grads = out.new_empty(steps, rows, 4 * g)  # per step: d n | d r | d z (pre-activations) | d gh_n
        d = grad_out[steps - 1]  # the gradient reaching h_t: its own and, through the later steps, theirs
        dh0 = None
        for t in reversed(range(steps)):
            rz, n = rz_all[t], n_all[t]
            step = grads[t]
            h_prev = out[t - 1] if t > 0 else h0
            dn, drz, dghn = step[:, :g], step[:, g:3 * g], step[:, 3 * g:]
            torch.ops.aten.tanh_backward.grad_input(torch.addcmul(d, d, rz[:, g:], value=-1), n,
                                                    grad_input=dn)  # d (1 - z) (1 - n²)
            if h_prev is None:  # the first step from zeros: h = (1 - z) n, gh was 0, nothing flows further back
                torch.mul(d, n, out=drz[:, g:]).neg_()
                drz[:, :g] = 0
                dghn.zero_()
            else:
                torch.mul(dn, ghn_all[t - first], out=drz[:, :g])
                torch.sub(h_prev, n, out=drz[:, g:]).mul_(d)
                torch.mul(dn, rz[:, :g], out=dghn)
            torch.ops.aten.sigmoid_backward.grad_input(drz, rz, grad_input=drz)  # in place: σ' = σ (1 - σ)
            if h_prev is None:
                continue
            # the gradient reaching h_{t-1}: its own, the direct path through z, and W_hh's
            d = w_state.add_product_(torch.addcmul(grad_out[t - 1], d, rz[:, g:]) if t > 0 else d * rz[:, g:],
                                     step[:, g:])
            if t == 0:
                dh0 = d
        result: list[torch.Tensor | None] = [None, None, None, None]
        by_input = grads[..., :3 * g].reshape(-1, 3 * g)  # rows of  d n | d r | d z : W_ih's rows as n, r, z
        if ctx.needs_input_grad[0]:
            w_nrz = torch.cat([w_ih[2 * g:], w_ih[:2 * g]])
            result[0] = prec.mm(by_input, w_nrz).view(steps, rows, -1).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            nrz = prec.mm(by_input.t(), x.view(-1, x.shape[-1]))
            result[1] = torch.cat([nrz[g:], nrz[:g]]).to(ctx.dtypes[1])  # back to r, z, n
        if ctx.needs_input_grad[2]:
            # every step that had a state before it, at once: [3g, T'·M] x [T'·M, g]
            prev = (out[:-1] if h0 is None else torch.cat([h0[None], out[:-1]])).reshape(-1, g)
            result[2] = prec.mm(grads[first:, :, g:].reshape(-1, 3 * g).t(), prev).to(ctx.dtypes[2])
        if h0 is not None and ctx.needs_input_grad[3]:
            result[3] = dh0.to(ctx.dtypes[3])
        return tuple(result)


class FusedGRU(nn.GRU):
    """``nn.GRU(input_size, hidden_size, num_layers=1, bias=False, batch_first=True)`` whose CPU forward and
    backward are :class:`_GRUSequence`'s (see the module docstring); the same parameters and names.

    It stays an ``nn.GRU`` module so its parameters keep their names (``weight_ih_l0``,
    ``weight_hh_l0``) and FSDP2 gathers them when it is called.
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size, num_layers=1, bias=False, batch_first=True)

    def fused(self, input: torch.Tensor) -> bool:
        """Whether ``input`` runs the fused path: a batch of sequences on CPU whose GEMMs run in float32 or
        float64, which half precision does where the CPU has no bf16 GEMM instructions (or
        ``SPECFORGE_CPU_HALF_GEMM=fp32``): there torch's bf16 GRU is 10-40x slower. Elsewhere half
        precision stays on ``nn.GRU``: where bf16 GEMMs are native it was faster than per-step conversions
        to float32 gates, and where they run at half the float32 rate (Intel without AMX) it was about 10%
        slower than the fused path but kept a third less (the bench's Domino bf16 step: 43 MB above its
        baseline instead of 68), the fused path's gates and gradients being float32."""
        if input.device.type != "cpu" or input.dim() != 3 or input.shape[1] == 0:
            return False
        weight = self.weight_hh_l0
        return weight.dtype in (torch.float32, torch.float64) or (
            upcasts(input.shape[0] * input.shape[1], weight) and half_gemm_far_slower())

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(states [M, T, g], last [1, M, g])`` of ``input [M, T, H]`` from ``hx [1, M, g]`` (zeros if None)."""
        if not self.fused(input):
            return super().forward(input, hx)
        if hx is None:  # nn.GRU's own checks and messages (sizes, dtype)
            self.check_input(input, None)
        else:
            self.check_forward_args(input, hx, None)
        states = _GRUSequence.apply(input.transpose(0, 1), self.weight_ih_l0, self.weight_hh_l0,
                                    None if hx is None else hx[0])  # [T, M, g]
        return states.transpose(0, 1), states[-1][None]
