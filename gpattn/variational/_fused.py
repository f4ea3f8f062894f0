r"""Kernel attention through PyTorch's fused attention kernels: no (T, S) matrix, forward or backward.

A kernel with the log-linear form :math:`\kappa(q_i, k_j) = \exp(f_i + a_i \cdot b_j + c_j)`
(:func:`gpattn.kernels._evaluate.log_linear_form`: the exponential kernel, the plain or scaled ARD-RBF kernel)
has, with :math:`s_{ij} = a_i \cdot b_j + c_j` and :math:`p = \mathrm{softmax}(s)` (rows),

* normalised kernel attention :math:`\sum_j \kappa_{ij} v_j / \sum_j \kappa_{ij} = (p\, v)_i` — :math:`f`
  cancels: ``scaled_dot_product_attention`` with scale 1 (its own fused backward);
* kernel attention :math:`\sum_j \kappa_{ij} v_j = w_i\, (p\, v)_i`, :math:`w_i = \exp(f_i + \mathrm{lse}_i)`,
  :math:`\mathrm{lse}_i = \log \sum_j e^{s_{ij}}`, the log-normaliser that the fused kernels return. Its gradient
  is :math:`\partial L/\partial s_{ij} = \kappa_{ij}\, g_i \cdot v_j = p_{ij}\, (w_i g_i) \cdot v_j` and
  :math:`\partial L/\partial v_j = \sum_i p_{ij} (w_i g_i)`, :math:`\partial L / \partial f_i = w_i\, g_i \cdot
  (p v)_i`: the fused attention backward with upstream gradient :math:`w g` and its output argument set to 0
  (the backward's :math:`\delta_i = \sum_d dO_{id} O_{id}`, the softmax's normalisation term, then vanishes).

The key term :math:`c_j` and key padding enter as one more coordinate, :math:`a' = [a, 1]`,
:math:`b' = [b, c]` with :math:`c_j` a very negative number on padded keys (their weight is exactly 0 and
their gradient 0); widths are padded with zeros to a multiple of 8 (the kernels' alignment; values too, as
the CPU kernel wants one head width). The kernels: on the CPU the flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, float32 / float64 / bfloat16), on CUDA the memory-efficient
kernel (``_scaled_dot_product_efficient_attention``, float32 / float16 / bfloat16). Elsewhere — another
device, float64 on CUDA, a kernel without the form, a per-query mask — :func:`fused_kernel_attention`
returns None and the caller runs its dense (or query-block) path, the reference these are tested against
(docs/derivations.md §12).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpattn.kernels._evaluate import log_linear_form

__all__ = ["fused_available", "fused_kernel_attention", "fused_softmax"]

_FUSED_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16),
    "cuda": (torch.float32, torch.float16, torch.bfloat16),
}
_ALIGN = 8


#: the fused kernels that return the log-normaliser, per device type (an older PyTorch may lack one: the dense
#: path runs)
_FUSED_OPS = {
    "cpu": hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
    "cuda": hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention"),
}


def fused_available(t: torch.Tensor) -> bool:
    """Whether fused kernel attention runs for tensors like ``t`` (its device type and dtype, and the installed
    PyTorch's kernels)."""
    return _FUSED_OPS.get(t.device.type, False) and t.dtype in _FUSED_DTYPES.get(t.device.type, ())


def fused_kernel_attention(kernel, q, k, v, pad=None, *, normalise: bool = False) -> torch.Tensor | None:
    """:math:`\\sum_j \\kappa(q_i, k_j) v_j` over the keys not in ``pad`` (``normalise``: divided by
    :math:`\\sum_j \\kappa(q_i, k_j)`) through fused attention, or None where this path does not run (a kernel
    without the log-linear form, a device or dtype without a fused kernel): the caller then evaluates the kernel.
    # shape: q (B, H, T, Dh), k (B, H, S, Dh), v (B, H, S, Dv), pad (B, S) bool (True = padding) or None
    # -> (B, H, T, Dv)"""
    form = log_linear_form(kernel, q, k)
    if form is None or not fused_available(form[0]):
        return None
    a, b, f, c = form
    if normalise:
        return fused_softmax(a, b, v, pad, key_bias=c)
    a, b, vv = _augmented(a, b, c, v.to(a.dtype), pad)
    return _ExpAttention.apply(a, b, vv, f)[..., : v.shape[-1]]


def fused_softmax(a, b, v, pad=None, *, key_bias=None) -> torch.Tensor | None:
    r""":math:`\mathrm{softmax}_j(a_i \cdot b_j + c_j)\, v` over the keys not in ``pad`` (``key_bias`` c, or 0) through
    ``scaled_dot_product_attention`` with scale 1 (its own fused backward), or None where no fused kernel runs for
    ``a`` (device, dtype, installed PyTorch). A query whose keys are all padded averages the padded keys' values.
    # shape: a (B, H, T, d), b (B, H, S, d), v (B, H, S, Dv), pad (B, S) bool or None, key_bias (B, H, S) or None
    # -> (B, H, T, Dv)"""
    if not fused_available(a):
        return None
    a, b, vv = _augmented(a, b, key_bias, v.to(a.dtype), pad)
    return F.scaled_dot_product_attention(a, b, vv, scale=1.0)[..., : v.shape[-1]]


def _augmented(a, b, c, v, pad):
    """``(a', b', v')``: the key term and padding as one more coordinate (when there is one), every width
    zero-padded to one multiple of :data:`_ALIGN`.  # shape: a (B, H, T, d), b (B, H, S, d), c (B, H, S) or None"""
    if pad is not None:
        c = (b.new_zeros(()) if c is None else c).expand(b.shape[:-1])
        c = c.masked_fill(pad[:, None, :], torch.finfo(b.dtype).min / 4)  # weight exp(-huge) = 0 exactly
    if c is not None:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1)
        b = torch.cat([b, c[..., None]], -1)
    width = -(-max(a.shape[-1], v.shape[-1]) // _ALIGN) * _ALIGN
    return [t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (a, b, v)]


def _forward(a, b, v):
    """``(p v, lse, state)`` of the fused kernel with scale 1 (``state``: what its backward needs besides).
    # shape: a (B, H, T, d), b, v (B, H, S, d) -> (B, H, T, d), (B, H, T)"""
    if a.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(a, b, v, 0.0, False, scale=1.0)
        return out, lse, (lse,)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        a, b, v, None, True, 0.0, False, scale=1.0
    )
    return out, lse[..., : a.shape[-2]], (lse, seed, offset)  # CUDA pads lse's T to a multiple of 32


