"""Load-time check of the algorithm hyper-parameters: ``credit`` / ``loss`` / ``correction`` ``.kwargs``
against the registered functions of :mod:`posttrain.algos`, by their typed models and by one dry call.

Called by :func:`posttrain.loop.validate.validate_run`; the algorithm functions stay pure (nothing
is added to them: a function's model is derived from its signature, ``Registry.kwargs_model``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch

import posttrain.algos as A
from posttrain.algos.advantages import AdvantageInputs
from posttrain.algos.policy_losses import PolicyLossInputs
from posttrain.algos.registry import Registry
from posttrain.config import RunConfig
from posttrain.config.algorithm import CorrectionConfig, CreditConfig, LossConfig

AlgoFn = Callable[..., object]
ProbeCall = Callable[[AlgoFn, Mapping[str, object]], None]


def _probe(fn: AlgoFn, kwargs: Mapping[str, object], key: str, call: ProbeCall) -> None:
    """Run ``call(fn, kwargs)`` on tiny dummy tensors; a ValueError / TypeError is the recipe's fault
    only if the same call with the function's defaults succeeds (else the probe inputs cannot judge
    this function, e.g. a plug-in that needs other fields, and the run itself will tell)."""
    try:
        call(fn, kwargs)
    except (ValueError, TypeError) as e:
        try:
            call(fn, {})
        except Exception:  # noqa: BLE001  (the defaults fail too: the probe cannot judge)
            return
        raise ValueError(f"{key} {dict(kwargs)}: {e}") from None


def _logprob() -> torch.Tensor:
    """Fresh dummy log-probs ``[2, 2]`` for each call (a plug-in may write into its inputs)."""
    return torch.tensor([[-0.5, -1.0], [-0.7, -0.2]])


def _loss_call(fn: AlgoFn, kw: Mapping[str, object]) -> None:
    lp = _logprob()
    fn(PolicyLossInputs(logprob=lp, old_logprob=lp - 0.1, advantages=torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
                        action_mask=torch.ones(2, 2), behavior_logprob=lp - 0.2), **kw)


def _correction_call(fn: AlgoFn, kw: Mapping[str, object]) -> None:
    params = inspect.signature(fn).parameters
    extra: dict[str, object] = {}
    if "behavior_version" in params:
        extra["behavior_version"] = torch.zeros(2, 2, dtype=torch.long)
    if "current_version" in params:
        extra["current_version"] = 0
    lp = _logprob()
    fn(lp - 0.2, lp, torch.ones(2, 2), **{**extra, **kw})


def _advantage_call(fn: AlgoFn, kw: Mapping[str, object]) -> None:
    fn(AdvantageInputs(
        action_mask=torch.ones(2, 2), rewards=torch.tensor([1.0, 0.0]), token_rewards=torch.zeros(2, 2),
        group_index=torch.tensor([0, 0]), values=torch.zeros(2, 2), baseline=torch.zeros(2),
        step_index=torch.zeros(2, 2, dtype=torch.long), step_anchor=torch.ones(2, 1, dtype=torch.long),
        step_rewards=torch.tensor([[1.0], [0.0]])), **kw)


def check_algo_kwargs(cfg: RunConfig) -> None:
    """Validate ``credit`` / ``loss`` / ``correction`` ``.kwargs`` against the registered functions and
    keep the validated values.

    Each kwargs is validated by its function's typed model (``Registry.validate_kwargs``: an unknown or
    missing keyword, a value of the wrong type -> error naming the key), then the function is called
    once on tiny dummy tensors with the validated values, so the constraints each function declares
    (``eps_low`` in [0, 1), ``cap > 0``...) fail at config load, before the run directory, the SFT
    warm-up or the first evaluation. On success each section's ``kwargs`` holds the validated values
    (an int given for a float parameter is a float), which the run records in ``config.yaml`` and
    its functions receive. The names must resolve already (``Registry.resolve``). Raises ``ValueError``
    naming the key.
    """
    checks: list[tuple[str, Registry, str, CreditConfig | LossConfig | CorrectionConfig, ProbeCall]] = [
        ("credit.kwargs", A.ADVANTAGES, cfg.credit.estimator, cfg.credit, _advantage_call),
        ("loss.kwargs", A.POLICY_LOSSES, cfg.loss.policy_loss, cfg.loss, _loss_call)]
    if cfg.correction.name is not None:
        checks.append(("correction.kwargs", A.CORRECTIONS, cfg.correction.name, cfg.correction, _correction_call))
    for key, reg, name, section, call in checks:
        typed = reg.validate_kwargs(name, section.kwargs, key=key)
        _probe(reg[name], typed, key, call)
        section.kwargs = typed
