"""What one ``posttrain check`` check returns, and the gradient comparison the checks share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

CheckResult = tuple[str, bool | None, str]
"""``(name, passed, detail)``; ``passed`` is None for a check that does not apply to the recipe (``detail``
says why): printed ``n/a``, never counted as a pass or a failure."""


def max_rel(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """``max |a - b| / max |a|`` over every tensor of two gradient dicts with the same keys."""
    num = max(float((a[k] - b[k]).abs().max()) for k in a)
    den = max(float(a[k].abs().max()) for k in a) or 1.0
    return num / den


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient of ``model`` (parameters without one are left out)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def all_passed(results: Sequence[CheckResult]) -> bool:
    """No check failed (``n/a`` checks do not count)."""
    return all(ok is not False for _, ok, _ in results)
