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
``heldout/margin`` (its mean) and ``heldout/loss``. Metrics go to ``metrics.jsonl`` (and the trackers of
``logging.*``); checkpoints to ``checkpoints/step_N`` every ``checkpoint_every`` steps and at the end, in
the RL runs' format (``actor/`` loads with ``from_pretrained``); ``resume=true`` continues from the latest.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.config import RunConfig, dump_config
from posttrain.errors import UserError
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import Trainer
from posttrain.loop.metrics_log import MetricsLog
from posttrain.loop.preference_batch import EncodedPair, encode_pair, pair_logprobs
from posttrain.loop.preference_loss import (
    check_loss_kwargs,
    implicit_margin,
    kto_reference_point,
    pair_wins,
    preference_loss,
    uses_reference,
)
from posttrain.loop.preference_step import (
    PairBatch,
    PairBatchLoss,
    PreferenceRunResult,
    run_pair_steps,
)

if TYPE_CHECKING:
    from rich.progress import Progress
    from transformers import PreTrainedTokenizerBase

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


@contextmanager
def locked_run_dir(cfg: RunConfig) -> Iterator[Path]:
    """The run directory of ``cfg``, prepared and locked for the block (as the RL runs': a fresh run never
    writes into another run's history; ``resume=true`` checks the recipe against ``config.yaml``). A fresh
    directory is removed again when the block fails before any checkpoint."""
    from posttrain.loop.checkpointing import check_resumable
    from posttrain.loop.run import run_dir_of
    from posttrain.loop.run_dir import RunDirLock, prepare_run_dir, refuse_to_overwrite

    fresh = not run_dir_of(cfg).exists()
    run_dir = prepare_run_dir(run_dir_of(cfg))
    lock = RunDirLock(run_dir)
    try:
        if cfg.resume:
            check_resumable(cfg, run_dir)
        else:
            refuse_to_overwrite(run_dir)
        yield run_dir
    except BaseException:
        if fresh and not (run_dir / "config.yaml").exists():  # a run that never started leaves no directory
            lock.release()
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        lock.release()


def optimizer_settings(cfg: RunConfig) -> OptimizerSettings:
    """AdamW and schedule of ``optim.*`` over ``steps`` optimiser steps (one per step)."""
    o = cfg.optim
    return OptimizerSettings(lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
                             total_steps=max(cfg.steps, 1), lr_schedule=o.schedule, max_grad_norm=o.max_grad_norm)


@dataclasses.dataclass
class _Clock:
    before: float = 0.0
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.start


def save(run_dir: Path, step: int, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, trainer: Trainer,
         extra: dict[str, object]) -> Path:
    """A checkpoint of the preference run at ``step`` (actor, tokenizer, trainer state, ``extra``)."""
    from posttrain.learner.checkpoint import checkpoint_path, save_checkpoint

    return save_checkpoint(checkpoint_path(run_dir, step), step=step, actor=model, tokenizer=tokenizer,
                           learner_state={"preference": trainer.state_dict()}, extra=extra)


def restore(run_dir: Path, model: torch.nn.Module, trainer: Trainer) -> tuple[int, dict[str, object]]:
    """Load the latest complete checkpoint of ``run_dir`` into ``model`` / ``trainer`` and the RNGs;
    ``(step, extra)``. A checkpoint that cannot be read falls back to the previous one (a warning)."""
    from posttrain.learner.checkpoint import complete_checkpoints, load_checkpoint, restore_actor, restore_rng

    for path in reversed(complete_checkpoints(run_dir / "checkpoints")):
        try:
            ck = load_checkpoint(path)
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("resume: checkpoint %s cannot be read (%s); trying the previous one", path, e)
            continue
        restore_actor(model, ck)
        trainer.load_state_dict(ck.learner_state["preference"], owner="preference trainer")
        restore_rng(ck)
        return ck.step, ck.extra
    from posttrain.loop.run_dir import RunDirError

    raise RunDirError(f"resume=true but no checkpoint of {run_dir / 'checkpoints'} can be read")


def train_preference(cfg: RunConfig, progress: Progress | None = None) -> PreferenceRunResult:
    """Run ``trainer: preference`` (module docstring); ``preference.online`` runs
    :func:`posttrain.loop.online_preference.train_online_preference` instead."""
    if cfg.preference.online:
        from posttrain.loop.online_preference import train_online_preference

        result: PreferenceRunResult = train_online_preference(cfg, progress=progress)
        return result
    check_preference_config(cfg)
    train_pairs, heldout_pairs = load_pairs(cfg)
    with locked_run_dir(cfg) as run_dir:
        return _train_offline(cfg, run_dir, train_pairs, heldout_pairs, progress)


