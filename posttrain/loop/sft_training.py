"""``trainer: sft``: supervised fine-tuning on a file of demonstrations (docs/sft.md).

Data (:mod:`posttrain.envs.sft_data`): ``sft.data``'s chats or prompt-completion pairs, rendered with the
chat template, the loss on the assistant turns only (a pair's completion); held-out rows from
``sft.heldout_data``, or ``sft.heldout_fraction`` of ``sft.data`` split by a hash of the prompt. A row over
``sft.max_length`` tokens is refused, never truncated.

One step takes ``sft.batch_size`` rows at the data cursor (a seeded permutation per pass over the training
rows: :func:`~posttrain.loop.lifecycle.data_rows`) and is a short program over the policy learner's primitives
(:mod:`posttrain.learner.primitives`; a :class:`~posttrain.learner.actor.PolicyLearner` of ``optim.*``: AdamW,
schedule over the run's ``steps``, gradient clip, micro-batches of ``optim.microbatch_tokens`` tokens)::

    out = learner.forward_backward(layout.batch(step rows), SFTTokenLoss())   # padded or packed
    learner.optim_step()                                                      # clip / skip / AdamW + schedule

on the token-mean cross-entropy of the step's target tokens (:class:`SFTTokenLoss`, the math of
:func:`~posttrain.algos.sft.sft_cross_entropy`; ``N`` the step's target-token count), on the
primitives' plain forward (full-vocabulary ``log_softmax`` at temperature 1). Padded (:func:`padded_batch`), a
batch row is a step row, right-padded. ``sft.packing`` (:func:`packed_batch`) lays the same rows out as blocks of
``sft.max_length`` tokens (whole rows), a batch row per block, with ``position_ids`` restarting at each row: the
plain forward then runs without an attention mask, and transformers' packed-sequence mask keeps attention within
a row (:func:`~posttrain.learner.primitives.plain_logits`); the learner's micro-batches hold whole blocks. The
same loss, fewer padded tokens. The model stays in eval mode (no dropout), as in the preference trainers.

Held-out rows are evaluated at step 0, every ``eval.every`` steps and at the end: ``heldout/loss`` (the
token-mean NLL of their target tokens), ``heldout/token_accuracy`` (the share of target tokens that are the
model's argmax) and ``heldout/tokens``, from the logits of the same plain forward over the same layout
(:func:`row_losses`, no gradient). Step metrics: ``loss``, ``tokens``, ``rows``, the optimiser's,
``lr``, ``rows_seen``, ``step_seconds``. The run directory, checkpoints (``actor/`` loads with
``from_pretrained`` and ``posttrain eval``), ``resume=true`` and Ctrl-C are the shared lifecycle's
(:mod:`posttrain.loop.lifecycle`); the learner state is its optimiser's (``learner_state["sft"]``: the
learners' :class:`~posttrain.learner.trainer.Trainer` state, as before the primitives).

Keys: the run's ``steps`` counts the steps (``sft.steps`` is the RL warm-up's, refused here, as are ``sft.lr``
and ``sft.examples``: ``optim.*`` is the optimiser); the keys this trainer never reads are refused at load
(:data:`posttrain.config.dead_settings.RULES`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from posttrain.algos.sft import sft_cross_entropy, token_logprobs
from posttrain.config import RunConfig
from posttrain.envs.sft_data import EncodedRow, SFTRow, encode_row, load_sft_rows, pack_rows, split_rows
from posttrain.errors import UserError
from posttrain.learner.actor import PolicyLearner
from posttrain.learner.microbatch import Microbatch, microbatches
from posttrain.learner.optim_step import StepTally
from posttrain.learner.primitives import ForwardSpec, LossBatch, LossTerms, plain_logits
from posttrain.learner.settings import BatchingSettings
from posttrain.loop.lifecycle import (
    Curve,
    RunLifecycle,
    RunParts,
    RunResult,
    StepOutput,
    data_rows,
    locked_run_dir,
    optimizer_settings,
)

if TYPE_CHECKING:
    from rich.progress import Progress
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("posttrain")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step's rows become the learner's batch: ``packing`` (blocks of whole rows) or right-padded rows,
    ``max_length`` (a block's capacity), ``budget`` (``optim.microbatch_tokens``, the learner's micro-batches)
    and ``pad_id``."""

    packing: bool
    max_length: int
    budget: int
    pad_id: int

    def units(self, rows: Sequence[EncodedRow]) -> list[list[int]]:
        """The rows each batch row holds: packed, blocks of at most ``max_length`` tokens
        (:func:`~posttrain.envs.sft_data.pack_rows`); padded, one row each."""
        if self.packing:
            return pack_rows([len(r.input_ids) for r in rows], self.max_length)
        return [[i] for i in range(len(rows))]

    def batch(self, rows: Sequence[EncodedRow], device: torch.device) -> LossBatch:
        """``rows`` as one mini-batch: :func:`packed_batch` or :func:`padded_batch`."""
        if self.packing:
            return packed_batch(rows, self.max_length, self.pad_id, device)
        return padded_batch(rows, self.pad_id, device)


