"""KL estimators (registry KL_ESTIMATORS) and the adaptive KL coefficient controller.

The estimators are per-token Monte-Carlo estimates of ``KL(pi_theta || pi_ref)`` evaluated at the
sampled token ``y ~ pi_theta`` from its two log-probs (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With ``log_r = log pi_ref(y) - log pi_theta(y)``:

- ``k1 = -log_r``                  unbiased, high variance, can be negative per token;
- ``k2 = 0.5 * log_r**2``          biased, low variance, always >= 0 (its gradient is the
  gradient of the true KL for on-policy samples; REINFORCE++ uses "k2 as loss");
- ``k3 = exp(log_r) - log_r - 1``  unbiased, low variance, always >= 0 (GRPO's estimator).

Every estimator returns a tensor of the inputs' shape; the caller masks (off-action positions may
hold any finite value) and chooses whether the KL goes into the reward or into the loss.

Numerical guard: ``log_r`` is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (20, a ratio of
e^20 ~ 4.9e8) before any estimator uses it, so an extreme log-ratio — a token the reference gives
probability ~0, a ``-inf`` log-prob — yields a large finite penalty instead of ``inf`` (whose product
with a 0 mask or a 0 coefficient is NaN and poisons the whole update). Beyond the clamp the
gradient is 0: such a token stops being pushed by the KL term, which is the price of staying finite
(veRL clamps its low-variance KL at the same bound). Within the clamp every estimator is exact.

The controllers are small stateful objects kept outside the pure functions: the learner (KL in the
loss) or the loop (KL in the reward) reads ``.value`` for the coefficient beta, and the loop calls
``.update(observed_kl, n_steps)`` once per step with the KL it observed and the step's sample count.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

from torch import Tensor

from posttrain.algos.registry import KL_ESTIMATORS

__all__ = ["LOG_RATIO_CLAMP", "AdaptiveKLController", "FixedKLController", "kl_k1", "kl_k2", "kl_k3"]

LOG_RATIO_CLAMP = 20.0


def _check(logprob: Tensor, ref_logprob: Tensor) -> None:
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"KL estimator: logprob shape {tuple(logprob.shape)} != ref_logprob shape {tuple(ref_logprob.shape)}"
        )


def _log_ratio(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """``clamp(log pi_ref(y) - log pi_theta(y), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)`` (module doc)."""
    _check(logprob, ref_logprob)
    return (ref_logprob - logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k1 = log pi_theta(y) - log pi_ref(y), per token (Schulman 2020).

    Unbiased estimate of KL(pi_theta || pi_ref) for y ~ pi_theta; may be negative per token.
    Shapes: both inputs ``[...]`` (usually ``[B, T]``), output the same shape; caller masks.
    The log-ratio is clamped to +-LOG_RATIO_CLAMP (module doc).
    """
    return -_log_ratio(logprob, ref_logprob)


@KL_ESTIMATORS.register("k2")
def kl_k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k2 = 0.5 * (log pi_theta(y) - log pi_ref(y))**2, per token (Schulman 2020).

    Biased but low-variance and >= 0. Used as a loss term by REINFORCE++ (Hu 2025,
    arXiv:2501.03262). Same shape as the inputs; caller masks. The log-ratio is clamped to
    +-LOG_RATIO_CLAMP (module doc), so k2 <= 200.
    """
    d = _log_ratio(logprob, ref_logprob)
    return 0.5 * d * d


@KL_ESTIMATORS.register("k3")
def kl_k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k3 = exp(log q - log p) - (log q - log p) - 1 with p = pi_theta, q = pi_ref (Schulman 2020).

    Unbiased for KL(p || q) under y ~ p and >= 0 for every token (since e^x >= 1 + x). This is
    the estimator of DeepSeekMath's GRPO (Shao et al. 2024, arXiv:2402.03300, eq. 4).
    Computed as ``expm1(x) - x`` so values near 0 keep their precision. ``x`` is clamped to
    +-LOG_RATIO_CLAMP (module doc): k3 <= e^20 - 21 ~ 4.9e8, finite in float32 and float64, and
    a ``-inf`` log-prob gives that bound rather than ``inf``/NaN. Same shape as the inputs; caller masks.
    """
    x = _log_ratio(logprob, ref_logprob)
    return x.expm1() - x


