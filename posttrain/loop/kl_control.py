"""The KL coefficient of a step and its adaptive controller: :func:`kl_coef_of` and :func:`observe_kl`.

The learner holds the coefficient beta (``Learner.kl_coef``, built by ``builders.build_kl_coef``) in both of
its placements: this step's loss reads it, or with ``credit.kl_in_reward`` the token rewards
(:func:`~posttrain.loop.targets.build_targets`) do. ``loss.kl_target`` makes it an
:class:`~posttrain.algos.kl.AdaptiveKLController` (Ziegler et al. 2019, arXiv:1909.08593, section 2.2), which
the loop feeds once per step, after the update, with the KL it observed (:func:`observe_kl`, called by
:func:`~posttrain.loop.run.sync_and_evaluate`).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from posttrain.algos.kl import AdaptiveKLController

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.learner.protocol import KLCoefficient

#: A step's metrics by key (as :data:`posttrain.loop.run.StepMetrics`).
Metrics = MutableMapping[str, float | int | str | bool | None]


def kl_coef_of(coef: float | KLCoefficient) -> float:
    """beta of a learner's ``kl_coef``: the fixed float, or the controller's current ``value``."""
    return float(coef) if isinstance(coef, (int, float)) else float(coef.value)


def observe_kl(coef: float | KLCoefficient, cfg: RunConfig, metrics: Metrics) -> None:
    """Feed this step's observed KL to an adaptive controller ``coef`` (the learner's ``kl_coef``; Ziegler et
    al. 2019; bounded update, :class:`~posttrain.algos.kl.AdaptiveKLController`) with the step's sample count
    ``n = sampling.prompts_per_step * sampling.group_size`` (the unit of ``loss.kl_horizon``).

    The observed KL is the one the coefficient multiplied: the mean token KL to the reference in the reward
    (``kl/ref_mean``, pi_old vs pi_ref) with ``credit.kl_in_reward``, else the loss's ``kl``.
    ``metrics["kl_coef"]`` is set to the beta this step applied (read before the update); the updated one,
    which the next step applies, goes to ``kl_coef_next``. A fixed float coefficient is only logged."""
    metrics["kl_coef"] = kl_coef_of(coef)  # what this step applied (the learner's too)
    key = "kl/ref_mean" if cfg.credit.kl_in_reward else "kl"
    observed = metrics.get(key)
    if isinstance(coef, AdaptiveKLController) and observed is not None:
        coef.update(float(observed), cfg.sampling.prompts_per_step * cfg.sampling.group_size)
        metrics["kl_coef_next"] = coef.value


__all__ = ["kl_coef_of", "observe_kl"]
