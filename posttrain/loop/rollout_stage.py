"""The rollout settings of a run: sampler parameters and the scoring spec.

There is one rollout path, :class:`posttrain.loop.producer.GroupRollout` (every system mode,
dynamic sampling included: :meth:`~posttrain.loop.producer.GroupRollout.run_dynamic`), so infra
failures are counted the same way everywhere; this module only holds what it is configured with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.config import RunConfig
from posttrain.rewards.scoring import ScoringSpec


@dataclasses.dataclass
class RolloutStage:
    """Sampler parameters and scoring spec of one run (the rollout itself is GroupRollout's)."""

    run: Any
    prompts_per_step: int
    group_size: int
    sampling: Any  # posttrain.rollout.SamplingParams
    spec: ScoringSpec

    @classmethod
    def from_config(cls, cfg: RunConfig, run: Any) -> RolloutStage:
        """The stage of ``cfg.sampling`` / ``cfg.reward`` for ``run``."""
        from posttrain.rollout.sampling import SamplingParams

        s = cfg.sampling
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens, n=s.group_size
        )
        spec = ScoringSpec(cfg.reward.weights, cfg.reward.overlong_max_len, cfg.reward.overlong_cache_len)
        return cls(run, s.prompts_per_step, s.group_size, params, spec)
