"""``trainer: preference``: the policy trained with a preference loss on pairs (docs/learner.md, "Preference
optimisation"). Offline (this module): pairs from ``preference.data``; online (``preference.online``):
:mod:`posttrain.loop.online_preference`.

One step takes ``preference.batch_size`` training pairs at the data cursor (a seeded permutation per pass
over the training pairs, so a resume at cursor ``c`` continues the same order), computes each response's
sequence log-prob under the policy (:mod:`posttrain.loop.preference_batch`) and applies the loss of
``preference.loss`` (:mod:`posttrain.loop.preference_loss`: DPO, IPO, SimPO, ORPO, KTO, ODPO) against a
frozen reference, the policy's weights at the start (their log-probs are computed once, before the first
step); one AdamW step of ``optim.*`` through the learners' :class:`~posttrain.learner.trainer.Trainer`
(schedule over ``steps``, gradient clip, micro-batches of ``optim.microbatch_tokens``). The model stays in
eval mode (no dropout), so at step 0 the policy and the reference are the same function.

Held-out pairs (``preference.heldout_fraction``, split by a hash of the prompt) are evaluated at step 0,
every ``eval.every`` steps and at the end: ``heldout/pair_accuracy`` (the fraction whose implicit-reward
margin, :func:`~posttrain.loop.preference_loss.implicit_margin`, is > 0: the policy ranks chosen above
rejected beyond the rounding of its computation, :func:`~posttrain.loop.preference_loss.pair_wins`; 0 at
step 0 for the losses with a reference, where every margin is 0 up to that rounding),
``heldout/margin`` (its mean) and ``heldout/loss``. The run directory, ``metrics.jsonl`` (step metrics: the
loss's, the optimiser's, ``lr``, ``pairs_seen``, ``step_seconds``), checkpoints (``checkpoints/step_N`` every
``checkpoint_every`` steps and at the end; ``actor/`` loads with ``from_pretrained``), ``resume=true`` and
Ctrl-C are the shared lifecycle's (:mod:`posttrain.loop.lifecycle`); its learner state is ``preference``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.config import RunConfig
from posttrain.errors import UserError
from posttrain.loop.lifecycle import RunLifecycle, RunParts, RunResult, locked_run_dir, step_trainer
from posttrain.loop.preference_batch import encode_pair, pair_logprobs
from posttrain.loop.preference_loss import (
    check_loss_kwargs,
    implicit_margin,
    kto_reference_point,
    pair_wins,
    preference_loss,
    uses_reference,
)
from posttrain.loop.preference_step import PAIR_CURVE, PairBatch, PairBatchLoss, pair_step, reference_batch

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.envs.preference_data import PreferencePair

log = logging.getLogger("posttrain")


def load_pairs(cfg: RunConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """``(train, heldout)`` pairs of ``preference.data`` (validated; :class:`~posttrain.errors.UserError`
    naming the file, row and column, or the split that came out empty)."""
    from posttrain.envs.preference_data import load_preference_pairs, split_pairs

    if cfg.preference.data is None:
        raise UserError(f"trainer={cfg.trainer}" + (" (offline)" if cfg.trainer == "preference" else "")
                        + " needs preference.data")
    pairs = load_preference_pairs(cfg.preference.data, cfg.preference.fields)
    train, heldout = split_pairs(pairs, cfg.preference.heldout_fraction)
    for name, part in (("training", train), ("held-out", heldout)):
        if not part:
            raise UserError(f"{cfg.preference.data}: no {name} pairs among {len(pairs)} with "
                            f"preference.heldout_fraction={cfg.preference.heldout_fraction} (the split hashes the "
                            "prompt: give more distinct prompts or change the fraction)")
    if cfg.preference.loss == "odpo" and any("score_diff" not in p.meta for p in pairs):
        raise UserError(f"{cfg.preference.data}: preference.loss=odpo needs each pair's score difference: map its "
                        "column with preference.fields.score_diff")
    return train, heldout


def check_preference_config(cfg: RunConfig) -> None:
    """What would fail at step 1 for a config reason, before the run directory is written: the loss's
    kwargs (``preference.kwargs``), and offline the pairs file (:func:`load_pairs`)."""
    try:
        check_loss_kwargs(cfg.preference.loss, cfg.preference.kwargs)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not cfg.preference.online:
        load_pairs(cfg)


def evaluate_pairs(model: torch.nn.Module, batch: PairBatch, cfg: RunConfig, pad_id: int) -> dict[str, float]:
    """``heldout/pair_accuracy`` (margin beyond rounding of 0: :func:`~posttrain.loop.preference_loss.pair_wins`),
    ``heldout/margin`` (mean implicit-reward margin),
    ``heldout/loss`` (mean preference loss) and ``heldout/chosen_logp`` (mean) of ``batch``, without grad."""
    chosen, rejected = pair_logprobs(model, batch.pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)
    lp = batch.logprobs(range(len(batch.pairs)), chosen, rejected, model_dtype=next(model.parameters()).dtype)
    z0 = kto_reference_point(lp) if cfg.preference.loss == "kto" else 0.0
    with torch.no_grad():
        loss, _ = preference_loss(cfg.preference.loss, cfg.preference.kwargs, lp, kl_ref_point=z0)
    margin = implicit_margin(cfg.preference.loss, lp)
    wins = pair_wins(cfg.preference.loss, lp)
    return {"heldout/pair_accuracy": float(wins.double().mean()), "heldout/margin": float(margin.mean()),
            "heldout/loss": float(loss.mean()), "heldout/chosen_logp": float(chosen.mean())}


def train_preference(cfg: RunConfig, progress: Progress | None = None) -> RunResult:
    """Run ``trainer: preference`` (module docstring); ``preference.online`` runs
    :func:`posttrain.loop.online_preference.train_online_preference` instead."""
    if cfg.preference.online:
        from posttrain.loop.online_preference import train_online_preference

        result: RunResult = train_online_preference(cfg, progress=progress)
        return result
    check_preference_config(cfg)
    train_pairs, heldout_pairs = load_pairs(cfg)
    with locked_run_dir(cfg) as run_dir:
        return _train_offline(cfg, run_dir, train_pairs, heldout_pairs, progress)


def _train_offline(cfg: RunConfig, run_dir: Path, train_pairs: list[PreferencePair],
                   heldout_pairs: list[PreferencePair], progress: Progress | None) -> RunResult:
    """The offline run in its locked ``run_dir`` (module docstring): the pairs encoded, their reference
    log-probs taken once, then :func:`~posttrain.loop.preference_step.pair_step` over the shared lifecycle."""
    from posttrain.loop.builders import build_model, build_renderer

    torch.manual_seed(cfg.seed)
    tokenizer, model = build_model(cfg)
    model.eval()
    renderer = build_renderer(cfg, tokenizer)
    pad_id, budget = int(tokenizer.pad_token_id or 0), cfg.optim.microbatch_tokens
    train_enc, held_enc = ([encode_pair(p, renderer, tokenizer, max_length=cfg.preference.max_length) for p in ps]
                           for ps in (train_pairs, heldout_pairs))
    # The frozen reference is the policy at the start: its log-probs once, before any restore or step.
    ref = copy.deepcopy(model).requires_grad_(False) if uses_reference(cfg.preference.loss) else None
    train_batch = reference_batch(ref, train_enc, pad_id=pad_id, microbatch_tokens=budget)
    held_batch = reference_batch(ref, held_enc, pad_id=pad_id, microbatch_tokens=budget)
    del ref
    trainer = step_trainer(cfg, model)

    def step_loss(rows: list[int]) -> PairBatchLoss:
        return PairBatchLoss(model, train_batch.take(rows), cfg, pad_id)

    with RunLifecycle(cfg, run_dir, RunParts("preference", model, tokenizer, trainer), curve=PAIR_CURVE) as run:
        log.info("preference (%s): %d training pairs, %d held-out pairs", cfg.preference.loss,
                 len(train_enc), len(held_enc))
        return run.run(pair_step(cfg, trainer, len(train_enc), step_loss),
                       lambda _: evaluate_pairs(model, held_batch, cfg, pad_id), progress=progress)


class PreferenceProgram:
    """``trainer: preference`` as a :class:`~posttrain.loop.trainer_program.TrainerProgram`: ``check`` is the RL
    preflight when it samples (``preference.online``: the task's groups are sampled and verified) then
    :func:`check_preference_config`; ``train`` is :func:`train_preference`."""

    def check(self, cfg: RunConfig) -> None:
        """The preflight (online), then the loss's kwargs and (offline) the pairs file."""
        if cfg.preference.online:
            from posttrain.loop.preflight import preflight

            preflight(cfg)
        check_preference_config(cfg)

    def train(self, cfg: RunConfig, progress: Progress | None) -> RunResult:
        """:func:`train_preference`."""
        return train_preference(cfg, progress=progress)


PROGRAM = PreferenceProgram()
"""The program ``trainer: preference`` names (posttrain/config/trainers.py)."""

__all__ = ["PROGRAM", "PreferenceProgram", "check_preference_config", "evaluate_pairs", "load_pairs",
           "train_preference"]
