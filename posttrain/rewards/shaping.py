"""Shaping components from :mod:`posttrain.algos.shaping`, each reported as its own component.

``overlong`` = DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13) and
``effort`` = the effort/budget penalty (-1 beyond ``tau`` times the prompt's base budget); both are raw
values in [-1, 0] merged into a verdict's components, never folded into ``task``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.algos.shaping import dapo_overlong_penalty, effort_penalty
from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status


def overlong_components(lengths: Sequence[int], max_len: int, cache_len: int) -> list[dict[str, float]]:
    """``[{"overlong": R_length(L_i)}]`` for response lengths ``L_i`` (tokens)."""
    pen = dapo_overlong_penalty(torch.tensor(list(lengths), dtype=torch.float64), max_len, cache_len)
    return [{"overlong": float(p)} for p in pen]


def effort_components(lengths: Sequence[int], budgets: Sequence[float], tau: float) -> list[dict[str, float]]:
    """``[{"effort": -1 if L_i > tau * b_i else 0}]``."""
    pen = effort_penalty(torch.tensor(list(lengths), dtype=torch.float64),
                         torch.tensor(list(budgets), dtype=torch.float64), tau)
    return [{"effort": float(p)} for p in pen]


def add_components(verdicts: Sequence[Verdict], extra: Sequence[dict[str, float]]) -> list[Verdict]:
    """Merge ``extra[i]`` into ``verdicts[i]``'s components (``infra_error`` rows unchanged).

    A name already present in a verdict is an error (a shaping term never overwrites the task
    component).
    """
    if len(verdicts) != len(extra):
        raise ValueError(f"add_components: {len(verdicts)} verdicts, {len(extra)} component rows")
    out = []
    for v, e in zip(verdicts, extra, strict=True):
        if v.status is Status.INFRA_ERROR:
            out.append(v)
            continue
        clash = set(v.components) & set(e)
        if clash:
            raise ValueError(f"add_components: component(s) {sorted(clash)} already in the verdict")
        out.append(Verdict(v.status, {**v.components, **e}, v.explanation))
    return out
