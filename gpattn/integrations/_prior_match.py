"""A swapped GP layer's prior matched to the pretrained stream, the per-layer step of
:meth:`~gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream`
(docs/derivations.md §7, §9). Split from :mod:`gpattn.integrations.huggingface`."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["MEDIAN_KEY_DISTANCE"]


#: the median squared distance between a swapped cgp/scgp layer's canonical keys after
#: :meth:`~gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream`
#: (κ_o = e⁻¹ at the median pair; docs/derivations.md §7)
MEDIAN_KEY_DISTANCE = 2.0


def _match_layer(layer: nn.Module, x: torch.Tensor, key_padding_mask, gain: float) -> dict:
    """Scale one swapped GP layer's prior to its input ``x`` (B, T, D) (and cgp/scgp's canonical inputs by the
    median heuristic): the row of
    :meth:`~gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream` for it, without the layer index."""
    from gpattn.variational._scale import NATIVE_OUTPUT_GAIN

    real = x if key_padding_mask is None else x[~key_padding_mask.to(x.device)]
    variance = float(real.double().pow(2).mean())
    # a layer whose GP output already scales with its input's amplitude (kep-svgp) needs the output map's gain alone
    factor = (1.0 if getattr(layer, "scales_with_input", False) else variance) * NATIVE_OUTPUT_GAIN / gain
    layer.scale_prior(factor)
    row = {"stream_variance": variance, "out_gain": gain, "factor": factor}
    if hasattr(layer, "rescale_inputs"):  # cgp, scgp: their canonical kernel has no lengthscale
        with torch.no_grad():
            median = _median_key_distance(layer, x, key_padding_mask)
        row.update(key_distance=median, input_factor=(MEDIAN_KEY_DISTANCE / median) ** 0.5)
        layer.rescale_inputs(row["input_factor"])
    if hasattr(layer, "match_singular_values"):  # kep-svgp: its KSVD term starts at 0 on this stream
        with torch.no_grad():
            row["ksvd_before"], row["ksvd_after"] = layer.match_singular_values(x, key_padding_mask)
    return row


def _median_key_distance(layer: nn.Module, x: torch.Tensor, key_padding_mask) -> float:
    """The median of ‖k_i − k_j‖² over the heads and the pairs of distinct real tokens of one sequence, k the
    canonical keys of a correlated-GP layer (``strategy_inputs``, input scale applied).  # shape: x (B, T, D)"""
    # the inputs of the layer's distances: its queries (distance_inputs) or, by default, the canonical keys
    k = (layer.distance_inputs(x) if hasattr(layer, "distance_inputs") else layer.strategy_inputs(x)[1]).double()
    B, T = k.shape[0], k.shape[2]
    real = torch.ones(B, T, dtype=torch.bool, device=k.device)
    if key_padding_mask is not None:
        real = ~key_padding_mask.to(k.device)
    pairs = real[:, :, None] & real[:, None, :] & ~torch.eye(T, dtype=torch.bool, device=k.device)
    if not bool(pairs.any()):
        raise ValueError("inputs: no sequence with two real tokens to set cgp/scgp's input scale on")
    distances = torch.cdist(k, k).pow(2).transpose(0, 1)[:, pairs]  # (H, pairs)
    return float(distances.median())