def _backward(grad, a, b, v, state):
    """The fused backward's ``(da, db, dv)`` for upstream ``grad`` with the output argument 0 (module docstring)."""
    zero = torch.zeros_like(grad)
    if a.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, a, b, v, zero, state[0], 0.0, False, scale=1.0
        )
    lse, seed, offset = state
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, a, b, v, None, zero, lse, seed, offset, 0.0, [True, True, True, False], False, scale=1.0
    )[:3]


class _ExpAttention(torch.autograd.Function):
    """:math:`\\sum_j \\exp(f_i + a_i \\cdot b_j) v_j` in one fused forward and one fused backward."""

    @staticmethod
    def forward(ctx, a, b, v, f):
        a, b, v = a.contiguous(), b.contiguous(), v.contiguous()
        out, lse, state = _forward(a, b, v)
        w = torch.exp(f + lse)  # shape: (B, H, T)
        ctx.save_for_backward(a, b, v, out, w, *state)
        return out * w[..., None]

    @staticmethod
    def backward(ctx, grad):
        a, b, v, out, w, *state = ctx.saved_tensors
        grad = grad.contiguous()
        da, db, dv = _backward((grad * w[..., None]).contiguous(), a, b, v, state)
        return da, db, dv, (grad * out).sum(-1) * w
