"""``trainer: preference`` with ``preference.online: true``: preference pairs from the run's own sampled groups.

Each step samples ``sampling.prompts_per_step`` groups of ``sampling.group_size`` responses with the RL
run's own parts and the RL run's lifecycle (:func:`~posttrain.loop.sampling_lifecycle.run_sampling`: task,
engine, verifier pool, ledger, checkpoints, the rollout of ``system.mode``), and the task's verifier
labels them. Within a group, a ``correct`` response is preferred to a ``wrong`` or ``invalid`` one (an
answer that is wrong, or that cannot be read): with ``preference.pairs_per_group: one`` the group gives
one pair (its first correct response against its first wrong one, in sampling order), with ``all`` every
correct x wrong pair. A group that is all correct or all wrong gives none (it says nothing about which
response is better); ``timeout`` and infrastructure failures never enter a pair. The pairs then train the
policy with the loss of ``preference.loss`` against a frozen reference (the policy at the start, after
the SFT warm-up if any), exactly as offline (:class:`~posttrain.loop.preference_step.PairBatchLoss`,
through the policy learner's own optimiser, schedule and mini-batch settings: :func:`train_pairs`, its
``forward_backward_custom`` + ``optim_step``), and the engine gets the new weights. Held-out evaluation,
promotion, guards, the ledger (every sampled response with its
verdict) and checkpoints are the RL loop's. ODPO's ``score_diff`` is the reward difference of the pair
(clamped at 0). This is the "online / iterative DPO" of Xiong et al. 2024 (arXiv:2312.11456) and Guo et
al. 2024 (arXiv:2402.04792) with the verifier as the preference oracle.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from posttrain.config import RunConfig
from posttrain.errors import UserError
from posttrain.learner.optim_step import StepTally
from posttrain.loop.guards import check_guards
from posttrain.loop.lifecycle import eval_due
from posttrain.loop.parts import Parts, sync_weights
from posttrain.loop.preference_batch import EncodedPair, pair_logprobs
from posttrain.loop.preference_loss import check_loss_kwargs, uses_reference
from posttrain.loop.preference_step import PairBatch, PairBatchLoss, PreferenceRunResult
from posttrain.loop.producer import consumption_metrics
from posttrain.loop.sampling_lifecycle import SamplingProgram, SamplingStep, heldout_result, run_sampling
from posttrain.loop.step_metrics import length_metrics, status_counts
from posttrain.trajectory import Status, Trajectory

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.learner.protocol import Learner
    from posttrain.loop.checkpointing import RunState
    from posttrain.loop.producer import Produced, Producer
    from posttrain.loop.run import Run, StepMetrics

REJECTED = (Status.WRONG, Status.INVALID)
"""Verdicts of a rejected response (a chosen one is ``correct``)."""

REFERENCE_DIR = "reference"
"""Where the reference is kept when it is not the model as loaded (after an SFT warm-up), for a resume."""


def _split(t: Trajectory) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prompt ids, response ids)`` of a single-turn trajectory."""
    mask = t.action_mask.astype(bool)
    first = int(np.argmax(mask)) if mask.any() else len(mask)
    return tuple(int(x) for x in t.token_ids[:first]), tuple(int(x) for x in t.token_ids[mask])


