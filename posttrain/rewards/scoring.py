"""Completions -> verdicts -> rewarded trajectories (the "validate statuses -> score" stage).

Every completion gets a :class:`~posttrain.rewards.Verdict` (:func:`judge`). A verifier that raises,
hangs past ``reward.timeout_s`` or returns garbage is an ``infra_error`` (counted, never a zero
reward); raw components are kept unweighted in the record alongside the weights and the composed
total (:func:`to_trajectories`). :func:`score` is both. Nothing here knows the training loop: the
rollout driver (:mod:`posttrain.loop.rollout`) calls it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from posttrain.rewards.compose import compose
from posttrain.rewards.pool import Item, VerifierPool
from posttrain.rewards.verdict import Verdict
from posttrain.rewards.verifier import Verifier

if TYPE_CHECKING:
    from posttrain.config.feedback import RewardConfig
from posttrain.trajectory import Reward, Status, Trajectory
from posttrain.trajectory.record import JSONScalar

VerifyBatch = Callable[[Sequence[Item]], list[Verdict]]
"""A guarded verification of many items (``VerifierPool.verify_batch`` or reward workers)."""


@runtime_checkable
class PromptedVerifyBatch(Protocol):
    """A ``VerifyBatch`` that also scores with the prompts (:class:`~posttrain.rewards.learned.LearnedRewards`:
    a reward model or an LLM judge reads the prompt beside the response)."""

    def __call__(self, items: Sequence[Item]) -> list[Verdict]: ...

    def verify_with_prompts(self, items: Sequence[Item], prompts: Sequence[Any]) -> list[Verdict]:
        """Verdicts of ``items``; ``prompts[i]`` is the prompt (text or chat messages) of ``items[i]``."""
        ...


class Decoder(Protocol):
    """The tokenizer as scoring uses it: ids -> text. The part of
    :class:`~posttrain.models.tokenizer_protocol.Tokenizer` scoring calls, with its types (transformers'
    ``decode`` takes a list and is annotated ``str | list[str]``; scoring takes ``str(...)``)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]:
        """Text of ``ids``."""
        ...


class Example(Protocol):
    """A prompt as scoring reads it (met by :class:`~posttrain.envs.task.TaskExample`)."""

    @property
    def prompt_id(self) -> str: ...

    @property
    def prompt(self) -> str: ...

    @property
    def reference(self) -> Any: ...  # whatever the verifier compares against (user data)

    @property
    def meta(self) -> Mapping[str, JSONScalar]: ...


class Sample(Protocol):
    """A generated response as scoring reads it (met by :class:`~posttrain.rollout.types.Completion`)."""

    @property
    def token_ids(self) -> list[int]: ...


class ScoredCompletion(Sample, Protocol):
    """A completion that can become a trajectory (:meth:`~posttrain.rollout.types.Completion.to_trajectory`)."""

    def to_trajectory(self, *, traj_id: str, prompt_id: str, group_id: str, **rest: Any) -> Trajectory: ...


class HasVerifier(Protocol):
    """Something carrying a verifier (a task)."""

    @property
    def verifier(self) -> Verifier: ...


def decode_response(tokenizer: Decoder, completion: Sample) -> str:
    """Response text of a completion: its generated tokens without the closing eos/specials."""
    return str(tokenizer.decode(completion.token_ids, skip_special_tokens=True))


def verify_context(verifier: Verifier, example: Example) -> dict[str, Any]:
    """Keyword context of ``verifier.verify`` for ``example``: ``{prompt, meta}`` for a verifier that
    asks for it (``wants_prompt``, e.g. :class:`~posttrain.rewards.plugins.RewardFunctionVerifier`),
    else none (built-in verifiers take ``response, reference`` only)."""
    if getattr(verifier, "wants_prompt", False):
        return {"prompt": str(example.prompt), "meta": dict(getattr(example, "meta", {}) or {})}
    return {}


@dataclasses.dataclass(frozen=True)
class ScoringSpec:
    """How verdict components become the scalar reward (flat copy of the reward config)."""

    weights: Mapping[str, float]
    overlong_max_len: int | None = None
    overlong_cache_len: int = 0

    @classmethod
    def of(cls, reward: RewardConfig) -> ScoringSpec:
        """The spec of a recipe's ``reward`` section: ``weights``, ``overlong_max_len``, ``overlong_cache_len``
        (the one place a spec is read from the config)."""
        return cls(reward.weights, reward.overlong_max_len, reward.overlong_cache_len)


def _shaping_components(spec: ScoringSpec, n_actions: Sequence[int]) -> list[dict[str, float]]:
    if spec.overlong_max_len is None:
        return [{} for _ in n_actions]
    from posttrain.algos.shaping import dapo_overlong_penalty

    pen = dapo_overlong_penalty(
        torch.tensor(list(n_actions), dtype=torch.float64), spec.overlong_max_len, spec.overlong_cache_len
    )
    return [{"overlong": float(p)} for p in pen]