def _laid_out(rows: Sequence[EncodedRow], units: Sequence[Sequence[int]], pad_id: int, device: torch.device,
              packed: bool) -> LossBatch:
    """Batch row ``b`` holds ``rows[i]`` for ``i`` in ``units[b]``, one after the other, then padding to the
    longest batch row; ``position_ids`` (packed only) restart at 0 at each row and at the tail padding."""
    widths = [sum(len(rows[i].input_ids) for i in u) for u in units]
    T = max(widths)
    ids = torch.full((len(units), T), pad_id, dtype=torch.long)
    attn, mask, pos = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids)
    for b, u in enumerate(units):
        at = 0
        for i in u:
            n = len(rows[i].input_ids)
            ids[b, at:at + n], mask[b, at:at + n] = torch.tensor(rows[i].input_ids), torch.tensor(rows[i].loss_mask)
            pos[b, at:at + n] = torch.arange(n)
            at += n
        attn[b, :at] = 1
        pos[b, at:] = torch.arange(T - at)
    tensors = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "position_ids": pos if packed else None}
    return LossBatch({k: None if v is None else v.to(device) for k, v in tensors.items()}, list(range(len(units))),
                     float(sum(r.targets for r in rows)))


def padded_batch(rows: Sequence[EncodedRow], pad_id: int, device: torch.device) -> LossBatch:
    """``rows`` as one mini-batch on ``device``: ``input_ids`` / ``attention_mask`` / ``loss_mask`` ``[B, T]``
    right-padded to the longest row (``position_ids`` None), ``num_tokens`` their target tokens (the primitives micro-batch it by
    ``optim.microbatch_tokens``, trimming each micro-batch to its longest row)."""
    return _laid_out(rows, [[i] for i in range(len(rows))], pad_id, device, packed=False)


def packed_batch(rows: Sequence[EncodedRow], max_length: int, pad_id: int, device: torch.device) -> LossBatch:
    """``rows`` packed into blocks of at most ``max_length`` tokens (:func:`~posttrain.envs.sft_data.pack_rows`,
    whole rows), one batch row per block: ``input_ids`` / ``loss_mask`` ``[blocks, T]``, ``attention_mask`` 1 on
    each block's tokens (the learner's micro-batches of ``optim.microbatch_tokens`` hold whole blocks, trimmed to
    their longest), ``position_ids`` restarting at 0 at each row (and at a block's tail padding, one more
    sequence): the primitives' plain forward then keeps each row's attention within the row
    (:func:`~posttrain.learner.primitives.plain_logits`). ``num_tokens``: the rows' target tokens."""
    units = pack_rows([len(r.input_ids) for r in rows], max_length)
    return _laid_out(rows, units, pad_id, device, packed=True)


class SFTTokenLoss:
    """The SFT cross-entropy as the learner's :class:`~posttrain.learner.primitives.TokenLoss`: on each
    micro-batch, :func:`~posttrain.algos.sft.sft_cross_entropy` of the primitives' plain log-probs (full
    vocabulary, temperature 1; packed blocks with their position ids) and the ``loss_mask`` tensor, normalised by
    the mini-batch's ``num_tokens`` ``N``: ``L_mb = -sum_{mb} m * lp / N``. One step is one mini-batch of every
    row of the step, so ``N`` is the step's target-token count and the micro-batch losses add up to the mean
    NLL over the step's assistant (completion) tokens, each token weighing the same whatever its row's length."""

    spec = ForwardSpec(sampler_replay=False, autocast=False)

    def __call__(self, logprob: torch.Tensor, entropy: torch.Tensor | None, mb: Microbatch,
                 batch: LossBatch) -> LossTerms:
        """The micro-batch's share of the step's mean NLL (``logprob`` ``[b, t]``, 0 at column 0)."""
        return LossTerms(loss=sft_cross_entropy(logprob, mb["loss_mask"], batch.num_tokens))

    def metric_keys(self) -> tuple[list[str], list[str], list[str]]:
        """No metric sums besides the loss."""
        return [], [], []

    def rows_without_gradient(self, batch: LossBatch, rows: Sequence[int]) -> list[int]:
        """Every row has a target token (:func:`~posttrain.envs.sft_data.encode_row`): all are trained."""
        return []


