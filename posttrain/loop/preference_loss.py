"""One call shape for every loss of ``posttrain.algos.PREFERENCE_LOSSES`` on a batch of pairs' sequence log-probs.

The losses differ in what they take (posttrain/algos/preference.py): DPO / IPO / ODPO need the frozen
reference's log-probs (ODPO also each pair's ``score_diff``), SimPO / ORPO the response lengths and no
reference, KTO is unpaired. :func:`preference_loss` feeds each what it needs from one
:class:`PairLogprobs`; KTO sees the chosen responses as desirable and the rejected ones as undesirable
(Ethayarajh et al. 2024, arXiv:2402.01306, section 4: paired data split into its two halves), with the
reference point ``z0`` given by the caller.

:func:`implicit_margin` is the held-out criterion: the implicit-reward margin of each pair, > 0 when the
policy ranks the chosen response above the rejected one; :func:`pair_wins` counts a pair only when its margin
exceeds the rounding of its computation (:func:`margin_tolerance`), as the losses' ``reward_accuracy`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from posttrain.algos import PREFERENCE_LOSSES
from posttrain.algos.preference import margin_tie

REFERENCE_FREE = frozenset({"simpo", "orpo"})
"""Losses that read no reference model (their implicit reward is the length-normalised log-prob)."""


@dataclasses.dataclass(frozen=True)
class PairLogprobs:
    """Sequence log-probs (sums over the response tokens) of ``B`` pairs, all ``[B]``.

    ``policy_*`` carry gradients when computed with grad; ``ref_*`` are the frozen reference's (None
    for a reference-free loss); ``*_lengths`` are response token counts; ``score_diff`` is
    score(chosen) - score(rejected) (ODPO only, else None); ``rtol`` is each pair's relative rounding
    tolerance of one sequence log-prob (the losses' ``margin_rtol``; None: exact, no tie band)."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    chosen_lengths: Tensor
    rejected_lengths: Tensor
    score_diff: Tensor | None = None
    rtol: Tensor | None = None


def uses_reference(loss: str) -> bool:
    """Whether the loss reads the frozen reference's log-probs."""
    return loss not in REFERENCE_FREE


def check_loss_kwargs(loss: str, kwargs: Mapping[str, object]) -> dict[str, object]:
    """``kwargs`` validated against the loss's signature (``ValueError`` naming ``preference.kwargs``)."""
    return PREFERENCE_LOSSES.validate_kwargs(loss, kwargs, key="preference.kwargs")


def _ref(lp: PairLogprobs) -> tuple[Tensor, Tensor]:
    if lp.ref_chosen is None or lp.ref_rejected is None:
        raise ValueError("preference loss: this loss needs the reference log-probs, got None")
    return lp.ref_chosen, lp.ref_rejected


def kto_reference_point(lp: PairLogprobs) -> Tensor:
    """KTO's ``z0``: the batch mean of the policy / reference log-ratio over both responses of every pair,
    detached (the loss clamps it at 0). An estimate of KL(pi_theta || pi_ref) from the batch's own
    responses, not from mismatched (x, y') pairs as in the paper's implementation."""
    rc, rr = _ref(lp)
    return torch.cat([lp.policy_chosen - rc, lp.policy_rejected - rr]).detach().mean()


def preference_loss(loss: str, kwargs: Mapping[str, object], lp: PairLogprobs,
                    kl_ref_point: Tensor | float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """``(per-pair loss [B], diagnostics)`` of loss ``loss`` (a name in PREFERENCE_LOSSES) with its
    ``kwargs`` (validated: :func:`check_loss_kwargs`).

    KTO returns ``[2B]`` losses (chosen halves first), averaged by the caller like any other; its
    ``kl_ref_point`` is :func:`kto_reference_point` of the batch. Diagnostics are the loss's own, ``[B]``
    (KTO: ``[2B]``) detached tensors."""
    fn = PREFERENCE_LOSSES[loss]
    kw = dict(kwargs)
    if loss == "kto":
        rc, rr = _ref(lp)
        desirable = torch.cat([torch.ones_like(lp.policy_chosen, dtype=torch.bool),
                               torch.zeros_like(lp.policy_rejected, dtype=torch.bool)])
        out: tuple[Tensor, dict[str, Tensor]] = fn(torch.cat([lp.policy_chosen, lp.policy_rejected]),
                                                   torch.cat([rc, rr]), desirable, kl_ref_point, **kw)
        return out
    if loss in REFERENCE_FREE:
        kw.update(chosen_lengths=lp.chosen_lengths, rejected_lengths=lp.rejected_lengths)
        if lp.rtol is not None:
            kw["margin_rtol"] = lp.rtol
        out = fn(lp.policy_chosen, lp.policy_rejected, None, None, **kw)
        return out
    rc, rr = _ref(lp)
    if lp.rtol is not None:
        kw["margin_rtol"] = lp.rtol
    if loss == "odpo":
        if lp.score_diff is None:
            raise ValueError("preference loss 'odpo' needs each pair's score_diff (preference.fields.score_diff)")
        kw["score_diff"] = lp.score_diff
    out = fn(lp.policy_chosen, lp.policy_rejected, rc, rr, **kw)
    return out


def implicit_margin(loss: str, lp: PairLogprobs) -> Tensor:
    """``[B]`` implicit-reward margin of each pair (detached): ``(pi_c - ref_c) - (pi_r - ref_r)`` for the
    losses with a reference (DPO's implicit reward up to beta, Rafailov et al. 2023, eq. 5); the
    length-normalised ``pi_c / |y_c| - pi_r / |y_r|`` for SimPO / ORPO (Meng et al. 2024's reward)."""
    if loss in REFERENCE_FREE:
        m = lp.policy_chosen / lp.chosen_lengths - lp.policy_rejected / lp.rejected_lengths
    else:
        rc, rr = _ref(lp)
        m = (lp.policy_chosen - rc) - (lp.policy_rejected - rr)
    return m.detach()


def margin_tolerance(loss: str, lp: PairLogprobs) -> Tensor:
    """``[B]`` how far from 0 each :func:`implicit_margin` can land by rounding alone:
    ``rtol * (|pi_c| + |ref_c| + |pi_r| + |ref_r|)`` with a reference, ``rtol * (|pi_c| / |y_c| + |pi_r| / |y_r|)``
    for SimPO / ORPO (:func:`posttrain.algos.preference.margin_tie`); 0 when ``lp.rtol`` is None."""
    rtol: Tensor | float = 0.0 if lp.rtol is None else lp.rtol
    if loss in REFERENCE_FREE:
        return margin_tie(rtol, lp.policy_chosen / lp.chosen_lengths, lp.policy_rejected / lp.rejected_lengths)
    rc, rr = _ref(lp)
    return margin_tie(rtol, lp.policy_chosen, rc, lp.policy_rejected, rr)


def pair_wins(loss: str, lp: PairLogprobs) -> Tensor:
    """``[B]`` bool: the pairs the policy ranks right, :func:`implicit_margin` > :func:`margin_tolerance` (a
    margin within rounding of 0, e.g. every pair of a policy equal to its reference, is a tie, not a win)."""
    return implicit_margin(loss, lp) > margin_tolerance(loss, lp)
