"""``posttrain check`` for ``trainer: reward_model``: the Bradley-Terry trainer's invariants on a few pairs.

On the first training pairs of ``preference.data`` and the reward model built from ``model.path``
(:func:`~posttrain.loop.reward_model_training.build_reward_model`, no training):

1. ``pairs_load``: the pairs load and both splits are non-empty;
2. ``microbatch_split``: the gradient of the mean Bradley-Terry loss (Bradley & Terry 1952; Ouyang et al.
   2022, arXiv:2203.02155 eq. 1) with one pair per micro-batch equals the whole-batch gradient;
3. ``padding_invariance``: each text's score computed alone equals its score in the padded batch of all
   texts (the head reads the last non-pad token);
4. ``save_load``: the saved ``reward_model/`` directory, loaded as ``reward.model`` loads it
   (:meth:`~posttrain.rewards.reward_model.RewardModelScorer.from_pretrained`), gives the same scores.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.commands.check_result import CheckResult, gradients, max_rel
from posttrain.config import RunConfig
from posttrain.loop.reward_model_training import PairwiseLoss, TextPair, rewards_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GRAD_RTOL = 1e-4
"""Largest relative gradient difference accepted between micro-batch splits (float32 reductions)."""

SCORE_ATOL = 1e-4
"""Largest score difference accepted between a text scored alone and in a padded batch."""


def _loss_and_grads(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[TextPair], max_length: int,
                    microbatch_tokens: int) -> tuple[float, dict[str, torch.Tensor]]:
    loss = PairwiseLoss(model, tokenizer, pairs, max_length=max_length, microbatch_tokens=microbatch_tokens)
    rows = list(range(len(pairs)))
    model.zero_grad(set_to_none=True)
    loss.backward(rows, loss.normaliser(rows))
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return loss.metrics["loss"], grads


def check_microbatch_split(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[TextPair],
                           max_length: int) -> CheckResult:
    """Check 2 of the module docstring."""
    la, ga = _loss_and_grads(model, tokenizer, pairs, max_length, 10**9)
    lb, gb = _loss_and_grads(model, tokenizer, pairs, max_length, 1)
    rel = max_rel(ga, gb)
    return ("microbatch_split", rel < GRAD_RTOL and abs(la - lb) <= 1e-5 * max(1.0, abs(la)),
            f"1 pair vs whole batch: |d loss| = {abs(la - lb):.2e}, max rel |d grad| = {rel:.2e}")


@torch.no_grad()
def batched_and_alone(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[TextPair],
                      max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batched, alone)`` scores ``[2B]`` of every chosen then rejected text of ``pairs``."""
    c, r = rewards_of(model, tokenizer, pairs, max_length)
    batched = torch.cat([c, r]).double()
    alone = [rewards_of(model, tokenizer, [p], max_length) for p in pairs]
    return batched, torch.cat([torch.cat([a[0] for a in alone]), torch.cat([a[1] for a in alone])]).double()


def check_padding_invariance(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[TextPair],
                             max_length: int) -> CheckResult:
    """Check 3 of the module docstring."""
    batched, alone = batched_and_alone(model, tokenizer, pairs, max_length)
    d = float((batched - alone).abs().max())
    return ("padding_invariance", d <= SCORE_ATOL,
            f"max |score alone - score in the padded batch| = {d:.2e} over {batched.numel()} texts")


def check_save_load(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[TextPair], *, use_chat_template: bool,
                    max_length: int) -> CheckResult:
    """Check 4 of the module docstring (through the saver and the loader the runs use)."""
    from posttrain.learner.checkpoint import quiet_hf_progress
    from posttrain.loop.reward_model_training import save_reward_model
    from posttrain.rewards.reward_model import RewardModelScorer

    with torch.no_grad():
        c, r = rewards_of(model, tokenizer, pairs, max_length)
    with tempfile.TemporaryDirectory() as d:
        where = save_reward_model(Path(d), model, tokenizer, use_chat_template=use_chat_template, max_length=max_length)
        with quiet_hf_progress():
            scorer = RewardModelScorer.from_pretrained(where, batch_size=len(pairs))
        scorer.model.to(next(model.parameters()).dtype)
        with torch.no_grad():
            c2, r2 = rewards_of(scorer.model, scorer.tokenizer, pairs, max_length)
    dev = max(float((c - c2).abs().max()), float((r - r2).abs().max()))
    return ("save_load", dev <= SCORE_ATOL, f"max |d score| after save and reload as reward.model: {dev:.2e}")


def reward_model_checks(cfg: RunConfig, n_pairs: int = 4) -> list[CheckResult]:
    """The checks of the module docstring on the first ``n_pairs`` training pairs; a pairs file that does
    not load ends the list at ``pairs_load`` (failed, the error naming the file, row or split)."""
    from posttrain.commands.check_pairs import pairs_load
    from posttrain.envs.prompt_render import resolve_chat
    from posttrain.loop.builders import is_char_preset
    from posttrain.loop.reward_model_training import build_reward_model, render_pairs

    loaded, train = pairs_load(cfg)
    if not train:  # the pairs did not load: the list ends at the failed pairs_load
        return [loaded]
    results: list[CheckResult] = [loaded]
    torch.manual_seed(cfg.seed)
    tokenizer, model = build_reward_model(cfg)
    chat = resolve_chat(cfg.task.chat_template, tokenizer, char_preset=is_char_preset(cfg.model.path, tokenizer))
    ml = cfg.preference.max_length
    pairs = render_pairs(train[:max(n_pairs, 2)], tokenizer, use_chat_template=chat, max_length=ml)
    results += [check_microbatch_split(model, tokenizer, pairs, ml), check_padding_invariance(model, tokenizer, pairs, ml),
                check_save_load(model, tokenizer, pairs, use_chat_template=chat, max_length=ml)]
    return results