def judge(completions: Sequence[Sample], examples: Sequence[Example], *, verifier: Verifier, tokenizer: Decoder,
          verify_batch: VerifyBatch | None = None) -> tuple[list[str], list[Verdict]]:
    """``(response texts, verdicts)`` of ``completions`` (``examples[i]`` is the prompt of ``completions[i]``),
    in one guarded verification batch.

    ``verify_batch`` (e.g. ``VerifierPool.verify_batch``, what a run passes: one guarded path for
    training and held-out evaluation); without it a ``VerifierPool(workers=0)`` verifies in-process
    under its default time limit, and an exception, a timeout or a non-Verdict becomes
    ``infra_error`` (counted, never a zero reward). A :class:`PromptedVerifyBatch` (``reward.model`` /
    ``reward.judge``) is given each example's prompt too (its chat ``messages`` when it has them).
    """
    texts = [decode_response(tokenizer, c) for c in completions]
    if verify_batch is None:
        verify_batch = VerifierPool(workers=0).verify_batch
    items = [(verifier, t, ex.reference, verify_context(verifier, ex)) for t, ex in zip(texts, examples, strict=True)]
    if isinstance(verify_batch, PromptedVerifyBatch):
        prompts = [getattr(ex, "messages", None) or str(ex.prompt) for ex in examples]
        return texts, verify_batch.verify_with_prompts(items, prompts)
    return texts, verify_batch(items)


def to_trajectories(
    completions: Sequence[ScoredCompletion],
    examples: Sequence[Example],
    texts: Sequence[str],
    verdicts: Sequence[Verdict],
    *,
    verifier: Verifier,
    spec: ScoringSpec,
    group_ids: Sequence[str],
    traj_ids: Sequence[str],
    metas: Sequence[Mapping[str, JSONScalar]] | None = None,
) -> list[Trajectory]:
    """Rewarded trajectories of judged completions: the reward is ``compose(verdict components +
    DAPO overlong shaping, spec.weights)`` (none for an ``infra_error``); ``meta`` holds the response,
    reference and explanation, then ``metas[i]``."""
    shaping = _shaping_components(spec, [len(c.token_ids) for c in completions])
    verifier_id = f"{verifier.name}@{verifier.version}"
    trajs: list[Trajectory] = []
    for i, (c, ex, v, text, extra) in enumerate(zip(completions, examples, verdicts, texts, shaping, strict=True)):
        if v.status is Status.INFRA_ERROR:
            reward = Reward(components={}, weights=dict(spec.weights), total=None)
        else:
            reward = compose({**v.components, **extra}, spec.weights)
        trajs.append(c.to_trajectory(
            traj_id=traj_ids[i], prompt_id=ex.prompt_id, group_id=group_ids[i], status=v.status, reward=reward,
            verifier=verifier_id,
            meta={"response": text, "reference": str(ex.reference), "explanation": v.explanation[:500],
                  **(dict(metas[i]) if metas is not None else {})}))
    return trajs


class _Recorder(Protocol):
    def record(self, example: Any) -> dict[str, str]: ...  # a PromptRenderer (example: a TaskExample)


def score(
    completions: Sequence[ScoredCompletion],
    examples: Sequence[Example],
    *,
    task: HasVerifier,
    tokenizer: Decoder,
    spec: ScoringSpec,
    group_ids: Sequence[str],
    step: int,
    verify_batch: VerifyBatch | None = None,
    traj_ids: Sequence[str] | None = None,
    metas: Sequence[Mapping[str, JSONScalar]] | None = None,
    renderer: _Recorder | None = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Verify and reward ``completions`` (:func:`judge` then :func:`to_trajectories`).

    ``traj_ids`` (default ``s{step}-{i}``) and ``metas`` (extra JSON scalars per completion,
    e.g. partial-rollout accounting) name and annotate the records. ``renderer`` (the
    :class:`~posttrain.envs.prompt_render.PromptRenderer` that made the prompt ids) adds its
    record to each meta: ``prompt_format``, ``chat_template`` (fingerprint), ``prompt_source``.
    Returns the trajectories and ``{"time/reward_s": ...}``.
    """
    t0 = time.perf_counter()
    texts, verdicts = judge(completions, examples, verifier=task.verifier, tokenizer=tokenizer,
                            verify_batch=verify_batch)
    extra = [{**(dict(metas[i]) if metas is not None else {}), **(renderer.record(ex) if renderer is not None else {})}
             for i, ex in enumerate(examples)]
    trajs = to_trajectories(completions, examples, texts, verdicts, verifier=task.verifier, spec=spec,
                            group_ids=group_ids,
                            traj_ids=traj_ids if traj_ids is not None else [f"s{step}-{i}" for i in range(len(examples))],
                            metas=extra)
    return trajs, {"time/reward_s": time.perf_counter() - t0}