def _reference_batch(ref: torch.nn.Module | None, pairs: list[EncodedPair], pad_id: int, cfg: RunConfig) -> PairBatch:
    if ref is None:
        return PairBatch(pairs, None, None)
    c, r = pair_logprobs(ref, pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)
    return PairBatch(pairs, c, r)


def _train_offline(cfg: RunConfig, run_dir: Path, train_pairs: list[PreferencePair],
                   heldout_pairs: list[PreferencePair], progress: Progress | None) -> PreferenceRunResult:
    from posttrain.loop.builders import build_model, build_renderer
    from posttrain.loop.run_dir import write_text_atomic

    torch.manual_seed(cfg.seed)
    tokenizer, model = build_model(cfg)
    model.eval()
    renderer = build_renderer(cfg, tokenizer)
    pad_id = int(tokenizer.pad_token_id or 0)
    train_enc = [encode_pair(p, renderer, tokenizer, max_length=cfg.preference.max_length) for p in train_pairs]
    held_enc = [encode_pair(p, renderer, tokenizer, max_length=cfg.preference.max_length) for p in heldout_pairs]
    # The frozen reference is the policy at the start: its log-probs once, before any restore or step.
    ref = copy.deepcopy(model).requires_grad_(False) if uses_reference(cfg.preference.loss) else None
    train_batch = _reference_batch(ref, train_enc, pad_id, cfg)
    held_batch = _reference_batch(ref, held_enc, pad_id, cfg)
    del ref
    trainer = Trainer(list(model.parameters()), optimizer_settings(cfg),
                      BatchingSettings(microbatch_tokens=cfg.optim.microbatch_tokens, seed=cfg.seed))
    step, cursor, clock = 0, 0, _Clock()
    metrics = MetricsLog.for_run(run_dir, cfg)
    curve: list[tuple[int, float]] = []
    try:
        if cfg.resume:
            step, extra = restore(run_dir, model, trainer)
            cursor, clock = int(extra["cursor"]), _Clock(before=float(extra["wall_seconds"]))  # type: ignore[call-overload, arg-type]
            curve = [(int(s), float(v)) for s, v in extra["curve"]]  # type: ignore[attr-defined]
            metrics.truncate_after(step)
            log.info("resumed %s at step %d", run_dir, step)
        write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
        log.info("preference (%s): %d training pairs, %d held-out pairs", cfg.preference.loss, len(train_enc),
                 len(held_enc))

        def evaluate(at: int) -> None:
            ev = evaluate_pairs(model, held_batch, cfg, pad_id)
            curve.append((at, ev["heldout/pair_accuracy"]))
            metrics.log(at, ev)

        def checkpoint(at: int, pairs_seen: int) -> None:
            save(run_dir, at, model, tokenizer, trainer,
                 {"trainer": "preference", "cursor": pairs_seen, "wall_seconds": clock.seconds(), "curve": curve})

        def step_loss(rows: list[int]) -> PairBatchLoss:
            sub = PairBatch([train_enc[i] for i in rows],
                            *(None if t is None else t[torch.tensor(rows)]
                              for t in (train_batch.ref_chosen, train_batch.ref_rejected)))
            return PairBatchLoss(model, sub, cfg, pad_id)

        if step == 0:
            evaluate(step)
        step, cursor = run_pair_steps(cfg, step=step, cursor=cursor, num_train=len(train_enc), step_loss=step_loss,
                                      trainer=trainer, metrics=metrics, evaluate=evaluate, checkpoint=checkpoint,
                                      progress=progress, label="preference")
    finally:
        metrics.close()
    return PreferenceRunResult(step=step, wall_seconds=clock.seconds(), curve_name="held-out pair accuracy",
                               curve=curve)


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

    def train(self, cfg: RunConfig, progress: Progress | None) -> PreferenceRunResult:
        """:func:`train_preference`."""
        return train_preference(cfg, progress=progress)


PROGRAM = PreferenceProgram()
"""The program ``trainer: preference`` names (posttrain/config/trainers.py)."""

__all__ = ["PROGRAM", "PreferenceProgram", "check_preference_config", "evaluate_pairs", "load_pairs",
           "locked_run_dir", "optimizer_settings", "restore", "save", "train_preference"]
