"""Kernel attention baselines, symmetric and asymmetric (docs/derivations.md §2; Bui et al. §2.3,
Chen & Li (2023) §3.1)."""

from __future__ import annotations

from gpytorch.kernels import Kernel

from gpattn.attention._call import Attended
from gpattn.attention.base import AttentionBase, excluded_keys
from gpattn.attention.registry import register
from gpattn.kernels import evaluate_kernel, make_kernel
from gpattn.variational._blockwise import block_rows, blockwise
from gpattn.variational._fused import fused_kernel_attention
from gpattn.variational._linalg import gp_algebra

__all__ = ["AsymmetricKernelAttention", "KernelAttention"]


@register("kernel")
class KernelAttention(AttentionBase):
    r"""Unnormalised kernel attention :math:`\text{out} = K_{qk} v` with :math:`K_{qk} = \kappa(q, k)`.

    Symmetric: one projection :math:`W_q = W_k` ("qk"), so :math:`K_{qq}` is a Gram matrix.
    Padded keys get zero kernel columns (excluded keys of an ``attn_mask``: zero entries).

    :param kernel: a kernel spec (:mod:`gpattn.kernels`): ``"exponential"`` (default), ``"ard-rbf"``, a
        composition, or a gpytorch ``Kernel`` (batch_shape ``(H,)`` or
        ``()``, ``ard_num_dims`` = Dh; checked here).
    """

    projections = ("qk", "v")
    per_query_masks = True  # any attn_mask: excluded keys leave the row (docs/derivations.md §11)
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)
    fused_key_padding = True  # an attn_mask that only pads takes the fused path (docs/derivations.md §12)

    def __init__(self, embed_dim: int, num_heads: int, *, kernel: str | dict | Kernel = "exponential", **base):
        super().__init__(embed_dim, num_heads, **base)
        self.kernel = make_kernel(kernel, num_heads, self.head_dim)

    def _queries_keys(self, pq, pk):
        """The queries (of x) and keys (of x, or of the context in cross-attention)."""
        return pq["qk"], pk["qk"]

    def _attend(self, call):
        pq, pk = self.project_call(call)
        q, k = self._queries_keys(pq, pk)
        if not call.need_weights and (call.mask is None or call.mask.dim() == 2):  # key padding or none
            with gp_algebra(call.x.device.type):  # fused attention, no (T, S) matrix (docs/derivations.md §12)
                out = fused_kernel_attention(self.kernel, q, k, pk["v"], call.mask)
            if out is not None:
                return out
        rows = None if call.need_weights else block_rows(*q.shape[:3], k.shape[-2], device=q.device)
        if rows is not None:  # a long sequence: blocks of queries, memory linear in T (variational/_blockwise.py)
            return blockwise(self._kernel_values, q, k, pk["v"], rows=rows, per_query=(excluded_keys(call.mask),))
        with gp_algebra(call.x.device.type):
            K = evaluate_kernel(self.kernel, q, k)  # shape: (B, H, T, S)
        if call.mask is not None:
            K = K.masked_fill(excluded_keys(call.mask), 0.0)
        return Attended(K @ pk["v"], weights=K if call.need_weights else None)

    def _kernel_values(self, q, k, v, excluded=None):
        """K(q, k) v for one block of queries, excluded keys at 0.  # shape: q (B, H, b, Dh) -> (B, H, b, Dv)"""
        with gp_algebra(q.device.type):
            K = evaluate_kernel(self.kernel, q, k)  # shape: (B, H, b, S)
        return (K if excluded is None else K.masked_fill(excluded, 0.0)) @ v


@register("kernel-asym")
class AsymmetricKernelAttention(KernelAttention):
    r"""Kernel attention with separate :math:`W_q \ne W_k`: :math:`K_{qk}` is not symmetric."""

    projections = ("q", "k", "v")

    def _queries_keys(self, pq, pk):
        return pq["q"], pk["k"]
