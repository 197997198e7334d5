"""``trainer: reward_model``: a Bradley-Terry reward model trained on preference pairs (docs/tasks_and_verifiers.md,
"Learned rewards and LLM judges").

The model is ``model.path``'s network with a sequence-classification head of one output
(``*ForSequenceClassification``, ``num_labels=1``; its backbone weights are the causal LM's, the head is
freshly initialised under ``seed``). A pair's texts are rendered by
:func:`~posttrain.rewards.reward_model.render_pair` (prompt then response; with ``task.chat_template``
resolved as for RL prompts, the tokenizer's chat template), the form RL scores responses in. The loss of a
pair (Bradley & Terry 1952; Ouyang et al. 2022, arXiv:2203.02155, eq. 1) is

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))

averaged over the step's ``preference.batch_size`` pairs (taken at the data cursor of a seeded permutation
per pass, as ``trainer: preference``), one AdamW step of ``optim.*`` (schedule over ``steps``, gradient
clip, micro-batches of ``optim.microbatch_tokens`` padded tokens) through the learners'
:class:`~posttrain.learner.trainer.Trainer`. The model stays in eval mode (no dropout).

Held-out pairs (``preference.heldout_fraction``, split by a hash of the prompt) are evaluated at step 0,
every ``eval.every`` steps and at the end: ``heldout/pair_accuracy`` (the fraction with
``r(chosen) > r(rejected)``; a tie counts as wrong), ``heldout/margin`` (mean ``r(chosen) - r(rejected)``) and
``heldout/loss``. The run directory, ``metrics.jsonl``, checkpoints (``checkpoints/step_N`` every
``checkpoint_every`` steps and at the end, each ``actor/`` with the rendering file below), ``resume=true``
and Ctrl-C are the shared lifecycle's (:mod:`posttrain.loop.lifecycle`; learner state ``preference``). At
the end the model is saved to ``<run_dir>/reward_model/`` (``save_pretrained`` + tokenizer + the rendering,
:data:`~posttrain.rewards.reward_model.RENDER_FILE`): the directory ``reward.model.path`` takes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from posttrain.config import RunConfig
from posttrain.errors import UserError
from posttrain.learner.microbatch import split_by_token_budget
from posttrain.loop.lifecycle import RunLifecycle, RunParts, RunResult, locked_run_dir, step_trainer
from posttrain.loop.preference_step import PAIR_CURVE, pair_step
from posttrain.loop.preference_training import load_pairs
from posttrain.rewards.reward_model import RENDER_FILE, pair_rewards, render_pair

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.envs.preference_data import PreferencePair
    from posttrain.models.tokenizer_protocol import Tokenizer

log = logging.getLogger("posttrain")

REWARD_MODEL_DIR = "reward_model"
"""The subdirectory of the run directory holding the trained reward model (``reward.model.path``)."""


@dataclasses.dataclass(frozen=True)
class TextPair:
    """A pair rendered for the reward model: the chosen and rejected texts and their token counts."""

    chosen: str
    rejected: str
    tokens: tuple[int, int]
    source: str


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair ``-log sigmoid(r_c - r_r)`` (Bradley & Terry 1952; Ouyang et al. 2022, arXiv:2203.02155 eq. 1):
    ``log 2`` at equal rewards, -> 0 as the chosen reward leads. ``chosen`` / ``rejected``: ``[B]``."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"bradley_terry_loss: need two [B] tensors, got {tuple(chosen.shape)}, {tuple(rejected.shape)}")
    return -F.logsigmoid(chosen - rejected)


def build_reward_model(cfg: RunConfig) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, *ForSequenceClassification)`` on ``model.path``'s network: the causal LM of
    :func:`~posttrain.loop.builders.build_model` with its LM head replaced by a fresh one-output score head
    (seeded by ``seed``). ``pad_token_id`` is the tokenizer's (its EOS when it has none): the model scores
    each row at its last non-pad token. ``UserError`` when the architecture has no sequence-classification
    class or its backbone weights do not carry over."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.loop.builders import build_model

    tok, causal = build_model(cfg)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    hf_causal: Any = causal  # a transformers PreTrainedModel: its .config
    config = copy.deepcopy(hf_causal.config)
    config.num_labels, config.pad_token_id = 1, tok.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        try:
            model = AutoModelForSequenceClassification.from_config(config)  # type: ignore[no-untyped-call]
        except ValueError as e:
            raise UserError(f"model.path={cfg.model.path}: no sequence-classification head for this architecture "
                            f"({type(causal).__name__}): {e}") from None
    missing, unexpected = model.load_state_dict(causal.state_dict(), strict=False)
    bad = [k for k in missing if not k.startswith("score.")] + [k for k in unexpected if not k.startswith("lm_head.")]
    if bad:
        raise UserError(f"model.path={cfg.model.path}: the causal LM's weights do not carry over to "
                        f"{type(model).__name__} ({bad[:4]})")
    model.to(next(causal.parameters()).dtype).eval()
    return tok, model


def render_pairs(pairs: Sequence[PreferencePair], tokenizer: Tokenizer, *, use_chat_template: bool,
                 max_length: int) -> list[TextPair]:
    """Each pair's chosen and rejected texts (:func:`~posttrain.rewards.reward_model.render_pair`);
    :class:`~posttrain.errors.UserError` naming the pair's file and row when a text exceeds ``max_length``
    tokens (``preference.max_length``)."""
    out: list[TextPair] = []
    for p in pairs:
        texts = [render_pair(tokenizer, p.prompt, r, use_chat_template=use_chat_template) for r in (p.chosen, p.rejected)]
        n = [len(tokenizer(t, add_special_tokens=True).input_ids) for t in texts]
        source = str(p.meta.get("source", p.pair_id))
        if max(n) > max_length:
            raise UserError(f"{source}: prompt + response is {max(n)} tokens, over preference.max_length={max_length}")
        out.append(TextPair(texts[0], texts[1], (n[0], n[1]), source))
    return out


class PairwiseLoss:
    """The :class:`~posttrain.learner.trainer.MinibatchLoss` of one step's pairs: the mean Bradley-Terry loss,
    accumulated over micro-batches; ``metrics``: ``loss``, ``pair_accuracy``, ``margin`` after :meth:`backward`."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, pairs: Sequence[TextPair], *, max_length: int,
                 microbatch_tokens: int) -> None:
        self.model, self.tokenizer, self.pairs = model, tokenizer, list(pairs)
        self.max_length, self.microbatch_tokens = max_length, microbatch_tokens
        self.metrics: dict[str, float] = {}

    def normaliser(self, rows: Sequence[int]) -> float:
        """Pairs of the mini-batch."""
        return float(len(rows))

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """Forward (chosen and rejected rows together) and backward of pairs ``rows`` in micro-batches."""
        rows = list(rows)
        sums = {"loss": 0.0, "pair_accuracy": 0.0, "margin": 0.0}
        for chunk in split_by_token_budget([2 * max(self.pairs[rows[i]].tokens) for i in rows], self.microbatch_tokens):
            sub = [self.pairs[rows[i]] for i in chunk]
            c, r = rewards_of(self.model, self.tokenizer, sub, self.max_length)
            loss = bradley_terry_loss(c, r)
            (loss.sum() / normaliser).backward()  # type: ignore[no-untyped-call]
            margin = (c - r).detach()
            sums["loss"] += float(loss.detach().sum())
            sums["pair_accuracy"] += float((margin > 0).sum())
            sums["margin"] += float(margin.sum())
        self.metrics = {k: v / normaliser for k, v in sums.items()}


