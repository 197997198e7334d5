"""Temporary re-export: scoring lives beside the verifiers now (:mod:`posttrain.rewards.scoring`).

Kept only for the modules not yet moved to the new path (tests/rewards/test_plugins.py,
tests/envs/test_prompt_render.py, tests/loop/test_requirements.py); import from
``posttrain.rewards.scoring``.
"""

from posttrain.rewards.scoring import ScoringSpec, _shaping_components, decode_response, score, verify_context

__all__ = ["ScoringSpec", "_shaping_components", "decode_response", "score", "verify_context"]
