"""KEP-SVGP attention: the registered shim over ``gpattn.variational.kep_svgp`` (docs/derivations.md §6;
Chen et al. (2024))."""

from __future__ import annotations

import torch

from gpattn.attention._gp import GPAttention
from gpattn.attention.registry import register, resolve
from gpattn.variational._scale import KEP_PRIOR_VARIANCE
from gpattn.variational.kep_svgp import KEPSVGP, MERGES

__all__ = ["KEPSVGPAttention"]


#: the only kernel of KEP-SVGP: κ(q, k) = φ(q)·φ(k) with the cosine feature map φ(t) = t / ‖t‖
KEP_KERNEL = "cosine"


def _check_kernel(kernel) -> None:
    """``kernel=`` of kep-svgp: only the cosine kernel, whose feature map the primal KSVD needs."""
    if kernel != KEP_KERNEL and kernel != {"name": KEP_KERNEL}:
        got = f"a {type(kernel).__name__} instance" if isinstance(kernel, torch.nn.Module) else repr(kernel)
        raise ValueError(
            f"kep-svgp takes only kernel={KEP_KERNEL!r} (kappa(q, k) = phi(q).phi(k), phi(t) = t/|t|), got {got}: "
            f"its KSVD is solved in the primal, e = phi(q) W_e with W_e = X omega_e built from landmark tokens in "
            f"the Dh-wide space of an explicit feature map phi (docs/derivations.md §6), while a gpytorch kernel "
            f"or a kernel spec gives only the values kappa(q, k); use sgpa or sgpa-decoupled for another kernel"
        )


def _positive_int(name, val):
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")


