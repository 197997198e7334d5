"""The Tinker API's built-in losses as a :class:`~posttrain.learner.primitives.TokenLoss`: what ``posttrain serve
--tinker`` hands the learner's ``forward_backward``.

A Tinker request is a list of data; datum ``i`` has ``N_i`` input tokens, ``N_i`` target tokens and its
``loss_fn_inputs`` (each ``[N_i]``). :func:`tinker_batch` lays them out as one right-padded
:class:`~posttrain.learner.primitives.LossBatch` in the learner's alignment (position ``t`` scores the token
at ``t`` from the prefix before it), one row per datum::

    column           0        1        ...   N_i
    input_ids        tok[0]   tok[1]   ...   target[N_i - 1]   (never read: the last column's logits are unused)
    target_ids       -        target[0] ...  target[N_i - 1]
    action_mask      0        1        ...   1
    tinker/<key>     -        in[0]    ...   in[N_i - 1]

so the plain forward's log-prob at column ``t + 1`` is ``log p(target[t] | tokens[:t+1])``, Tinker's ``lp[t]``
(:func:`~posttrain.learner.primitives.plain_logprobs` at temperature 1 over the whole vocabulary, reading the
scored tokens from ``target_ids``). :class:`TinkerLoss` applies :mod:`posttrain.algos.tinker_losses` to each
row's ``lp[1 : N_i + 1]``: a **sum** over the datum's tokens, summed over the data (the Tinker contract; no
mini-batch normaliser), so any split of the rows into micro-batches gives the same loss and gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from posttrain.algos.tinker_losses import LossSpec, datum_loss
from posttrain.learner.microbatch import Microbatch
from posttrain.learner.primitives import ForwardSpec, LossBatch, LossTerms

INPUT = "tinker/"
"""Prefix of a ``loss_fn_inputs`` tensor in the batch: ``tinker/<key>`` ``[B, T]`` float64, the datum's values
at columns ``1 .. N_i``."""
HAS = "tinker_has/"
"""Prefix of the ``[B]`` bool tensor saying which rows carry ``tinker/<key>`` (an optional input may be absent)."""
TARGETS = "target_ids"
"""The batch tensor of the scored tokens (:attr:`ForwardSpec.targets`)."""


def tinker_batch(tokens: Sequence[Sequence[int]], targets: Sequence[torch.Tensor],
                 inputs: Sequence[Mapping[str, torch.Tensor]], keys: Sequence[str],
                 device: torch.device) -> LossBatch:
    """One row per datum (module docstring): ``tokens[i]`` ``N_i >= 1`` input ids, ``targets[i]`` ``[N_i]``,
    ``inputs[i]`` its ``loss_fn_inputs`` (without ``target_tokens``, each ``[N_i]``), ``keys`` every input name
    the loss may read (absent ones get ``tinker_has/<key>`` False). Shapes are the caller's to check."""
    b = len(tokens)
    width = max(len(t) for t in tokens) + 1
    ids = torch.zeros(b, width, dtype=torch.long)
    tgt = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    act = torch.zeros(b, width, dtype=torch.long)
    vals = {k: torch.zeros(b, width, dtype=torch.float64) for k in keys}
    has = {k: torch.zeros(b, dtype=torch.bool) for k in keys}
    for i, (tok, tg, inp) in enumerate(zip(tokens, targets, inputs, strict=True)):
        n = len(tok)
        ids[i, :n] = torch.as_tensor(list(tok), dtype=torch.long)
        ids[i, n] = tg[-1]
        tgt[i, 1:n + 1] = tg
        attn[i, :n + 1] = 1
        act[i, 1:n + 1] = 1
        for k in keys:
            if k in inp:
                vals[k][i, 1:n + 1] = inp[k].to(torch.float64)
                has[k][i] = True
    tensors: dict[str, torch.Tensor | None] = {"input_ids": ids, "attention_mask": attn, "action_mask": act,
                                               TARGETS: tgt}
    tensors.update({INPUT + k: v for k, v in vals.items()})
    tensors.update({HAS + k: v for k, v in has.items()})
    on_device = {k: (v.to(device) if v is not None else None) for k, v in tensors.items()}
    return LossBatch(on_device, list(range(b)), float(act.sum()))


@dataclasses.dataclass
class TinkerLoss:
    """The Tinker loss ``name`` (``loss``: its :class:`~posttrain.algos.tinker_losses.LossSpec`, ``config`` its
    full ``loss_fn_config``) on a :func:`tinker_batch`: ``sum_i loss(lp_i, inputs_i)`` over a micro-batch's rows.

    ``forward_only``: every row is forwarded without a graph (``rows_without_gradient``: all of them), the loss
    value still computed (Tinker's ``forward``)."""

    name: str
    loss: LossSpec
    config: Mapping[str, float]
    forward_only: bool = False
    spec: ForwardSpec = ForwardSpec(sampler_replay=False, autocast=False, targets=TARGETS, chunked_head=True)

    @property
    def keys(self) -> list[str]:
        """The ``loss_fn_inputs`` names the loss reads (required and optional, without ``target_tokens``)."""
        return sorted(self.loss.required | self.loss.optional)

    def __call__(self, logprob: torch.Tensor, entropy: torch.Tensor | None, mb: Microbatch,
                 batch: LossBatch) -> LossTerms:
        """``sum_r datum_loss(lp_r, inputs_r)`` over the micro-batch's rows ``r`` (``lp_r = logprob[r, 1:N_r+1]``,
        the inputs cast to its dtype, as the server always did); the row index is the datum index."""
        lengths = mb["action_mask"].sum(dim=1).tolist()
        total = logprob.new_zeros(())
        for j, (row, n) in enumerate(zip(mb.rows, lengths, strict=True)):
            lp = logprob[j, 1:int(n) + 1]
            inputs = {k: mb[INPUT + k][j, 1:int(n) + 1].to(lp.dtype) for k in self.keys if bool(mb[HAS + k][j])}
            total = total + datum_loss(self.loss, self.name, lp, inputs, self.config, row)
        return LossTerms(loss=total)

    def metric_keys(self) -> tuple[list[str], list[str], list[str]]:
        """No metrics besides the loss."""
        return [], [], []

    def rows_without_gradient(self, batch: LossBatch, rows: Sequence[int]) -> list[int]:
        """Every row for ``forward_only``, else none."""
        return list(rows) if self.forward_only else []


__all__ = ["HAS", "INPUT", "TARGETS", "TinkerLoss", "tinker_batch"]
