"""The public spelling of the prior means (docs/derivations.md §5c, §5e, §6, §7a): each variant's ``prior_mean=``
names, parsed once where a variant is built into the mean modules of :mod:`gpattn.variational.means`.

The strategies and conditionals of :mod:`gpattn.variational` receive the modules and never read a name: a new form
is a new module there and one more entry here.
"""

from __future__ import annotations

import torch.nn as nn

from gpattn.variational.means import (
    AttentionMean,
    CorrelatedSoftmaxMean,
    KEPSeparateSoftmaxMean,
    KEPSoftmaxMean,
    SoftmaxMean,
    ZeroMean,
)

__all__ = [
    "CGP_PRIOR_MEANS",
    "KEP_PRIOR_MEANS",
    "PRIOR_MEANS",
    "RFF_PRIOR_MEANS",
    "check_prior_mean",
    "make_correlated_mean",
    "make_kep_mean",
    "make_prior_mean",
]

#: the prior means of the SGPA variants: normalised kernel attention (default), softmax attention with the
#: kernel's temperature, or zero (the papers')
PRIOR_MEANS = ("attention", "softmax", "zero")
#: the prior means of ``sgpa-rff``: the attention is its mean (the zero mean would leave no attention)
RFF_PRIOR_MEANS = ("attention", "softmax")
#: the prior means of ``cgp`` and ``scgp`` (docs/derivations.md §7a): softmax attention of the canonical inputs over
#: the GP's values or over values of its own (``mean_values``), or the papers' zero mean
CGP_PRIOR_MEANS = ("softmax", "softmax-separate", "zero")
#: the prior means of kep-svgp's head output (docs/derivations.md §6): Chen et al.'s zero, softmax attention over
#: values of the layer's own (:class:`~gpattn.variational.means.KEPSoftmaxMean`), or with queries and keys of its
#: own too (:class:`~gpattn.variational.means.KEPSeparateSoftmaxMean`)
KEP_PRIOR_MEANS = ("zero", "softmax", "softmax-separate")

#: what each of the SGPA variants' prior means is, for the error message
_SGPA_MEANS = (
    "'attention': normalised kernel attention as the GP's prior mean, docs/derivations.md §5c; 'softmax': softmax "
    "attention with the kernel's lengthscale, §5e; 'zero': the paper's form"
)


def check_prior_mean(prior_mean, choices: tuple[str, ...] = PRIOR_MEANS, meanings: str = _SGPA_MEANS) -> str:
    """``prior_mean`` must be one of ``choices`` (default :data:`PRIOR_MEANS`, the SGPA variants'); the error lists them
    with their ``meanings``."""
    if prior_mean not in choices:
        raise ValueError(f"prior_mean must be one of {list(choices)} ({meanings}), got {prior_mean!r}")
    return prior_mean


def make_prior_mean(prior_mean, kernel) -> nn.Module:
    """The ``mean_module`` of a prior mean name (:data:`PRIOR_MEANS`) for a strategy with ``kernel`` (a module is
    returned as it is): :class:`~gpattn.variational.means.ZeroMean` for the papers' zero mean; ``"softmax"`` needs a
    kernel with a lengthscale (a ``ValueError`` here, not at a forward)."""
    if isinstance(prior_mean, nn.Module):
        return prior_mean
    mean = {"attention": AttentionMean, "softmax": SoftmaxMean, "zero": ZeroMean}[check_prior_mean(prior_mean)]()
    mean.check_kernel(kernel)
    return mean


def make_correlated_mean(prior_mean) -> nn.Module:
    """The ``mean_module`` of a correlated GP's prior mean name (:data:`CGP_PRIOR_MEANS`); a mean module is returned
    as it is."""
    if isinstance(prior_mean, nn.Module):
        return prior_mean
    check_prior_mean(
        prior_mean, CGP_PRIOR_MEANS, "'softmax': softmax attention of the canonical inputs as the prior mean of "
        "z_q and z_k, docs/derivations.md §7a; 'softmax-separate': the same over values of its own; 'zero': the "
        "paper's form",
    )
    return {
        "softmax": lambda: CorrelatedSoftmaxMean(),
        "softmax-separate": lambda: CorrelatedSoftmaxMean(separate=True),
        "zero": ZeroMean,
    }[prior_mean]()


def make_kep_mean(prior_mean) -> nn.Module:
    """The mean module of a kep-svgp prior mean name (:data:`KEP_PRIOR_MEANS`); a module is returned as it is."""
    if isinstance(prior_mean, nn.Module):
        return prior_mean
    check_prior_mean(
        prior_mean, KEP_PRIOR_MEANS, "'zero': Chen et al.'s; 'softmax': softmax attention over values of the layer's "
        "own, the pretrained attention in an encoder swap, docs/derivations.md §6; 'softmax-separate': the same with "
        "queries and keys of its own, apart from the KSVD features'",
    )
    return {"softmax": KEPSoftmaxMean, "softmax-separate": KEPSeparateSoftmaxMean, "zero": ZeroMean}[prior_mean]()
