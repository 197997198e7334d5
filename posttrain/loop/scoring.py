"""Completions -> verified, rewarded trajectories (the "validate statuses -> score" stage).

Every completion gets a :class:`~posttrain.rewards.Verdict`. A verifier that raises, hangs past
``reward.timeout_s`` or returns garbage is an ``infra_error`` (counted, never a zero reward); raw
components are kept unweighted in the record alongside the weights and the composed total.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.trajectory import Reward, Status, Trajectory


def decode_response(tokenizer: Any, completion: Any) -> str:
    """Response text of a completion: its generated tokens without the closing eos/specials."""
    return str(tokenizer.decode(completion.token_ids, skip_special_tokens=True))


def verify_context(verifier: Any, example: Any) -> dict[str, Any]:
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


def _shaping_components(spec: ScoringSpec, n_actions: Sequence[int]) -> list[dict[str, float]]:
    if spec.overlong_max_len is None:
        return [{} for _ in n_actions]
    from posttrain.algos.shaping import dapo_overlong_penalty

    pen = dapo_overlong_penalty(
        torch.tensor(list(n_actions), dtype=torch.float64), spec.overlong_max_len, spec.overlong_cache_len
    )
    return [{"overlong": float(p)} for p in pen]


def score(
    completions: Sequence[Any],
    examples: Sequence[Any],
    *,
    task: Any,
    tokenizer: Any,
    spec: ScoringSpec,
    group_ids: Sequence[str],
    step: int,
    verify_batch: Any | None = None,
    traj_ids: Sequence[str] | None = None,
    metas: Sequence[Mapping[str, Any]] | None = None,
    renderer: Any | None = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Verify and reward ``completions`` (``examples[i]`` is the prompt of ``completions[i]``).

    ``verify_batch`` (e.g. ``VerifierPool.verify_batch``, what a run passes: one guarded path for
    training and held-out evaluation); without it a ``VerifierPool(workers=0)`` verifies
    in-process under its default time limit, and an exception, a timeout or a non-Verdict becomes
    ``infra_error`` (counted, never a zero reward).
    ``traj_ids`` (default ``s{step}-{i}``) and ``metas`` (extra JSON scalars per completion,
    e.g. partial-rollout accounting) name and annotate the records. ``renderer`` (the
    :class:`~posttrain.envs.prompt_render.PromptRenderer` that made the prompt ids) adds its
    record to each meta: ``prompt_format``, ``chat_template`` (fingerprint), ``prompt_source``.
    Returns the trajectories and ``{"time/reward_s": ...}``.
    """
    from posttrain.rewards import VerifierPool, compose

    t0 = time.perf_counter()
    texts = [decode_response(tokenizer, c) for c in completions]
    if verify_batch is None:
        verify_batch = VerifierPool(workers=0).verify_batch
    verdicts = verify_batch([(task.verifier, t, ex.reference, verify_context(task.verifier, ex))
                             for t, ex in zip(texts, examples, strict=True)])
    shaping = _shaping_components(spec, [len(c.token_ids) for c in completions])
    verifier_id = f"{task.verifier.name}@{task.verifier.version}"
    trajs: list[Trajectory] = []
    for i, (c, ex, v, text, extra) in enumerate(zip(completions, examples, verdicts, texts, shaping, strict=True)):
        if v.status is Status.INFRA_ERROR:
            reward = Reward(components={}, weights=dict(spec.weights), total=None)
        else:
            reward = compose({**v.components, **extra}, spec.weights)
        trajs.append(
            c.to_trajectory(
                traj_id=traj_ids[i] if traj_ids is not None else f"s{step}-{i}",
                prompt_id=ex.prompt_id,
                group_id=group_ids[i],
                status=v.status,
                reward=reward,
                verifier=verifier_id,
                meta={"response": text, "reference": str(ex.reference), "explanation": v.explanation[:500],
                      **(dict(metas[i]) if metas is not None else {}),
                      **(renderer.record(ex) if renderer is not None else {})},
            )
        )
    return trajs, {"time/reward_s": time.perf_counter() - t0}
