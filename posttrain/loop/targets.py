"""Freeze old coordinates and build targets: pi_old / pi_ref log-probs, values, advantages.

Runs after scoring and before the update: two stages of the RL step (``update_step``), :func:`frozen_batch`
(the usable trajectories collated once, pi_old / pi_ref / the teacher's log-probs and the critic's values
frozen onto the batch) then :func:`step_targets` (advantages and returns attached, with the distillation
figures); a pi_old fused into the update is frozen afterwards by :func:`with_fused_old`. The reward of a
sequence enters the estimator once (``rewards [B]`` for sequence-level estimators, or placed on the last
action token for token-level ones); it is never copied to every token and then summed. On-policy
distillation (``loss.distill``) adds its per-token reverse-KL advantage to the estimator's (or, with
``loss.distill.only``, is the whole advantage): :func:`build_targets`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

import posttrain.algos as A
from posttrain.algos.advantages import AdvantageInputs
from posttrain.loop.kl_control import kl_coef_of
from posttrain.trajectory import Finish, Trajectory, TrajectoryBatch, collate

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.envs.task import TaskExample
    from posttrain.loop.parts import Parts
    from posttrain.loop.single_turn import Renderer, Sampler
    from posttrain.models.tokenizer_protocol import Tokenizer
    from posttrain.rewards.scoring import HasVerifier, ScoringSpec, VerifyBatch

TOKEN_LEVEL_ESTIMATORS = frozenset({"gae", "reinforce_pp", "reinforce_pp_baseline"})


@dataclasses.dataclass
class Targets:
    """Everything the update consumes, aligned to the batch (``[B, T]`` unless noted)."""

    old_logprob: torch.Tensor | None  # None: built before the fused update froze pi_old
    ref_logprob: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    values: torch.Tensor | None
    rewards: torch.Tensor  # [B]
    token_kl: torch.Tensor | None
    # loss.distill: log pi_old - log pi_teacher per token [B, T] float64, 0 off the action mask (else None)
    teacher_kl: torch.Tensor | None = None


def check_estimator_needs(cfg: RunConfig) -> None:
    """Refuse (``ValueError``, one line naming the keys) a ``credit.estimator`` whose declared needs
    (``ADVANTAGES.needs``, vocabulary :data:`posttrain.algos.registry.NEEDS`) this run cannot fill.

    What the loop provides: ``critic`` when ``critic.enabled``; ``groups>=2`` when
    ``sampling.group_size >= 2``; ``baseline`` (a greedy rollout per prompt, :func:`greedy_baseline`)
    in ``system.mode=sync`` with ``partial_fraction=1`` (the engine is idle between rollout and
    update and holds the behaviour weights); ``step_ids`` with ``env.name`` set (multi-turn episodes
    record their steps: :func:`step_fields`). Conversely ``critic.enabled`` with a built-in estimator
    that does not need ``critic`` is refused: it returns no critic targets, so the critic would be
    evaluated every step and never trained or read (``loss.distill.only`` refuses it in
    :func:`~posttrain.loop.preflight.check_distill`; a ``module:function`` plug-in may read the values).
    """
    name = cfg.credit.estimator
    distill_only = cfg.loss.distill is not None and cfg.loss.distill.only  # check_distill names its keys
    if cfg.critic.enabled and ":" not in name and "critic" not in A.ADVANTAGES.needs(name) and not distill_only:
        # Only an estimator that reads the values returns the critic's targets: the critic would be evaluated
        # every step and never trained or read (a plug-in may read them without declaring it: not refused).
        raise ValueError(f"critic.enabled=true cannot take effect: credit.estimator={name} does not read critic "
                         "values (the critic would be evaluated every step, never trained nor used); use "
                         "credit.estimator=gae or drop critic.enabled")
    for need in sorted(A.ADVANTAGES.needs(name)):
        if need == "critic" and not cfg.critic.enabled:
            raise ValueError(f"credit.estimator={name} needs critic.enabled=true (per-token values for GAE)")
        if need == "groups>=2" and cfg.sampling.group_size < 2:
            raise ValueError(f"credit.estimator={name} needs sampling.group_size >= 2 (got "
                             f"{cfg.sampling.group_size}): its baseline is a group statistic")
        if need == "baseline" and (cfg.system.mode != "sync" or cfg.system.partial_fraction < 1.0):
            raise ValueError(f"credit.estimator={name} needs system.mode=sync and system.partial_fraction=1: its "
                             "greedy baseline rollout runs between a step's rollout and its update")
        if need == "step_ids" and cfg.env.name is None:
            raise ValueError(f"credit.estimator={name} needs per-step ids of multi-turn episodes: set env.name (a "
                             "multi-turn environment), or use grpo for single-turn tasks")


def greedy_baseline(
    batch: TrajectoryBatch,
    examples: Mapping[str, TaskExample],
    *,
    engine: Sampler,
    tokenizer: Tokenizer,
    task: HasVerifier,
    spec: ScoringSpec,
    max_new_tokens: int,
    step: int,
    verify_batch: VerifyBatch | None = None,
    renderer: Renderer | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ReMax's baseline (Li et al. 2023, arXiv:2310.10505): per row, the reward of one greedy
    (temperature 0) response of its prompt under the engine's current (behaviour) weights, scored
    exactly like the samples (:func:`posttrain.loop.single_turn.play_once`, same weights and shaping).

    ``examples`` maps ``prompt_id`` -> the ``TaskExample``; ``renderer`` is the run's
    :class:`~posttrain.envs.prompt_render.PromptRenderer` (default raw text), so the greedy response
    answers the very prompt the samples answered. A prompt whose greedy response is an
    infra error has no baseline: its rows get their own reward as baseline (advantage 0, no
    signal), counted in ``remax/baseline_infra_errors``. Returns ``([B] float64, metrics)``.
    """
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.loop.single_turn import play_once
    from posttrain.rollout.sampling import SamplingParams

    pids = list(dict.fromkeys(t.prompt_id for t in batch.trajectories))
    missing = [p for p in pids if p not in examples]
    if missing:
        raise RuntimeError(f"greedy_baseline: no example for prompt(s) {missing[:3]}")
    exs = [examples[p] for p in pids]
    played = play_once(engine, exs, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, n=1, seed=0),
                       request_ids=[f"remax{step}-{i}" for i in range(len(exs))],
                       renderer=renderer if renderer is not None else PromptRenderer(tokenizer),
                       verifier=task.verifier, tokenizer=tokenizer, verify_batch=verify_batch)
    trajs = played.trajectories(verifier=task.verifier, spec=spec)
    base_of = {p: t.reward.total for p, t in zip(pids, trajs, strict=True)}
    own = [float(t.reward.total) for t in batch.trajectories]  # type: ignore[arg-type]
    base = [own[i] if base_of[t.prompt_id] is None else float(base_of[t.prompt_id])  # type: ignore[arg-type]
            for i, t in enumerate(batch.trajectories)]
    n_infra = sum(v is None for v in base_of.values())
    known = [float(v) for v in base_of.values() if v is not None]
    return torch.tensor(base, dtype=torch.float64), {
        "remax/baseline_infra_errors": float(n_infra),
        "remax/baseline_reward_mean": sum(known) / len(known) if known else float("nan"),
    }


