"""A user's own advantage estimator and policy loss, plugged in by dotted path in the loop tests."""

from __future__ import annotations

from typing import Any

import posttrain.algos as A
from posttrain.algos.advantages import AdvantageInputs, AdvantageOutputs


def scaled_grpo(inputs: AdvantageInputs, scale: float = 1.0) -> AdvantageOutputs:
    """``scale`` x GRPO's advantages (a group statistic: declares groups>=2)."""
    out = A.ADVANTAGES["grpo"](inputs)
    return AdvantageOutputs(advantages=scale * out.advantages, returns=None)


scaled_grpo.needs = ("groups>=2",)  # type: ignore[attr-defined]


def clip_loss(inputs: Any, *, eps: float = 0.2) -> Any:
    """PPO-clip with one symmetric epsilon."""
    return A.POLICY_LOSSES["ppo_clip"](inputs, eps_low=eps, eps_high=eps)


def no_inputs() -> None:
    return None


def bad_needs(inputs: Any) -> None:
    return None


bad_needs.needs = ("a_gpu",)  # type: ignore[attr-defined]