def rewards_of(model: torch.nn.Module, tokenizer: Tokenizer, pairs: Sequence[TextPair],
               max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r(chosen) [B], r(rejected) [B])`` of ``pairs`` in one padded forward of their ``2B`` texts."""
    r = pair_rewards(model, tokenizer, [p.chosen for p in pairs] + [p.rejected for p in pairs], max_length=max_length)
    return r[: len(pairs)], r[len(pairs):]


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, tokenizer: Tokenizer, pairs: Sequence[TextPair], *, max_length: int,
                   microbatch_tokens: int) -> dict[str, float]:
    """``heldout/pair_accuracy`` (``r(chosen) > r(rejected)``), ``heldout/margin`` and ``heldout/loss`` (means)."""
    chosen: list[torch.Tensor] = []
    rejected: list[torch.Tensor] = []
    for chunk in split_by_token_budget([2 * max(p.tokens) for p in pairs], microbatch_tokens):
        c, r = rewards_of(model, tokenizer, [pairs[i] for i in chunk], max_length)
        chosen.append(c.double())
        rejected.append(r.double())
    c, r = torch.cat(chosen), torch.cat(rejected)
    return {"heldout/pair_accuracy": float((c > r).double().mean()), "heldout/margin": float((c - r).mean()),
            "heldout/loss": float(bradley_terry_loss(c, r).mean())}


def save_reward_model(run_dir: Path, model: torch.nn.Module, tokenizer: Tokenizer, *, use_chat_template: bool,
                      max_length: int) -> Path:
    """Write ``<run_dir>/reward_model/`` (weights, tokenizer, :data:`RENDER_FILE`) through a temporary sibling
    renamed into place (a crash leaves the previous one or none); returns it."""
    from posttrain.learner.checkpoint import quiet_hf_progress

    final = run_dir / REWARD_MODEL_DIR
    tmp = run_dir / f".{REWARD_MODEL_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with quiet_hf_progress():
            model.save_pretrained(tmp)  # type: ignore[operator]
        tokenizer.save_pretrained(str(tmp))
        (tmp / RENDER_FILE).write_text(json.dumps({"use_chat_template": use_chat_template, "max_length": max_length}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_reward_model(cfg: RunConfig, progress: Progress | None = None) -> RunResult:
    """Run ``trainer: reward_model`` (module docstring) in its locked run directory: the pairs rendered, then
    :func:`~posttrain.loop.preference_step.pair_step` over the shared lifecycle, each checkpoint's ``actor/``
    with its rendering, and ``reward_model/`` at the end; the result's curve is the held-out pair accuracy."""
    from posttrain.envs.prompt_render import resolve_chat
    from posttrain.loop.builders import is_char_preset

    train_pairs, heldout_pairs = load_pairs(cfg)
    with locked_run_dir(cfg) as run_dir:
        torch.manual_seed(cfg.seed)
        tokenizer, model = build_reward_model(cfg)
        chat = resolve_chat(cfg.task.chat_template, tokenizer, char_preset=is_char_preset(cfg.model.path, tokenizer))
        ml, mb = cfg.preference.max_length, cfg.optim.microbatch_tokens
        train, held = (render_pairs(ps, tokenizer, use_chat_template=chat, max_length=ml)
                       for ps in (train_pairs, heldout_pairs))
        trainer = step_trainer(cfg, model)
        render = json.dumps({"use_chat_template": chat, "max_length": ml})

        def step_loss(rows: list[int]) -> PairwiseLoss:
            return PairwiseLoss(model, tokenizer, [train[i] for i in rows], max_length=ml, microbatch_tokens=mb)

        def with_rendering(path: Path) -> None:
            # The checkpoint's actor/ is a reward model too: with its rendering, or reward.model.path would read
            # it as a third-party classifier (plain text) although it was trained on chat-rendered pairs.
            (path / "actor" / RENDER_FILE).write_text(render)

        parts = RunParts("reward_model", model, tokenizer, trainer, state_key="preference", label="reward model")
        with RunLifecycle(cfg, run_dir, parts, curve=PAIR_CURVE, after_save=with_rendering) as run:
            log.info("reward model: %d training pairs, %d held-out pairs (chat template: %s)", len(train), len(held),
                     chat)
            result = run.run(pair_step(cfg, trainer, len(train), step_loss),
                             lambda _: evaluate_pairs(model, tokenizer, held, max_length=ml, microbatch_tokens=mb),
                             progress=progress)
            where = save_reward_model(run_dir, model, tokenizer, use_chat_template=chat, max_length=ml)
            log.info("reward model saved to %s (reward.model.path)", where)
        return result


class RewardModelProgram:
    """``trainer: reward_model`` as a :class:`~posttrain.loop.trainer_program.TrainerProgram`: ``check`` loads and
    checks the pairs file (:func:`~posttrain.loop.preference_training.load_pairs`), ``train`` is
    :func:`train_reward_model`."""

    def check(self, cfg: RunConfig) -> None:
        """The pairs file: its fields, rows and the held-out split."""
        load_pairs(cfg)

    def train(self, cfg: RunConfig, progress: Progress | None) -> RunResult:
        """:func:`train_reward_model`."""
        return train_reward_model(cfg, progress=progress)


PROGRAM = RewardModelProgram()
"""The program ``trainer: reward_model`` names (posttrain/config/trainers.py)."""