@register("kep-svgp")
class KEPSVGPAttention(GPAttention):
    r"""Kernel-eigen pair SVGP attention (Chen, Tao, Tonin, Suykens, ICML 2024; Chen et al. (2024) eqs. 10–21).

    Per head: cosine features :math:`\phi(q), \phi(k)`, primal KSVD projections
    :math:`e = \phi(q)\tilde X\omega_e`, :math:`r = \phi(k)\tilde X\omega_r` from s landmark tokens,
    singular values :math:`\Lambda`, and r output SVGPs with inducing features,

    .. math::
        f_c = G \Lambda^{-1} u_c,\quad u_c \sim q(u_c) = N(m_c, L_c L_c^\top),\quad
        p(u_c) = N(0, \Lambda^2),\quad G = e + r \ (\text{add}) \text{ or } A_e e + A_r r \ (\text{concat}),

    then a linear map r → Dv per head and :math:`W_o`, added to the prior mean (by default softmax attention over
    values of the layer's own). Only :math:`\Lambda` (diagonal) is inverted; cost O(T·Dh·r + T·r²) per head for the
    GP, linear in T, plus the mean's O(T²·Dh) attention (none with ``prior_mean="zero"``, Chen et al.'s form). The
    math and its derivation notes are in :class:`gpattn.variational.kep_svgp.KEPSVGP`.

    Projections: q and k (the GP's output is built from the KSVD features, no values), and the mean's ``v_mean``.
    Loss terms: ``kl_global`` = :math:`\sum_{h,c} KL(q(u_c) \| N(0, \Lambda^2))` (dataset level: the
    objective divides it by N), ``ksvd`` = :math:`J^2`, the released KSVD objective
    (:func:`gpattn.variational.kep_svgp.ksvd_objective`; the objective multiplies it by η).

    Chen et al. (2024) §5 replaces only the *last* layer of a transformer by KEP-SVGP; the models' presets use
    ``attention_layers="last"`` for it.

    :param kernel: ``"cosine"``, the only kernel whose feature map KEP-SVGP's primal KSVD has (any
        other value is a ``ValueError`` that says why).
    :param rank: r, number of KSVD features / inducing features / output GPs (10: the released
        CIFAR and IMDB setting; CoLA used 5).
    :param num_landmarks: s, landmark tokens for :math:`W = \tilde X\omega` (default ``10 * rank``, the
        released ``rank_multi = 10``): s evenly spaced *real* tokens of each sequence (padding never,
        repeated when the sequence has fewer than s real tokens), see
        :func:`gpattn.variational.kep_svgp.landmark_indices`.
    :param merge: ``"add"`` (variable length; default) or ``"concat"`` (needs ``seq_len``; a learned
        map 2T → T; any other T raises ``ValueError``): Chen et al.'s two merges of the pair's branches (eq. 19).
    :param seq_len: the fixed T of ``merge="concat"``.
    :param prior_variance: σ², the outputscale of the attention kernel, so that :math:`p(u_c) = N(0, σ^2\Lambda^2)`
        (the mean map :math:`G\Lambda^{-1}` does not change); 1.0 is Chen et al.'s (2024) prior, the default puts
        the prior's noise on the stream's scale (docs/derivations.md §6, "The prior's outputscale").
        ``scale_prior`` multiplies it.
    :param prior_mean: ``"softmax"`` (default): softmax(q kᵀ/√Dh) u over values of the layer's own (the ``v_mean``
        projection), added to the GP's mean and samples, with the GP's mean starting at 0 (q(u_c)'s mean and the
        output bias zero) — in an encoder swap the mean starts at the pretrained attention; from scratch it kept
        CoLA's NLL at or below softmax's where the paper's form overfits (docs/derivations.md §6, "The softmax prior
        mean"). ``"softmax-separate"``: the same with queries and keys of its own (the ``q_mean``, ``k_mean``
        projections), apart from the KSVD features' (docs/derivations.md §6, "The mean's own queries and keys").
        ``"zero"``: Chen et al.'s form (no values path). Or a prior mean module (:mod:`gpattn.variational.means`).
    :param jitter: constant diagonal added to the covariance that ``posterior()`` returns (makes it
        non-singular for ``log_prob``); samples and means never include it.
    """

    projections = ("q", "k")
    #: the GP's output is proportional to the input's amplitude (its features read the landmark tokens of x), so
    #: ``match_prior_to_stream`` scales it by the output map's gain alone (docs/derivations.md §6)
    scales_with_input = True
    no_cross_attention = (
        "its output at token t is f_e(q_t) + f_r(k_t), the query-side and key-side GPs of the same token t "
        "(Chen et al. 2024 eq. 19; the keys of other tokens enter only through the landmark tokens), so the "
        "queries and keys must be the same tokens (docs/derivations.md §13). Use sgpa, sgpa-decoupled, cgp or "
        "scgp for GP cross-attention"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict = KEP_KERNEL,
        rank: int = 10,
        num_landmarks: int | None = None,
        merge: str = "add",
        seq_len: int | None = None,
        jitter: float = 1e-6,
        prior_variance: float = KEP_PRIOR_VARIANCE,
        prior_mean: str = "softmax",
        **base,
    ):
        mean_module = resolve("kep-svgp", "prior_mean", prior_mean)
        # the mean's own projections (its values; its queries and keys), before AttentionBase sizes the fused in_proj
        self.projections = (*type(self).projections, *mean_module.projections)
        super().__init__(embed_dim, num_heads, **base)
        _check_kernel(kernel)
        _positive_int("rank", rank)
        if num_landmarks is None:
            num_landmarks = 10 * rank
        _positive_int("num_landmarks", num_landmarks)
        _check_merge(merge, seq_len)
        _check_scales(jitter, prior_variance)
        self.strategy = self._strategy(
            rank=rank,
            num_landmarks=num_landmarks,
            merge=merge,
            seq_len=seq_len,
            jitter=float(jitter),
            prior_variance=float(prior_variance),
            mean_module=mean_module,
        )

    def _strategy(self, **options) -> KEPSVGP:
        """The layer's strategy with ``options`` (a subclass may add the strategy's other settings)."""
        return KEPSVGP(self.num_heads, self.head_dim, self.value_dim, **options)

    @property
    def jitter(self) -> float:
        return self.strategy.jitter

    def strategy_inputs(self, x):
        """The layer input (for the landmarks), q and k.  # shape: (B, T, D), (B, H, T, Dh), (B, H, T, Dh)"""
        return self.strategy_call(x)[0]

    def strategy_call(self, x):
        """The layer input, q and k, and the mean's own projections as ``mean_values`` (the ``v_mean`` values, with
        ``"softmax-separate"`` its queries, keys and values; none for the zero mean): one projection of x for both."""
        p = self.project(x)
        return (x, p["q"], p["k"]), {"mean_values": tuple(p[name] for name in self.strategy.mean_module.projections)}

    def match_singular_values(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> tuple:
        """Λ from a batch of this layer's inputs so that the KSVD objective J starts at 0 on them, the function, its
        prior and the KL unchanged (:meth:`gpattn.variational.kep_svgp.KEPSVGP.match_singular_values`); the step of
        :meth:`gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream` for kep-svgp. Returns J before
        and after.  # shape: x (B, T, D), key_padding_mask (B, T) bool (True = padding) or None"""
        x, q, k = self.strategy_inputs(x)
        return self.strategy.match_singular_values(x, q, k, key_padding_mask)

    def extra_repr(self) -> str:
        k = self.strategy
        return (
            f"{super().extra_repr()}, rank={k.rank}, num_landmarks={k.ksvd.num_landmarks}, merge={k.merge!r}"
            + (f", seq_len={k.seq_len}" if k.merge == "concat" else "")
            + f", prior_variance={float(k.prior_variance):g}, prior_mean={k.mean_module.name!r}"
        )


def _check_merge(merge, seq_len) -> None:
    """``merge`` one of :data:`MERGES`; ``seq_len`` a positive int with ``"concat"`` and None otherwise."""
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if merge == "concat":
        if seq_len is None:
            raise ValueError("merge='concat' needs seq_len (the fixed number of tokens T), got None")
        _positive_int("seq_len", seq_len)
    elif seq_len is not None:
        raise ValueError(f"seq_len is only used with merge='concat' (merge={merge!r}), got seq_len={seq_len!r}")


def _check_scales(jitter, prior_variance) -> None:
    """``jitter`` ≥ 0 and ``prior_variance`` > 0."""
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not jitter >= 0:
        raise ValueError(f"jitter must be a float >= 0, got {jitter!r}")
    if isinstance(prior_variance, bool) or not isinstance(prior_variance, (int, float)) or not prior_variance > 0:
        raise ValueError(f"prior_variance must be a float > 0 (1.0: Chen et al.'s prior), got {prior_variance!r}")