class BaselineParts(Protocol):
    """What ReMax's baseline reads of a run's parts (met by :class:`~posttrain.loop.parts.Parts`)."""

    @property
    def cfg(self) -> RunConfig: ...

    @property
    def engine(self) -> Sampler: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def task(self) -> HasVerifier: ...

    @property
    def verify_batch(self) -> VerifyBatch | None: ...

    @property
    def renderer(self) -> Renderer: ...


def run_baseline(parts: BaselineParts, step_examples: dict[str, TaskExample], batch: TrajectoryBatch,
                 step: int) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The ``baseline`` input of the estimator of ``parts.cfg`` when it declared that need, else
    ``(None, {})``: :func:`greedy_baseline` with the parts' engine, tokenizer, task, verification and
    renderer.

    Uses the prompts this step drew (``step_examples``: the run's prompt id -> example, filled by
    :meth:`~posttrain.loop.run.Run.next_prompts`, then cleared: in sync mode every prompt drawn for a step is
    consumed or dropped by its end; :func:`check_estimator_needs`).
    """
    cfg = parts.cfg
    if "baseline" not in A.ADVANTAGES.needs(cfg.credit.estimator):
        return None, {}
    from posttrain.rewards.scoring import ScoringSpec

    spec = ScoringSpec.of(cfg.reward)
    try:
        return greedy_baseline(batch, step_examples, engine=parts.engine, tokenizer=parts.tokenizer,
                               task=parts.task, spec=spec, max_new_tokens=cfg.sampling.max_new_tokens,
                               step=step, verify_batch=parts.verify_batch, renderer=parts.renderer)
    finally:
        step_examples.clear()


# ---------------------------------------------------------------------------------------------
# the RL step's stages


def fuses_old_logprob(cfg: RunConfig, parts: Parts) -> bool:
    """True when this step's pi_old comes from the update's own forward, detached (no separate no-grad
    forward): ``optim.fuse_old_logprob``, one optimiser step per update (the learner's
    ``can_fuse_old_logprob``) and nothing before the update that reads pi_old (no ``credit.kl_in_reward``, no
    ``loss.distill``)."""
    return bool(cfg.optim.fuse_old_logprob and parts.learner.can_fuse_old_logprob() and not cfg.credit.kl_in_reward
                and cfg.loss.distill is None)


def frozen_batch(cfg: RunConfig, parts: Parts, usable: list[Trajectory], ref_version: int
                 ) -> tuple[TrajectoryBatch, bool]:
    """The batch-preparation stage: ``(batch, fuse)``, the usable trajectories collated once with pi_old (at
    the learner's version; not when ``fuse``: :func:`fuses_old_logprob`, then the update freezes it), pi_ref
    (at ``ref_version``), the teacher's log-probs (``loss.distill``) and the critic's values frozen onto it.

    Each recorded prompt is re-rendered first: pi_old must be computed on the ids the engine sampled from (a
    changed template / system prompt is an error). The reference's and teacher's log-probs are
    :func:`~posttrain.loop.parts.frozen_logprobs` (the learner's temperature and truncation replayed)."""
    from posttrain.loop.parts import frozen_logprobs

    fuse = fuses_old_logprob(cfg, parts)
    old_version = parts.learner.version
    parts.renderer.verify(usable)
    batch = collate(usable, pad_token_id=parts.pad_token_id)
    if not fuse:
        batch = batch.freeze("old", parts.learner.compute_logprobs(batch), old_version)
    if parts.ref_model is not None:
        batch = batch.freeze("ref", frozen_logprobs(parts, parts.ref_model, batch), ref_version)
    if parts.teacher_model is not None:  # loss.distill: the frozen teacher scores the student's own tokens
        batch = batch.freeze("teacher", frozen_logprobs(parts, parts.teacher_model, batch))
    if parts.critic is not None:
        values, final_values = parts.critic.compute_values(batch)
        batch = batch.with_targets(values=values, final_values=final_values)
    return batch, fuse


def step_targets(parts: Parts, step_examples: dict[str, TaskExample], batch: TrajectoryBatch, step: int
                 ) -> tuple[TrajectoryBatch, Targets, dict[str, float]]:
    """The targets stage: ``(batch, targets, metrics)``, the step's advantages and returns
    (:func:`build_targets` with the estimator of ``parts.cfg``, its KL placement, ReMax baseline
    (:func:`run_baseline` over ``step_examples``, the prompts the run drew this step) and distillation)
    attached to the batch, and the figures they produced: ``remax/*`` and :func:`distill_metrics`. beta is the
    learner's ``kl_coef`` now (:func:`~posttrain.loop.kl_control.kl_coef_of`). Fused (no pi_old yet): the
    advantages need none (no KL in the reward); the token KL waits for :func:`with_fused_old`."""
    cfg = parts.cfg
    baseline, metrics = run_baseline(parts, step_examples, batch, step)  # ReMax: one greedy rollout a prompt
    tg = build_targets(
        batch, estimator=cfg.credit.estimator, estimator_kwargs=cfg.credit.kwargs,
        kl_in_reward=cfg.credit.kl_in_reward, kl_estimator=cfg.loss.kl_estimator,
        kl_coef=kl_coef_of(parts.learner.kl_coef), baseline=baseline,
        distill_coef=None if cfg.loss.distill is None else cfg.loss.distill.coef,
        distill_only=cfg.loss.distill is not None and cfg.loss.distill.only,
    )
    batch = batch.with_targets(advantages=tg.advantages, returns=tg.returns)
    return batch, tg, {**metrics, **distill_metrics(tg, batch)}


def with_fused_old(batch: TrajectoryBatch, tg: Targets, old_logprob: torch.Tensor, version: int,
                   kl_estimator: str | None) -> tuple[TrajectoryBatch, Targets]:
    """A pi_old the update fused into its own forward (``UpdateOutput.old_logprob``) frozen onto the batch
    at ``version`` (the learner's before the update) and into the targets, whose token KL to pi_ref
    (:func:`ref_token_kl`) is computed from it."""
    batch = batch.freeze("old", old_logprob, version)
    token_kl = ref_token_kl(batch.old_logprob, batch.ref_logprob, batch.action_mask, kl_estimator)
    return batch, dataclasses.replace(tg, old_logprob=batch.old_logprob, ref_logprob=batch.ref_logprob,
                                      token_kl=token_kl)


def step_fields(batch: TrajectoryBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GiGPO's per-step inputs of a batch of multi-turn episodes (Feng et al. 2025, arXiv:2505.10978).

    From each trajectory's step record (``Trajectory.steps``, written by
    :class:`~posttrain.envs.multiturn.EpisodeState`):
    ``step_index [B, T]`` long = the step (0-based policy turn) of each action token, -1 on prompt,
    observation and padding tokens; ``step_anchor [B, S]`` long = the hash of the state each step
    was taken in (-1 past an episode's last step); ``step_rewards [B, S]`` float64 = the weighted
    reward of each step (0 past the last step). ``S`` = the most steps in the batch.
    Raises ``ValueError`` naming the trajectory when it has no step record (single-turn).
    """
    import numpy as np

    b, t_len = batch.action_mask.shape
    recs = []
    for tr in batch.trajectories:
        if tr.steps is None:
            raise ValueError(f"trajectory {tr.traj_id!r}: no step record (Trajectory.steps); step-level credit "
                             "needs multi-turn episodes (env.name)")
        recs.append((tr.steps.anchors, tr.steps.rewards, tr.steps.action_tokens))
    s_len = max([len(r[0]) for r in recs] + [1])
    index = torch.full((b, t_len), -1, dtype=torch.long)
    anchor = torch.full((b, s_len), -1, dtype=torch.long)
    rewards = torch.zeros((b, s_len), dtype=torch.float64)
    for i, (tr, (anchors, rews, lens)) in enumerate(zip(batch.trajectories, recs, strict=True)):
        pos = np.flatnonzero(tr.action_mask)
        if sum(lens) != pos.size or not len(anchors) == len(rews) == len(lens):
            raise ValueError(f"trajectory {tr.traj_id!r}: step record ({len(lens)} steps, {sum(lens)} tokens) does "
                             f"not match its {pos.size} action tokens")
        steps = np.repeat(np.arange(len(lens)), lens)
        index[i, torch.from_numpy(pos)] = torch.from_numpy(steps).long()
        if anchors:
            anchor[i, : len(anchors)] = torch.tensor(anchors, dtype=torch.long)
            rewards[i, : len(rews)] = torch.tensor(rews, dtype=torch.float64)
    return index, anchor, rewards


def group_index(batch: TrajectoryBatch) -> torch.Tensor:
    """``[B]`` long group ids (rows of one prompt's G samples share an id)."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(t.group_id, len(ids)) for t in batch.trajectories], dtype=torch.long)


def ref_token_kl(
    old_logprob: torch.Tensor | None, ref_logprob: torch.Tensor | None, action_mask: torch.Tensor,
    kl_estimator: str | None,
) -> torch.Tensor | None:
    """Per-token KL estimate ``KL_ESTIMATORS[kl_estimator](pi_old, pi_ref)`` ``[B, T]`` float64, 0 off
    ``action_mask``; ``None`` when either log-prob or the estimator is missing (k1/k2/k3: Schulman
    2020, "Approximating KL divergence"; as a reward penalty: Ouyang et al. 2022, arXiv:2203.02155)."""
    if old_logprob is None or ref_logprob is None or kl_estimator is None:
        return None
    kl: torch.Tensor = A.KL_ESTIMATORS[kl_estimator](old_logprob.to(torch.float64), ref_logprob.to(torch.float64))
    return kl * action_mask.to(torch.float64)


def build_targets(
    batch: TrajectoryBatch,
    *,
    old_logprob: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    final_values: torch.Tensor | None = None,
    estimator: str = "grpo",
    estimator_kwargs: Mapping[str, object] | None = None,
    kl_in_reward: bool = False,
    kl_estimator: str | None = None,
    kl_coef: float = 0.0,
    baseline: torch.Tensor | None = None,
    teacher_logprob: torch.Tensor | None = None,
    distill_coef: float | None = None,
    distill_only: bool = False,
) -> Targets:
    """Compute advantages (and returns) with the registered ``estimator``; ``baseline`` [B] is
    ReMax's greedy-rollout reward per row (:func:`greedy_baseline`). The estimator is called with
    ``estimator_kwargs`` as validated by its typed model (``Registry.validate_kwargs``; a ``ValueError``
    names the bad ``credit.kwargs`` key).

    ``kl_in_reward``: each action token's reward gets ``-kl_coef * token_kl`` (Ouyang et al. 2022,
    arXiv:2203.02155); ``kl_coef`` is this step's beta, in a run the learner's fixed coefficient or its
    adaptive controller's current value (:func:`~posttrain.loop.kl_control.kl_coef_of`), finite and >= 0.

    ``old_logprob`` / ``ref_logprob`` / ``values`` / ``final_values`` default to the ones frozen on
    ``batch`` (:meth:`TrajectoryBatch.freeze`, ``with_targets``). ``token_kl`` (pi_old vs pi_ref,
    :func:`ref_token_kl`) is ``None`` while either is missing — the fused pi_old path builds its
    advantages before pi_old exists, which is only allowed without ``kl_in_reward``.
    On-policy distillation (``distill_coef`` set: ``loss.distill.coef``; :func:`distill_terms`, which needs
    pi_old and ``teacher_logprob``, default the one frozen on ``batch``): each action token's advantage gets
    ``-distill_coef * (log pi_old - log pi_teacher)`` (Agarwal et al. 2024, GKD, arXiv:2306.13649), added to
    the estimator's advantages broadcast over the tokens, or with ``distill_only`` in their place (the
    estimator is not run: ``returns`` is None); ``Targets.teacher_kl`` holds ``log pi_old - log pi_teacher``.
    The result is not attached to the batch: the caller does (``batch.with_targets``)."""
    old_logprob, ref_logprob, values, final_values, teacher_logprob = (
        given if given is not None else getattr(batch, name, None) for name, given in (
            ("old_logprob", old_logprob), ("ref_logprob", ref_logprob), ("values", values),
            ("final_values", final_values), ("teacher_logprob", teacher_logprob)))
    mask = batch.action_mask.to(torch.float64)
    rewards = torch.tensor([float(t.reward.total) for t in batch.trajectories], dtype=torch.float64)  # type: ignore[arg-type]
    token_kl = ref_token_kl(old_logprob, ref_logprob, batch.action_mask, kl_estimator)
    token_rewards = kl_token_rewards(token_kl, ref_logprob is not None, kl_in_reward=kl_in_reward,
                                     kl_estimator=kl_estimator, kl_coef=kl_coef, estimator=estimator)
    distill_adv, teacher_kl = distill_terms(old_logprob, teacher_logprob, batch.action_mask, distill_coef,
                                            distill_only)
    if distill_only and distill_adv is not None:  # (distill_terms refuses distill_only without distill_coef)
        return Targets(old_logprob=old_logprob, ref_logprob=ref_logprob, advantages=distill_adv, returns=None,
                       values=values, rewards=rewards, token_kl=token_kl, teacher_kl=teacher_kl)
    inputs = advantage_inputs(batch, mask, rewards, token_rewards, values=values, final_values=final_values,
                              baseline=baseline, estimator=estimator)
    hyper = A.ADVANTAGES.validate_kwargs(estimator, estimator_kwargs or {}, key="credit.kwargs")  # typed values
    out = A.ADVANTAGES[estimator](inputs, **hyper)
    advantages = out.advantages
    if distill_adv is not None:  # the verifiable reward's advantage plus the teacher's per-token signal
        base = advantages.to(torch.float64)
        advantages = (base[:, None] if base.dim() == 1 else base) * mask + distill_adv
    return Targets(old_logprob=old_logprob, ref_logprob=ref_logprob, advantages=advantages, returns=out.returns,
                   values=values, rewards=rewards, token_kl=token_kl, teacher_kl=teacher_kl)


def kl_token_rewards(token_kl: torch.Tensor | None, has_ref: bool, *, kl_in_reward: bool, kl_estimator: str | None,
                     kl_coef: float, estimator: str) -> torch.Tensor | None:
    """The per-token reward of KL in the reward, ``-kl_coef * token_kl`` ``[B, T]`` (Ouyang et al. 2022,
    arXiv:2203.02155), or None without ``kl_in_reward`` or a ``token_kl``.

    The sequence reward enters once: the estimators place ``rewards`` on the last action token
    themselves; these token rewards carry only the KL penalty. ``ValueError`` with ``kl_in_reward``
    when pi_ref (``has_ref``) and the estimator are set but pi_old is missing (``token_kl`` None), when
    ``kl_coef`` is not finite and >= 0, or when ``estimator`` is not token-level
    (:data:`TOKEN_LEVEL_ESTIMATORS`).
    """
    if kl_in_reward and token_kl is None and has_ref and kl_estimator is not None:
        raise ValueError("credit.kl_in_reward needs pi_old frozen before the targets (batch.freeze('old', ...))")
    if not (kl_in_reward and token_kl is not None):
        return None
    if not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"credit.kl_in_reward: the KL coefficient must be finite and >= 0, got {kl_coef}")
    if estimator not in TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(f"credit.kl_in_reward needs a token-level estimator ({', '.join(sorted(TOKEN_LEVEL_ESTIMATORS))})")
    return -kl_coef * token_kl


def distill_terms(old_logprob: torch.Tensor | None, teacher_logprob: torch.Tensor | None, action_mask: torch.Tensor,
                  distill_coef: float | None, distill_only: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(distill advantage, teacher_kl)`` of on-policy distillation (``loss.distill``; Agarwal et al. 2024,
    GKD, arXiv:2306.13649), both ``[B, T]`` float64 and 0 off ``action_mask``, or ``(None, None)`` without
    ``distill_coef``: the advantage is ``-distill_coef * (log pi_old - log pi_teacher)``
    (:func:`posttrain.algos.distill.reverse_kl_advantage`), ``teacher_kl`` the estimate
    ``log pi_old - log pi_teacher``. ``ValueError`` when ``distill_coef`` is set without both log-probs,
    or ``distill_only`` without ``distill_coef``.
    """
    if distill_coef is None:
        if distill_only:
            raise ValueError("distill_only needs distill_coef (loss.distill)")
        return None, None
    if old_logprob is None or teacher_logprob is None:
        raise ValueError("loss.distill needs pi_old and the teacher's log-probs frozen before the targets "
                         "(batch.freeze('old', ...), batch.freeze('teacher', ...))")
    from posttrain.algos.distill import reverse_kl_advantage

    distill_adv = reverse_kl_advantage(old_logprob, teacher_logprob, action_mask, distill_coef)
    return distill_adv, -reverse_kl_advantage(old_logprob, teacher_logprob, action_mask)


def advantage_inputs(batch: TrajectoryBatch, mask: torch.Tensor, rewards: torch.Tensor,
                     token_rewards: torch.Tensor | None, *, values: torch.Tensor | None,
                     final_values: torch.Tensor | None, baseline: torch.Tensor | None, estimator: str
                     ) -> AdvantageInputs:
    """The estimator's :class:`~posttrain.algos.advantages.AdvantageInputs` of ``batch``: ``mask`` (the action
    mask, float64), sequence ``rewards`` [B], ``token_rewards`` (KL penalty) [B, T], group ids
    (:func:`group_index`), ``values`` / ``final_values`` (a truncated row bootstraps from the critic's value
    of the state after its last token) / ReMax ``baseline`` as float64, ``terminal`` [B] bool
    (``Finish.TERMINAL``), and GiGPO's step fields (:func:`step_fields`) when ``estimator`` needs ``step_ids``.
    """
    terminal = torch.tensor([t.finish is Finish.TERMINAL for t in batch.trajectories])
    steps: dict[str, torch.Tensor] = {}
    if "step_ids" in A.ADVANTAGES.needs(estimator):  # GiGPO: the episodes' step record
        steps = dict(zip(("step_index", "step_anchor", "step_rewards"), step_fields(batch), strict=True))
    return AdvantageInputs(
        action_mask=mask,
        rewards=rewards,
        token_rewards=token_rewards,
        group_index=group_index(batch),
        values=None if values is None else values.to(torch.float64),
        terminal=terminal,
        # A truncated row bootstraps from the critic's value of the state after its last token.
        bootstrap_value=None if final_values is None else final_values.to(torch.float64),
        baseline=None if baseline is None else baseline.to(torch.float64),
        **steps,
    )


def distill_metrics(targets: Targets, batch: TrajectoryBatch) -> dict[str, float]:
    """The step's distillation figures (empty without ``loss.distill``): ``distill/reverse_kl_mean``, the
    mean over action tokens of ``log pi_old - log pi_teacher`` (k1 estimate of the per-token reverse KL
    to the teacher on the student's own samples), and ``distill/reverse_kl_seq_mean``, its sum per
    sequence averaged over the rows (the sequence-level reverse KL estimate)."""
    if targets.teacher_kl is None:
        return {}
    mask = batch.action_mask > 0
    kl = targets.teacher_kl
    return {"distill/reverse_kl_mean": float(kl[mask].mean()) if bool(mask.any()) else 0.0,
            "distill/reverse_kl_seq_mean": float((kl * mask).sum(dim=1).mean())}
