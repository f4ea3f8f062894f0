"""Distance-aware SGPA (docs/derivations.md §5f): a thin shim over :mod:`gpattn.variational.sgpa_rff`."""

from __future__ import annotations

from gpytorch.kernels import Kernel

from gpattn.attention.registry import register, resolve
from gpattn.attention.sgpa import _kernel, _QueryKeyMaps
from gpattn.variational.sgpa_rff import FeatureSGPAVariationalStrategy

__all__ = ["DistanceAwareSGPAttention"]


@register("sgpa-rff")
class DistanceAwareSGPAttention(_QueryKeyMaps):
    r"""SGPA whose predictive variance grows away from the training queries (docs/derivations.md §5f): each head's
    output is the attention prior mean m(q) (as ``sgpa``'s default) plus a global GP g(q) on the query space, an RBF
    kernel through ``num_features`` random Fourier features, whose posterior covariance is conditioned on the
    queries seen in training (a running second moment, a buffer updated in training mode).

    :param kernel: the prior mean's kernel (as for ``sgpa``: ``"ard-rbf"`` by default, lengthscale Dh^¼).
    :param num_features: R random features per head (default 256).
    :param prior_variance: σ², g's prior variance at every query, on the LayerNorm-ed stream's scale (default 1: away
        from the data the noise is as large as the stream; ``scale_prior`` multiplies it).
    :param lengthscale: ℓ of g's RBF kernel on the queries (default √(Dh/3): κ = e⁻¹ at the typical distance of
        two queries of the default initialisation; an encoder swap sets it by the median heuristic); with
        ``gp_input="sequence"`` on the unit sphere (default 0.4).
    :param gp_input: g's input: ``"query"`` (default: each query, per head) or ``"sequence"`` (each sequence's unit
        mean query over its real tokens and all heads: one value of g per sequence and head, the same at each
        token; docs/derivations.md §5f). The sequence form takes key padding, not per-query (causal) masks: its
        input pools every token of the sequence.
    :param data_weight: w in Σ⁻¹ = I + w E[ψψᵀ] (default 1000).
    :param momentum: the running second moment's weight of a new training batch (default 0.01).
    :param prior_mean: ``"attention"`` (default) or ``"softmax"`` (the encoder swap's: the pretrained attention).
    :param qk: ``"shared"`` (default) or ``"separate"`` (docs/derivations.md §5d).
    :param jitter: absolute jitter of ``posterior()``'s covariance.

    Loss terms: ``kl_global`` (q(β)'s KL, ÷ N). Masks: any ``attn_mask`` with ``qk="shared"`` (the prior mean
    attends over A_i; g ignores masks). Cross-attention: key padding.
    """

    projections = ("qk", "v")
    per_query_masks = True
    cross_attention = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel | None = None,
        num_features: int = 256,
        prior_variance: float = 1.0,
        lengthscale: float | None = None,
        data_weight: float = 1000.0,
        momentum: float = 0.01,
        prior_mean: str = "attention",
        qk: str = "shared",
        gp_input: str = "query",
        jitter: float = 1e-6,
        **base,
    ):
        mean_module = resolve("sgpa-rff", "prior_mean", prior_mean)
        covariance = resolve("sgpa-rff", "gp_input", gp_input)
        super().__init__(embed_dim, num_heads, qk, **base)
        self.gp_input = gp_input
        # the covariance object is the form: its input's width, its default lengthscale and its masks are its own
        covariance = covariance(
            num_heads, self.head_dim, num_features=num_features, prior_variance=prior_variance,
            lengthscale=lengthscale, data_weight=data_weight, momentum=momentum,
        )
        self.per_query_masks = covariance.per_query_masks
        self.strategy = FeatureSGPAVariationalStrategy(
            _kernel(kernel, num_heads, self.head_dim, mean_module), covariance, self.value_dim,
            mean_module=mean_module, jitter=jitter,
        )

    def rescale_inputs(self, factor: float) -> None:
        """The queries' distances scaled by ``factor``: g's lengthscale ℓ ← ℓ / factor (an encoder swap's
        median heuristic, gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream)."""
        self.strategy.covariance.rescale_inputs(factor)

    def distance_inputs(self, x):
        """The inputs whose distances g's kernel measures: the queries.  # shape: x (B, T, D) -> (B, H, T, Dh)"""
        return self.query_inputs(x)
