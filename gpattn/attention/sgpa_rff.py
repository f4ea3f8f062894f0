"""Distance-aware SGPA (docs/derivations.md §5f): a thin shim over :mod:`gpattn.variational.sgpa_rff`."""

from __future__ import annotations

from gpytorch.kernels import Kernel

from gpattn.attention.registry import register, resolve
from gpattn.attention.sgpa import SeparateMaps, _kernel, _SGPALayer
from gpattn.variational.sgpa_rff import FeatureSGPAVariationalStrategy

__all__ = ["DistanceAwareSGPAttention", "SeparateMapsDistanceAwareSGPAttention"]


@register("sgpa-rff")
class DistanceAwareSGPAttention(_SGPALayer):
    r"""SGPA whose predictive variance grows away from the training queries (docs/derivations.md §5f): each head's
    output is the attention prior mean m(q) (as ``sgpa``'s default) plus a global GP g(q) on the query space, an RBF
    kernel through ``num_features`` random Fourier features, whose posterior covariance is conditioned on the
    queries seen in training (a running second moment, a buffer updated in training mode).

    :param kernel: the prior mean's kernel (as for ``sgpa``: ``"ard-rbf"`` by default, lengthscale Dh^¼).
    :param num_features: R random features per head (default 256).
    :param prior_variance: σ², g's prior variance at every query, on the LayerNorm-ed stream's scale (default 1: away
        from the data the noise is as large as the stream; ``scale_prior`` multiplies it, as
        ``match_prior_to_stream`` does in an encoder swap).
    :param lengthscale: ℓ of g's RBF kernel (default: the covariance's own, √(Dh/3) on the queries: κ = e⁻¹ at the
        typical distance of two queries of the default initialisation; the encoder-swap recipe starts it at 1 and
        ``match_prior_to_stream`` sets it by the median heuristic).
    :param prior_mean: ``"attention"`` (default), or a prior mean module (the encoder-swap recipe's is the softmax
        mean, the pretrained attention).
    :param covariance: g's covariance: ``"query"`` (default: g on each query, per head,
        :class:`~gpattn.variational.covariances.TrainingQueryCovariance`), or a covariance class (or factory) called
        with ``(num_heads, head_dim, num_features=, lengthscale=, prior_variance=, frequency_draw=)``; the
        out-of-scope recipe's is g on each sequence's unit mean query
        (:class:`~gpattn.variational.covariances.TrainingSequenceCovariance`, docs/derivations.md §5f), which
        takes key padding, not per-query (causal) masks.
    :param frequencies: how the features' frequencies Ω are drawn: ``"gaussian"`` (default: i.i.d. N(0, 1),
        :class:`~gpattn.variational.frequencies.GaussianFrequencies`), ``"orthogonal"`` (orthogonal random features,
        Yu et al. 2016, :class:`~gpattn.variational.frequencies.OrthogonalFrequencies`: the same kernel, unbiased,
        with a lower variance at equal R; docs/derivations.md §5f, "Choice: the frequencies' draw"), or the draw
        object itself; the covariance receives it as ``frequency_draw=``.
    :param jitter: absolute jitter of ``posterior()``'s covariance.

    Loss terms: ``kl_global`` (q(β)'s KL, ÷ N). Masks: any ``attn_mask`` (the prior mean attends over A_i; g
    ignores masks). Cross-attention: key padding.
    """

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
        prior_mean: str = "attention",
        covariance: str = "query",
        frequencies: str = "gaussian",
        jitter: float = 1e-6,
        **base,
    ):
        mean_module = resolve("sgpa-rff", "prior_mean", prior_mean)
        covariance = resolve("sgpa-rff", "covariance", covariance)
        frequency_draw = resolve("sgpa-rff", "frequencies", frequencies)
        super().__init__(embed_dim, num_heads, **base)
        # the covariance object is the form: its input's width, its default lengthscale and its masks are its own
        covariance = covariance(
            num_heads, self.head_dim, num_features=num_features, prior_variance=prior_variance, lengthscale=lengthscale,
            frequency_draw=frequency_draw,
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


@register("sgpa-rff", form="separate-maps")
class SeparateMapsDistanceAwareSGPAttention(SeparateMaps, DistanceAwareSGPAttention):
    """``sgpa-rff`` with separate query and key maps (:class:`~gpattn.attention.sgpa.SeparateMaps`): the encoder-swap
    and out-of-scope recipes' form; g reads the queries W_q x."""
