"""Verifiers and rewards: verdicts with honest statuses, composition, pool, reward model (the code
sandbox the ``code`` verifier runs programs in is :mod:`posttrain.sandbox`).

Importing this package registers the built-in verifiers in :data:`VERIFIERS`: ``integer``,
``exact``, ``regex``, ``choice``, ``format``, ``combine``, ``math``, ``countdown``, ``code``,
``instructions``
(and ``reasoning_gym`` once :mod:`posttrain.envs` is imported).
"""

from posttrain.rewards import basic, code_verifier, countdown, instructions, math_answer  # noqa: F401 - registrations
from posttrain.rewards.compose import compose
from posttrain.rewards.pool import VerifierPool
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.rewards.verifier import VERIFIERS, Verifier, build_verifier, verifier_id

__all__ = [
    "VERIFIERS",
    "Verdict",
    "Verifier",
    "VerifierPool",
    "build_verifier",
    "compose",
    "infra_error",
    "verifier_id",
]
