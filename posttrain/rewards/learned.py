"""Learned rewards in RL: a reward model's score and an LLM judge's verdict as components beside the verifier's.

:class:`LearnedRewards` wraps the run's guarded verification (a ``VerifyBatch``: the verifier pool or
the Ray reward actors). :func:`posttrain.rewards.scoring.judge` hands it the prompts too
(:meth:`LearnedRewards.verify_with_prompts`): the inner path verifies, then each component scorer
(``reward.model``: :class:`~posttrain.rewards.reward_model.RewardModelScorer`, in batches;
``reward.judge``: :class:`~posttrain.rewards.judge.LLMJudge`) scores the rows the verifier did not
fail, and its value is added to the verdict's raw components (the ledger's ``reward_components``),
weighted by ``reward.weights``. The verifier still decides the status; a row a scorer cannot score
becomes ``infra_error`` (no reward, counted; never a zero). Called without prompts (another
verifier re-judging, ``eval.hidden_verifier``) it is the inner path unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from posttrain.config.feedback import RewardConfig
from posttrain.errors import ConfigError, UserError
from posttrain.rewards.pool import Item
from posttrain.rewards.reward_model import PromptLike
from posttrain.rewards.scoring import VerifyBatch
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.trajectory import Status

RowScorer = Callable[[Sequence[PromptLike], Sequence[str]], list[float | str]]
"""``(prompts, responses) -> per row a finite value, or a string saying why there is none``."""


@dataclasses.dataclass(frozen=True)
class ComponentScorer:
    """A named component and the scorer of its rows."""

    name: str
    score_rows: RowScorer


def add_component(verdicts: Sequence[Verdict], prompts: Sequence[PromptLike], responses: Sequence[str],
                  name: str, score_rows: RowScorer) -> list[Verdict]:
    """``verdicts`` with component ``name`` added from ``score_rows`` on the rows that are not ``infra_error``.

    A row the scorer gives no value (a string) becomes ``infra_error`` with that reason and the verifier's
    status in its explanation; the others keep their status and explanation. ``ValueError`` when a verdict
    already has a component ``name`` (it would be overwritten) or the scorer returns a wrong number of rows.
    """
    rows = [i for i, v in enumerate(verdicts) if v.status is not Status.INFRA_ERROR]
    results = score_rows([prompts[i] for i in rows], [responses[i] for i in rows]) if rows else []
    if len(results) != len(rows):
        raise ValueError(f"component {name!r}: the scorer returned {len(results)} values for {len(rows)} rows")
    out = list(verdicts)
    for i, res in zip(rows, results, strict=True):
        v = verdicts[i]
        if name in v.components:
            raise ValueError(f"component {name!r} is already in the verdict ({sorted(v.components)}): give the "
                             f"learned reward another name")
        if isinstance(res, str):
            out[i] = infra_error(f"{res}; the verifier said {v.status.value}: {v.explanation}"[:500])
        else:
            out[i] = Verdict(v.status, {**v.components, name: float(res)}, v.explanation)
    return out


class LearnedRewards:
    """A ``VerifyBatch`` whose verdicts also carry learned components (see the module docstring)."""

    def __init__(self, inner: VerifyBatch, components: Sequence[ComponentScorer]) -> None:
        if not components:
            raise ValueError("LearnedRewards: no component scorer (use the inner verification directly)")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"LearnedRewards: component names {names} repeat")
        self.inner, self.components = inner, tuple(components)

    def __call__(self, items: Sequence[Item]) -> list[Verdict]:
        """The inner verification alone (no prompts: nothing to score them with)."""
        return self.inner(items)

    def verify_with_prompts(self, items: Sequence[Item], prompts: Sequence[PromptLike]) -> list[Verdict]:
        """The inner verdicts of ``items`` plus each component's value on ``(prompts[i], items[i] response)``."""
        if len(items) != len(prompts):
            raise ValueError(f"LearnedRewards: {len(items)} items for {len(prompts)} prompts")
        verdicts = self.inner(items)
        responses = [it[1] for it in items]
        for c in self.components:
            verdicts = add_component(verdicts, prompts, responses, c.name, c.score_rows)
        return verdicts


def check_reward_model(reward: RewardConfig) -> None:
    """``reward.model``: its path must be a reward-model directory, read from its files alone
    (:func:`~posttrain.rewards.reward_model.check_reward_model_dir`: posttrain's marker file or a
    ``*ForSequenceClassification`` config; a causal-LM policy checkpoint is refused); else a one-line
    :class:`~posttrain.errors.ConfigError` naming ``reward.model.path``. For the preflight, before the run
    directory is written (the weights' score head is checked when the run loads the model)."""
    if reward.model is None:
        return
    from posttrain.rewards.reward_model import check_reward_model_dir

    try:
        check_reward_model_dir(reward.model.path)
    except UserError as e:
        raise ConfigError(str(e)) from None


def build_learned_rewards(reward: RewardConfig, inner: VerifyBatch) -> VerifyBatch:
    """``inner`` wrapped in :class:`LearnedRewards` for ``reward.model`` / ``reward.judge``; ``inner`` itself
    when neither is set. The reward model is loaded here (on CUDA when available); a directory that is not a
    reward model (missing, a causal-LM policy, weights without a trained score head) is a
    :class:`~posttrain.errors.UserError` naming it (:meth:`RewardModelScorer.from_pretrained`)."""
    scorers: list[ComponentScorer] = []
    if reward.model is not None:
        import torch

        from posttrain.rewards.reward_model import RewardModelScorer

        rm = RewardModelScorer.from_pretrained(Path(reward.model.path), batch_size=reward.model.batch_size,
                                               component=reward.model.name)
        if torch.cuda.is_available():
            rm.model.to("cuda")
        scorers.append(ComponentScorer(reward.model.name, rm.score_rows))
    if reward.judge is not None:
        from posttrain.rewards.judge import LLMJudge

        j = reward.judge
        judge = LLMJudge(j.url, model=j.model, prompt_template=j.prompt_template, parse=j.parse,
                         score_pattern=j.score_pattern, timeout_s=j.timeout_s, retries=j.retries,
                         concurrency=j.concurrency, max_tokens=j.max_tokens, component=j.name)
        scorers.append(ComponentScorer(j.name, judge.score_rows))
    return LearnedRewards(inner, scorers) if scorers else inner
