"""The two records an attention layer keeps of its last forward, the only state a forward writes on a
layer, both in one holder the layer keeps (:class:`LastForward`, whose dicts each forward replaces): its loss
terms, as GPyTorch added loss terms (:meth:`ForwardRecords.set_loss_terms`, read by
:class:`gpattn.objectives.DeepGPELBO`), and a GP variant's output-scale diagnostics (written by
:func:`gpattn.attention._call.finish_call`, read by :meth:`ForwardRecords.diagnostics`).
"""

from __future__ import annotations

import gpytorch
import torch

from gpattn.objectives import GPLossTerm, LossTermWalkers, summed_loss_terms

__all__ = ["ForwardRecords", "LastForward"]


class LastForward:
    """The holder of a layer's two records, the one object a forward writes into: ``terms`` (loss-term name ->
    term, GPyTorch's ``_added_loss_terms``) and ``diagnostics`` (name -> detached 0-dim tensor)."""

    def __init__(self, terms: dict | None = None, diagnostics: dict | None = None) -> None:
        self.terms: dict[str, GPLossTerm | None] = {} if terms is None else terms
        self.diagnostics: dict[str, torch.Tensor] = {} if diagnostics is None else diagnostics


class ForwardRecords(LossTermWalkers):
    """The records of the last forward, mixed into :class:`gpattn.attention.AttentionBase` (whose
    ``__init__`` creates them with ``_init_records`` and whose every forward starts with
    :meth:`_clear_records`)."""

    # GPyTorch's added-loss-term protocol (gpytorch.Module's own functions): the layer stays a plain
    # nn.Module, since gpytorch.Module.__call__ bypasses nn.Module's hooks and admits only tensor outputs
    register_added_loss_term = gpytorch.Module.register_added_loss_term
    update_added_loss_term = gpytorch.Module.update_added_loss_term

    def _init_records(self) -> None:
        self._last_forward = LastForward()

    @property
    def _added_loss_terms(self) -> dict[str, GPLossTerm | None]:
        """GPyTorch's registry of added loss terms (read by its walkers): the last forward's."""
        return self._last_forward.terms

    @property
    def _diagnostics(self) -> dict[str, torch.Tensor]:
        """The last training-mode forward's output-scale diagnostics (:meth:`diagnostics`)."""
        return self._last_forward.diagnostics

    def _clear_records(self) -> None:
        """A new forward: no loss terms until the variant records this forward's (registered anew), no
        diagnostics. The holder's dicts are replaced, not emptied: a compiled forward then reads nothing of the
        last forward's records, so the first step's do not make Dynamo recompile the second (tests/test_compile.py)."""
        self._last_forward.terms, self._last_forward.diagnostics = {}, {}

    def set_loss_terms(self, *terms: GPLossTerm, **values: torch.Tensor) -> None:
        """Record this forward's loss terms as GPyTorch added loss terms, each under its kind's name
        (registered on first use): ``set_loss_terms(SequenceKL(kl))``, or by name,
        ``set_loss_terms(kl_seq=kl)`` (the kind registered under that name, gpattn.objectives). The values
        are the layer's reduced terms (docs/derivations.md §9: ``kl_seq`` already averaged over the batch,
        :meth:`gpattn.attention.AttentionCall.batch_mean`; ``kl_global`` the total over global parameters)."""
        for term in (*terms, *(GPLossTerm.kind(name)(value) for name, value in values.items())):
            if not isinstance(term, GPLossTerm):
                raise ValueError(
                    f"set_loss_terms takes gpattn.objectives.GPLossTerm instances (or name=value), got "
                    f"{type(term).__name__}"
                )
            if term.name not in self._added_loss_terms:
                self.register_added_loss_term(term.name)
            self.update_added_loss_term(term.name, term)

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """The unweighted loss terms of the last forward by name, summed over this layer's added loss terms
        (empty for deterministic baselines, and after an eval-mode forward: the terms are training's)."""
        return summed_loss_terms(self)

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Output scale of the last training-mode forward of a GP variant, per real token (detached 0-dim
        tensors; empty after an eval-mode forward):
        ``input_norm`` ‖x‖ of the (LayerNorm-ed) layer input, ``mean_norm`` ‖E[y]‖ of the posterior mean
        output and ``spread_norm`` ‖y − E[y]‖ of the drawn sample (0 when not sampling). Collapse shows
        as a mean far below the spread, or both far below the input (``gpattn.experiments.training`` logs them per
        epoch and warns). Empty for the other variants."""
        return dict(self._diagnostics)

    def __getstate__(self):
        # the last forward's loss terms hold autograd graphs: never pickle them
        state = self.__dict__.copy()
        state["_last_forward"] = LastForward(dict.fromkeys(self._added_loss_terms))
        return state
