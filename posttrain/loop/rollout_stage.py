"""The rollout settings of a run (sampler parameters, scoring spec) and the rollout driver built from them.

There is one rollout driver, :class:`posttrain.loop.rollout.Rollout` (every system mode, dynamic
sampling included), over the player of the run's kind: single-turn samples
(:class:`~posttrain.loop.single_turn.SingleTurn`) or, with ``env.name`` set, multi-turn episodes
(:class:`~posttrain.loop.episode_rollout.EpisodeRollout`). :func:`build_rollout` picks it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from posttrain.config import RunConfig
from posttrain.loop.rollout import Rollout, RolloutSource
from posttrain.rewards.scoring import HasVerifier, ScoringSpec
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer


class RolloutRun(RolloutSource, Protocol):
    """What building a run's rollout reads of it besides the engine and prompts (met by a training run's
    :class:`~posttrain.loop.sampling_lifecycle.SamplingSource`). Read when present: ``renderer`` (default raw
    text), ``verify_batch`` (default in-process), ``state.rollout_dropped``, ``plain_model`` (episodes)."""

    @property
    def engine(self) -> RolloutEngine: ...

    @property
    def task(self) -> HasVerifier: ...  # an environment task (make_env) with env.name set

    @property
    def tokenizer(self) -> Tokenizer: ...


@dataclasses.dataclass
class RolloutStage:
    """Sampler parameters and scoring spec of one run (the rollout itself is the driver's)."""

    prompts_per_step: int
    group_size: int
    sampling: SamplingParams
    spec: ScoringSpec

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RolloutStage:
        """The stage of ``cfg.sampling`` / ``cfg.reward``."""
        s = cfg.sampling
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens, n=s.group_size
        )
        spec = ScoringSpec.of(cfg.reward)
        return cls(s.prompts_per_step, s.group_size, params, spec)


def build_rollout(cfg: RunConfig, run: RolloutRun, stage: RolloutStage) -> Rollout[Any]:
    """The rollout driver of ``run`` (engine, prompt stream, task, tokenizer, renderer, guarded
    ``verify_batch``): episodes with ``env.name`` set, else single-turn samples. Its count of dropped
    carried members starts from ``run.state.rollout_dropped`` (a resumed run's)."""
    dropped = int(getattr(getattr(run, "state", None), "rollout_dropped", 0))
    if cfg.env.name is not None:
        from posttrain.loop.episode_rollout import EpisodeRollout

        return Rollout(cfg, run, EpisodeRollout(cfg, run, stage), dropped)
    from posttrain.loop.single_turn import SingleTurn

    renderer = getattr(run, "renderer", None)
    if renderer is None:  # a stand-in run without one renders raw text, as before chat templates
        from posttrain.envs.prompt_render import PromptRenderer

        renderer = PromptRenderer(run.tokenizer)
    return Rollout(cfg, run, SingleTurn(run, renderer=renderer, task=run.task, tokenizer=run.tokenizer,
                                        spec=stage.spec, params=stage.sampling, seed=cfg.seed,
                                        verify_batch=getattr(run, "verify_batch", None)), dropped)