class FixedKLController:
    """A constant KL coefficient with the controller interface (``value``, ``update``, state)."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"FixedKLController: coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, observed_kl: float, n_steps: int) -> float:
        """No-op (the coefficient is fixed); returns ``value``."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The controller state as plain floats (checkpointable as JSON)."""
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore from ``state_dict()``; a missing key is a ``ValueError``."""
        if "value" not in state:
            raise ValueError(f"FixedKLController.load_state_dict: missing 'value' in {sorted(state)}")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional KL coefficient controller (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2), bounded.

    The paper: ``e_t = clip((KL_t - KL_target) / KL_target, -0.2, 0.2)`` and
    ``beta_{t+1} = beta_t (1 + K_beta e_t)``; its reference code sets ``K_beta = n_steps / horizon``
    with ``n_steps`` the number of samples (sequences) consumed since the last update and ``horizon``
    in samples too (10000 there). Here the gain is capped at 1::

        e      = clip(observed_kl / target_kl - 1, -0.2, 0.2)
        K      = min(n_steps / horizon, 1)
        beta  <- beta * (1 + K * e)          # the factor lies in [0.8, 1.2]

    so beta changes by at most 20% per update and can never reach 0 or change sign (the uncapped
    form multiplies by ``1 - 0.2 * n_steps / horizon``, negative once a step's samples exceed
    5 x horizon: the penalty turns into a bonus). With ``n_steps <= horizon`` (the paper's regime)
    the update is the reference code's exactly. ``observed_kl`` and ``target_kl`` are in the same
    unit (the loop feeds the mean per-token KL estimate it logs). ``init_coef`` must be > 0: a
    multiplicative controller started at 0 stays at 0.
    """

    MAX_ERROR = 0.2

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if not (init_coef > 0 and math.isfinite(init_coef)):
            raise ValueError(f"AdaptiveKLController: init_coef must be finite and > 0 (a multiplicative "
                             f"controller started at 0 stays at 0), got {init_coef}")
        if not (target_kl > 0 and math.isfinite(target_kl)):
            raise ValueError(f"AdaptiveKLController: target_kl must be finite and > 0, got {target_kl}")
        if not (horizon > 0 and math.isfinite(horizon)):
            raise ValueError(f"AdaptiveKLController: horizon must be finite and > 0, got {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, observed_kl: float, n_steps: int) -> float:
        """Apply one bounded proportional update (class doc) and return the new coefficient (> 0).

        ``observed_kl`` must be finite; ``n_steps`` >= 0 samples (0 leaves the coefficient unchanged).
        """
        if not math.isfinite(observed_kl):
            raise ValueError(f"AdaptiveKLController.update: observed_kl must be finite, got {observed_kl}")
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        error = min(max(observed_kl / self.target_kl - 1.0, -self.MAX_ERROR), self.MAX_ERROR)
        gain = min(n_steps / self.horizon, 1.0)
        # 0.8 ** ~3300 updates would underflow to 0.0: keep beta a positive float whatever happens.
        self.value = max(self.value * (1.0 + gain * error), sys.float_info.min)
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The controller state as plain floats (checkpointable as JSON)."""
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore from ``state_dict()``; a missing key or a value <= 0 is a ``ValueError``."""
        missing = {"value", "target_kl", "horizon"} - set(state)
        if missing:
            raise ValueError(f"AdaptiveKLController.load_state_dict: missing {sorted(missing)}")
        if not (float(state["value"]) > 0 and math.isfinite(float(state["value"]))):
            raise ValueError(f"AdaptiveKLController.load_state_dict: value must be finite and > 0, got {state['value']}")
        self.value = float(state["value"])
        self.target_kl = float(state["target_kl"])
        self.horizon = float(state["horizon"])
