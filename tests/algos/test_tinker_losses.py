"""The Tinker losses against hand-computed values (sums over tokens, not means) and gradients."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch

from posttrain.algos.tinker_losses import datum_loss, resolve_loss
from posttrain.errors import UserError

LP = [-1.0, -2.0]  # learner log-probs of the two target tokens


def _loss(name: str, inputs: dict[str, list[float]], config: Mapping[str, float | str] | None = None
          ) -> tuple[float, list[float]]:
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    spec, cfg = resolve_loss(name, config or {})
    loss = datum_loss(spec, name, lp, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}, cfg, 0)
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad.tolist()


def test_cross_entropy_is_a_weighted_sum() -> None:
    # -(1 * -1 + 0.5 * -2) = 2; d/dlp = -weights
    loss, grad = _loss("cross_entropy", {"weights": [1.0, 0.5]})
    assert loss == pytest.approx(2.0)
    assert grad == pytest.approx([-1.0, -0.5])
    assert _loss("cross_entropy", {})[0] == pytest.approx(3.0)  # weights default to 1


# q = sampler log-probs, A = advantages: ratio = exp(lp - q) = [e^0.5, e^-1]
Q, A = [-1.5, -1.0], [1.0, -2.0]


def test_importance_sampling() -> None:
    r0, r1 = math.exp(0.5), math.exp(-1.0)
    loss, grad = _loss("importance_sampling", {"logprobs": Q, "advantages": A})
    assert loss == pytest.approx(-(r0 * 1.0 + r1 * -2.0))
    assert grad == pytest.approx([-r0 * 1.0, -r1 * -2.0])  # d(-ratio A)/dlp = -ratio A


def test_ppo_clips_both_tokens_here() -> None:
    # clip(ratio, 0.8, 1.2) = [1.2, 0.8]; min(ratio A, clipped A) = [min(1.65, 1.2), min(-0.74, -1.6)] = [1.2, -1.6]
    loss, grad = _loss("ppo", {"logprobs": Q, "advantages": A})
    assert loss == pytest.approx(-(1.2 - 1.6))
    assert grad == pytest.approx([0.0, 0.0])  # both terms are the clipped constants
    # wider thresholds: nothing clips, PPO equals importance sampling
    wide = {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}
    assert _loss("ppo", {"logprobs": Q, "advantages": A}, wide)[0] == pytest.approx(
        _loss("importance_sampling", {"logprobs": Q, "advantages": A})[0])


def test_cispo_weights_log_probs_by_the_stopped_clipped_ratio() -> None:
    # -(1.2 * -1 * 1 + 0.8 * -2 * -2) = -2.0; d/dlp = -w A = [-1.2, 1.6]
    loss, grad = _loss("cispo", {"logprobs": Q, "advantages": A})
    assert loss == pytest.approx(-2.0)
    assert grad == pytest.approx([-1.2, 1.6])


@pytest.mark.parametrize(("name", "inputs", "config", "match"), [
    ("dro", {}, {}, "not implemented"),
    ("ppo", {"logprobs": Q, "advantages": A}, {"beta": 0.1}, "unknown loss_fn_config"),
    ("ppo", {"advantages": A}, {}, "missing"),
    ("cross_entropy", {"mask": [1.0, 1.0]}, {}, "not accepted"),
    ("cross_entropy", {"weights": [1.0]}, {}, "shape"),
])
def test_unsupported_inputs_are_user_errors(name: str, inputs: dict[str, list[float]],
                                            config: dict[str, float | str], match: str) -> None:
    with pytest.raises(UserError, match=match):
        _loss(name, inputs, config)
