"""What :class:`~posttrain.learner.actor.PolicyLearner` resolves once at construction, as pure helpers: the
autocast dtype (:func:`autocast_dtype`), the policy objective's registry entries and validated keyword
arguments (:func:`resolve_policy_loss`), and the model it trains (:func:`prepare_model`: LoRA adapters, Hu
et al. 2021, and activation checkpointing, Chen et al. 2016, refused with dropout). Each fails with a
one-line error naming the setting at construction, never mid-update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from posttrain.algos.registry import CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, REDUCTIONS
from posttrain.learner.lora import wrap_lora
from posttrain.learner.settings import ComputeSettings, LoraSettings, PolicyLossSettings

AUTOCAST = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
"""``compute.autocast_dtype`` names and the dtype each runs the forward under."""


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """The dtype of ``compute.autocast_dtype`` ``name`` (:data:`AUTOCAST`; None: no autocast); ``ValueError``
    naming the valid names for any other."""
    if name is not None and name not in AUTOCAST:
        raise ValueError(f"unknown autocast_dtype {name!r}; valid: {', '.join(AUTOCAST)} or None")
    return AUTOCAST[name] if name is not None else None


@dataclasses.dataclass(frozen=True)
class ResolvedPolicyLoss:
    """The registry functions of ``loss`` settings (``kl`` / ``correction`` None when off) and their validated
    keyword arguments."""

    policy_loss: Callable[..., Any]
    reduction: Callable[..., Any]
    kl: Callable[..., Any] | None
    correction: Callable[..., Any] | None
    policy_loss_kwargs: dict[str, object]
    reduction_kwargs: dict[str, object]
    correction_kwargs: dict[str, object]


def resolve_policy_loss(ls: PolicyLossSettings) -> ResolvedPolicyLoss:
    """Look up ``ls``'s names in the registries (``POLICY_LOSSES``, ``REDUCTIONS``, ``KL_ESTIMATORS``,
    ``CORRECTIONS``) and validate their keyword arguments, then probe the reduction once on a ``[1, 1]`` mask
    (it checks its own kwargs, e.g. ``max_len``): an unknown name, a wrong key or type fails here, not
    mid-update."""
    out = ResolvedPolicyLoss(
        policy_loss=POLICY_LOSSES[ls.policy_loss], reduction=REDUCTIONS[ls.reduction],
        kl=KL_ESTIMATORS[ls.kl_estimator] if ls.kl_estimator is not None else None,
        correction=CORRECTIONS[ls.correction] if ls.correction is not None else None,
        policy_loss_kwargs=POLICY_LOSSES.validate_kwargs(ls.policy_loss, ls.policy_loss_kwargs,
                                                         key="policy_loss_kwargs"),
        reduction_kwargs=REDUCTIONS.validate_kwargs(ls.reduction, ls.reduction_kwargs, key="reduction_kwargs"),
        correction_kwargs=(CORRECTIONS.validate_kwargs(ls.correction, ls.correction_kwargs, key="correction_kwargs")
                           if ls.correction else {}))
    out.reduction(torch.ones(1, 1), num_sequences=1, num_tokens=1.0, **out.reduction_kwargs)
    return out


def prepare_model(model: torch.nn.Module, lora: LoraSettings, compute: ComputeSettings) -> torch.nn.Module:
    """``model`` with peft LoRA adapters when ``lora.rank > 0`` (the peft model is returned), then activation
    checkpointing enabled when ``compute.gradient_checkpointing``: train mode for the gradient forward is exact
    only without dropout (pi_theta must equal pi_old), so a model with any (:func:`dropout_rates`) is a
    ``ValueError`` naming the first three."""
    if lora.rank > 0:
        model = wrap_lora(model, rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules,
                          dropout=lora.dropout)
    if compute.gradient_checkpointing:
        dropout = dropout_rates(model)
        if dropout:
            raise ValueError(f"gradient_checkpointing needs a model without dropout (pi_theta must equal "
                             f"pi_old); found {dropout[:3]}")
        model.gradient_checkpointing_enable()  # type: ignore[operator]
    return model


def dropout_rates(model: torch.nn.Module) -> list[str]:
    """``name=p`` of every ``nn.Dropout`` with p > 0 and every ``*dropout`` config value > 0."""
    found = [f"{n}={m.p}" for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for k, v in cfg.to_dict().items():
            if "dropout" in k and isinstance(v, (int, float)) and v > 0:
                found.append(f"config.{k}={v}")
    return found


__all__ = ["AUTOCAST", "ResolvedPolicyLoss", "autocast_dtype", "dropout_rates", "prepare_model",
           "resolve_policy_loss"]