def group_pairs(trajectories: Sequence[Trajectory], per_group: str) -> list[EncodedPair]:
    """The pairs of a step's trajectories (module docstring): per group (``group_id``, in order), its
    ``correct`` responses against its ``wrong`` / ``invalid`` ones; ``per_group`` ``"one"`` (the first of
    each) or ``"all"`` (every combination). ``score_diff``: reward(chosen) - reward(rejected), at least 0."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    out: list[EncodedPair] = []
    for gid, members in groups.items():
        good = [t for t in members if t.status == Status.CORRECT and t.num_actions > 0]
        bad = [t for t in members if t.status in REJECTED and t.num_actions > 0]
        if per_group == "one":
            good, bad = good[:1], bad[:1]
        for c in good:
            for r in bad:
                prompt, chosen = _split(c)
                _, rejected = _split(r)
                diff = max(float(c.reward.total or 0.0) - float(r.reward.total or 0.0), 0.0)
                out.append(EncodedPair(pair_id=f"{c.traj_id}>{r.traj_id}", prompt=prompt, chosen=chosen,
                                       rejected=rejected, score_diff=diff, source=f"group {gid}"))
    return out


def _reference(run: Run, fresh: bool) -> torch.nn.Module | None:
    """The frozen reference: the policy now (a fresh run, after its warm-up: saved to ``reference/`` when
    a warm-up changed it) or, on resume, that saved copy / the model as loaded."""
    cfg = run.cfg
    if not uses_reference(cfg.preference.loss):
        return None
    saved = run.dir / REFERENCE_DIR
    if fresh:
        ref = copy.deepcopy(run.parts.learner.model).eval().requires_grad_(False)
        if cfg.sft.steps > 0:
            from posttrain.learner.checkpoint import quiet_hf_progress

            with quiet_hf_progress():
                ref.save_pretrained(str(saved))  # type: ignore[operator]
        return ref
    from posttrain.learner.checkpoint import load_pretrained_weights
    from posttrain.loop.builders import build_model

    _, model = build_model(cfg)
    if cfg.sft.steps > 0:
        load_pretrained_weights(model, saved)
    return model.eval().requires_grad_(False)


def train_pairs(learner: Learner, loss: PairBatchLoss, num_pairs: int) -> dict[str, float]:
    """One online step's update, a program over the learner's primitives: for each of the learner's
    epochs x shuffled mini-batches of the pairs, ``forward_backward_custom`` (the pair loss runs its own
    sequence forward) then ``optim_step`` (the last one ends the update: the learner's ``version`` + 1, so
    the engine's next samples carry the new version). Returns the last mini-batch's loss metrics and the
    optimiser steps' (``optimizer_steps``, ``grad_norm`` ...)."""
    plan = learner.minibatch_plan(num_pairs)
    steps, metrics = StepTally(), {}
    for i, rows in enumerate(plan):
        metrics = learner.forward_backward_custom(rows, loss).metrics
        steps.record(learner.optim_step(ends_update=i == len(plan) - 1))
    return {**metrics, **steps.metrics()}


def online_pair_loss(learner: Learner, batch: PairBatch, cfg: RunConfig, pad_id: int) -> PairBatchLoss:
    """The loss of one online step's pairs on the policy learner's model (``learner.forward_backward_custom``
    runs it under the learner's grad mode: train mode when ``optim.gradient_checkpointing``)."""
    return PairBatchLoss(learner.model, batch, cfg, pad_id)


def _reward_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/mean``, ``status/*`` and the lengths the guards read (``length/*``, ``finish/truncated_rate``)."""
    totals = [float(t.reward.total) for t in trajs if t.reward.total is not None]
    lengths = length_metrics(trajs) if trajs else {}
    return {"reward/mean": float(np.mean(totals)) if totals else float("nan")} | status_counts(trajs) | lengths


def train_online_preference(cfg: RunConfig, progress: Progress | None = None) -> PreferenceRunResult:
    """Run ``cfg.steps`` online preference steps (module docstring) over the sampling trainers' lifecycle
    (:func:`~posttrain.loop.sampling_lifecycle.run_sampling`, :data:`ONLINE_PREFERENCE`); returns what the run
    did. ``preference.kwargs`` that the loss does not take: one-line :class:`~posttrain.errors.UserError`
    before the run directory is touched.

    An interrupt (``KeyboardInterrupt``, or one :func:`~posttrain.loop.interrupt.interrupt_flag` recorded and
    a finalizer swallowed: raised before the next step) propagates after the producer and the run are closed;
    the checkpoints already written are untouched."""
    try:
        check_loss_kwargs(cfg.preference.loss, cfg.preference.kwargs)
    except ValueError as e:
        raise UserError(str(e)) from None
    return heldout_result(run_sampling(cfg, ONLINE_PREFERENCE, progress))


def pair_update_step(ref: torch.nn.Module | None, run: Run, producer: Producer, step: int, produced: Produced,
                     t_step: float) -> tuple[StepMetrics, str | None]:
    """One online preference step (module docstring) against the frozen reference ``ref``: the step's pairs
    (:func:`group_pairs`) train the policy (:func:`train_pairs`), the engine gets the new weights inside
    ``producer.quiesce()`` and is evaluated when due, the guards are checked and the step recorded (every
    sampled response with its verdict). Returns ``(metrics, stop_reason)``."""
    cfg, parts = run.cfg, run.parts
    trajs = produced.trajectories
    metrics: StepMetrics = {**produced.info, **_reward_metrics(trajs), **consumption_metrics(trajs, produced.dropped)}
    pairs = group_pairs(trajs, cfg.preference.pairs_per_group)
    metrics["preference/pairs"] = float(len(pairs))
    if pairs:
        t0 = time.perf_counter()
        metrics.update(_train_on_pairs(parts, ref, pairs))
        metrics["time/learner_s"] = time.perf_counter() - t0
    with producer.quiesce():
        sync_weights(parts)
        if eval_due(cfg, step):
            metrics.update(run.evaluate_and_judge(step))
    stop_reason = check_guards(cfg.guards, metrics)
    run.finish_step(step, trajs, metrics, t_step)  # ledger, metrics.jsonl, checkpoint when due
    return metrics, stop_reason


def _train_on_pairs(parts: Parts, ref: torch.nn.Module | None, pairs: Sequence[EncodedPair]) -> dict[str, float]:
    """The update on ``pairs``: their reference log-probs (none without a reference), then :func:`train_pairs`
    through the policy learner."""
    cfg, pad_id = parts.cfg, parts.pad_token_id
    refs = (None, None) if ref is None else pair_logprobs(ref, pairs, pad_id=pad_id,
                                                           microbatch_tokens=cfg.optim.microbatch_tokens)
    loss = online_pair_loss(parts.learner, PairBatch(pairs, *refs), cfg, pad_id)
    return train_pairs(parts.learner, loss, len(pairs))


def _prepare(run: Run, fresh: bool) -> SamplingStep:
    """The step of this run: :func:`pair_update_step` against its reference (:func:`_reference`)."""
    return partial(pair_update_step, _reference(run, fresh))


def _progress(step: int, metrics: StepMetrics, st: RunState) -> str:
    """The progress line: the step's pairs and the last held-out accuracy."""
    pairs = int(metrics.get("preference/pairs") or 0)
    return f"preference pairs {pairs} held-out {st.last_heldout_accuracy:.3f}"


ONLINE_PREFERENCE = SamplingProgram("preference", _prepare, _progress)
"""Online preference over the sampling trainers' lifecycle."""


__all__ = ["ONLINE_PREFERENCE", "REFERENCE_DIR", "group_pairs", "pair_update_step", "train_online_preference",
           "train_pairs"]
