"""float64 references shared by test_sto.py and test_h_sto.py (not a test module: no ``test_`` prefix),
computed straight from a layer's fused input projection and its output projection."""

import torch


def heads_float64(layer, x):
    """float64 per-head q, k, v from the layer's fused projection.  # shape: (B, T, D) -> 3 x (B, H, T, Dh)"""
    W, b = layer.in_proj.weight.detach().double(), layer.in_proj.bias.detach().double()
    B, T, D = x.shape
    qkv = x.double() @ W.T + b
    return [t.reshape(B, T, layer.num_heads, -1).transpose(1, 2) for t in qkv.split(D, dim=-1)]


def out_float64(layer, heads: torch.Tensor) -> torch.Tensor:
    """W_o applied to per-head outputs, float64.  # shape: (B, H, T, Dv) -> (B, T, D)"""
    B, H, T, Dv = heads.shape
    W, b = layer.out_proj.weight.detach().double(), layer.out_proj.bias.detach().double()
    return heads.transpose(1, 2).reshape(B, T, H * Dv) @ W.T + b
