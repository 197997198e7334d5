"""The algorithm library: pure tensor functions, registered by name.

Imports only torch (and pydantic, for the hyper-parameter models of algos/hyperparameters.py; posttrain.errors
for the Tinker losses' one-line input errors, algos/tinker_losses.py). Token-level tensors are ``[B, T]`` with an
``action_mask [B, T]`` (1 = policy-generated token); sequence-level tensors are ``[B]``. A recipe selects each
function by its registry name; see docs/algorithms.md for the formulas and sources.
"""

from posttrain.algos import (  # noqa: F401  (importing registers the functions)
    advantages,
    corrections,
    distill,
    entropy,
    kl,
    policy_losses,
    policy_objective,
    preference,
    reductions,
    shaping,
    value,
)
from posttrain.algos.registry import (
    ADVANTAGES,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    REDUCTIONS,
    Registry,
)

__all__ = [
    "ADVANTAGES",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "REDUCTIONS",
    "Registry",
]
