"""``posttrain eval`` verifies held-out responses under the run's own limits, whichever backend verified them.

A run with Ray reward actors (``system.backend=ray``, ``system.ray.num_reward_workers > 0``) verified with
``system.ray.verify_timeout_s`` / ``verify_retries``; ``posttrain eval`` of its checkpoint rebuilt a verifier
pool from ``reward.timeout_s`` / ``retries``, keys that run refuses (its actors verify), so a slow verifier
timed out at another limit and the figure differed with no flag to set it right.
"""

from __future__ import annotations

from posttrain.evaluation.heldout import HeldoutRun
from posttrain.loop.builders import build_model
from posttrain.loop.validate import load_run_config

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.max_new_tokens=2",
        "eval.size=2"]


def _limits(overrides: list[str]) -> tuple[float, int]:
    cfg = load_run_config(None, [*TINY, *overrides])
    tok, model = build_model(cfg)
    hr = HeldoutRun.from_config(cfg, model, tok)
    try:
        assert hr._pool is not None
        return hr._pool.timeout_s, hr._pool.retries
    finally:
        hr.close()


def test_the_ray_reward_actors_limits_are_the_evaluations() -> None:
    assert _limits(["system.backend=ray", "system.ray.verify_timeout_s=30", "system.ray.verify_retries=3"]) == (30.0, 3)


def test_the_driver_pools_limits_are_the_evaluations() -> None:
    assert _limits(["reward.timeout_s=20", "reward.retries=2"]) == (20.0, 2)
    # Ray without reward actors: the driver's pool of reward.* verified
    assert _limits(["system.backend=ray", "system.ray.num_reward_workers=0", "reward.timeout_s=20"]) == (20.0, 1)