def sft_step(learner: PolicyLearner, rows: Sequence[EncodedRow], layout: Layout) -> dict[str, float | None]:
    """One optimiser step on ``rows`` (module docstring): ``learner.forward_backward`` of their batch
    (:meth:`Layout.batch`: :func:`padded_batch` or :func:`packed_batch`) with :class:`SFTTokenLoss`, then
    ``learner.optim_step()``. Metrics: ``loss`` (the step's mean NLL), ``tokens``, ``rows``, the optimiser's and
    ``lr`` (None: no step taken)."""
    out = learner.forward_backward(layout.batch(rows, learner.device), SFTTokenLoss())
    steps = StepTally()
    steps.record(learner.optim_step())
    return {"loss": out.loss, "tokens": float(sum(r.targets for r in rows)), "rows": float(len(rows)),
            **steps.metrics(), "lr": steps.lr}


def scored_tokens(model: torch.nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lp, hit)`` ``[b, t]`` of a micro-batch of :meth:`Layout.batch`: each token's log-prob given the tokens
    of its own row before it, from the logits of the primitives' plain forward
    (:func:`~posttrain.learner.primitives.plain_logits`; :func:`~posttrain.algos.sft.token_logprobs`), and
    whether it is the model's argmax (held-out token accuracy needs the logits, not only the log-probs)."""
    ids = mb["input_ids"]
    logits = plain_logits(model, ids, mb["attention_mask"], mb.optional("position_ids"))
    hit = torch.zeros_like(ids, dtype=torch.bool)
    hit[:, 1:] = logits[:, :-1].argmax(-1) == ids[:, 1:]
    return token_logprobs(logits, ids), hit


@torch.no_grad()
def row_losses(model: torch.nn.Module, rows: Sequence[EncodedRow], layout: Layout) -> list[tuple[float, int, int]]:
    """Per row ``(summed NLL of its target tokens, target tokens, of them the model's argmax)``, without grad:
    :func:`scored_tokens` of ``layout``'s batch in the learner's micro-batches
    (:func:`~posttrain.learner.microbatch.microbatches` of ``layout.budget`` tokens)."""
    device = next(model.parameters()).device
    batch, units = layout.batch(rows, device), layout.units(rows)
    out: list[tuple[float, int, int]] = [(0.0, 0, 0)] * len(rows)
    for mb in microbatches(batch.tensors, batch.rows, layout.budget):
        lp, hit = scored_tokens(model, mb)
        m = mb["loss_mask"].bool()
        for k, b in enumerate(mb.rows):
            at = 0
            for r in units[b]:
                n = len(rows[r].input_ids)
                keep = m[k, at:at + n]
                out[r] = (-float(lp[k, at:at + n][keep].double().sum()), int(keep.sum()),
                          int(hit[k, at:at + n][keep].sum()))
                at += n
    return out


def heldout_metrics(model: torch.nn.Module, rows: Sequence[EncodedRow], layout: Layout) -> dict[str, float]:
    """``heldout/loss`` (token-mean NLL over all held-out target tokens), ``heldout/token_accuracy`` and
    ``heldout/tokens``."""
    per_row = row_losses(model, rows, layout)
    n = sum(t for _, t, _ in per_row)
    return {"heldout/loss": sum(s for s, _, _ in per_row) / n,
            "heldout/token_accuracy": sum(h for _, _, h in per_row) / n, "heldout/tokens": float(n)}


