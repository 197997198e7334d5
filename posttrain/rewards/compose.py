"""Composition: a weighted sum of named raw components -> :class:`~posttrain.trajectory.Reward`."""

from __future__ import annotations

import math
from collections.abc import Mapping

from posttrain.trajectory import Reward


def compose(components: Mapping[str, float], weights: Mapping[str, float]) -> Reward:
    """``total = sum_k weights[k] * components[k]`` over the *weighted* components.

    The ledger keeps all raw components (weighted or not), the weights and the total. A weight
    whose component is missing is a ``ValueError`` naming it (a silent 0 would hide a broken
    verifier); a component without a weight is recorded but does not enter the total. Non-finite
    values are errors.
    """
    missing = sorted(k for k in weights if k not in components)
    if missing:
        raise ValueError(
            f"compose: weighted component(s) {missing} missing from the verdict (has {sorted(components)})"
        )
    for name, m in (("component", components), ("weight", weights)):
        bad = [k for k, v in m.items() if not math.isfinite(float(v))]
        if bad:
            raise ValueError(f"compose: non-finite {name}(s) {bad}")
    total = math.fsum(float(w) * float(components[k]) for k, w in weights.items())
    return Reward(components={k: float(v) for k, v in components.items()},
                  weights={k: float(w) for k, w in weights.items()}, total=total)