def load_rows(cfg: RunConfig) -> tuple[list[SFTRow], list[SFTRow]]:
    """``(train, heldout)`` rows (:mod:`posttrain.envs.sft_data`); ``UserError`` naming the file and row, or the
    key, when a file is missing or malformed or a side comes out empty."""
    s = cfg.sft
    if s.data is None:
        raise UserError("trainer=sft needs sft.data (a JSONL or Parquet file of chat or prompt-completion rows)")
    rows = load_sft_rows(s.data)
    if s.heldout_data is not None:
        train, held = rows, load_sft_rows(s.heldout_data)
    else:
        train, held = split_rows(rows, s.heldout_fraction)
        for name, part in (("training", train), ("held-out", held)):
            if not part:
                raise UserError(f"{s.data}: no {name} rows among {len(rows)} with sft.heldout_fraction="
                                f"{s.heldout_fraction} (the split hashes the prompt: give more distinct prompts, "
                                "change the fraction or set sft.heldout_data)")
    return train, held


def encode_rows(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, rows: Sequence[SFTRow]) -> list[EncodedRow]:
    """Every row as ids and loss mask (:func:`~posttrain.envs.sft_data.encode_row`), rendered as the run's
    prompts are (``task.chat_template``, ``task.system_prompt``)."""
    from posttrain.envs.prompt_render import resolve_chat
    from posttrain.loop.builders import is_char_preset

    try:
        chat = resolve_chat(cfg.task.chat_template, tokenizer, char_preset=is_char_preset(cfg.model.path, tokenizer))
    except ValueError as e:
        raise UserError(f"model.path={cfg.model.path}: {e}") from None
    return [encode_row(r, tokenizer, chat=chat, system_prompt=cfg.task.system_prompt, max_length=cfg.sft.max_length,
                       model_name=cfg.model.path) for r in rows]


class SFTProgram:
    """``trainer: sft`` as ``posttrain train`` runs it: :meth:`check`, then :meth:`train`."""

    def check(self, cfg: RunConfig) -> None:
        """Everything that would fail for a data reason, before the run directory is written (the config's own
        keys were checked at load): the data files (every row validated), both sides of the split non-empty and,
        when the model's tokenizer is at hand without loading weights, every row's rendering and length.
        ``UserError``, one line naming the file and row, or the key."""
        from posttrain.loop.builders import load_tokenizer

        train, held = load_rows(cfg)
        tokenizer = load_tokenizer(cfg.model.path)
        if tokenizer is not None:
            encode_rows(cfg, tokenizer, [*train, *held])

    def train(self, cfg: RunConfig, progress: Progress | None = None) -> RunResult:
        """Run ``trainer: sft`` (module docstring) in its locked run directory; the result's curve is the
        held-out loss."""
        from posttrain.loop.builders import build_model

        train_rows, held_rows = load_rows(cfg)
        with locked_run_dir(cfg) as run_dir:
            torch.manual_seed(cfg.seed)
            tokenizer, model = build_model(cfg)
            model.eval()  # no dropout: the same function at every forward
            train_enc, held_enc = encode_rows(cfg, tokenizer, train_rows), encode_rows(cfg, tokenizer, held_rows)
            layout = Layout(cfg.sft.packing, cfg.sft.max_length, cfg.optim.microbatch_tokens,
                            int(tokenizer.pad_token_id or 0))
            learner = PolicyLearner(model, optim=optimizer_settings(cfg), batching=BatchingSettings(
                microbatch_tokens=cfg.optim.microbatch_tokens, seed=cfg.seed))
            log.info("sft: %d training rows, %d held-out rows (%s)", len(train_enc), len(held_enc),
                     "packed" if cfg.sft.packing else "padded")

            def step(at: int, cursor: int) -> StepOutput:
                idx = data_rows(len(train_enc), cfg.sft.batch_size, cursor, cfg.seed)
                return StepOutput(cursor + len(idx), sft_step(learner, [train_enc[i] for i in idx], layout))

            # the checkpoint keeps the learner's optimiser state (the Trainer's keys) under "sft", as before
            parts = RunParts("sft", model, tokenizer, learner.trainer)
            with RunLifecycle(cfg, run_dir, parts, curve=Curve("heldout/loss", "held-out loss")) as run:
                return run.run(step, lambda _: heldout_metrics(model, held_enc, layout), progress=progress)


PROGRAM = SFTProgram()
"""The registry's entry point (``posttrain/config/trainers.py``: ``sft`` -> ``posttrain.loop.sft_training:PROGRAM``)."""


__all__ = ["PROGRAM", "Layout", "SFTProgram", "SFTTokenLoss", "heldout_metrics", "load_rows", "packed_batch",
           "padded_batch", "row_losses", "scored_tokens", "sft_step"]
