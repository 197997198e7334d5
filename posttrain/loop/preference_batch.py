"""Preference pairs as token ids, and their responses' sequence log-probs under a model.

A pair is encoded as the run's rendered prompt (:func:`posttrain.loop.builders.build_renderer`: the same
prompt ids the engine samples from) followed by each response's tokens and the EOS token, the layout
of a sampled response that ended by itself. The sequence log-prob of a response is the sum of its
token log-probs (EOS included) given the prompt: :func:`sequence_logprobs`, one forward of the
prompt + response rows (:func:`posttrain.learner.logprobs.forward_logprobs`, the prompt's positions never
formed as logits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from posttrain.errors import UserError
from posttrain.learner.logprobs import forward_logprobs
from posttrain.learner.microbatch import split_by_token_budget

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.envs.preference_data import PreferencePair
    from posttrain.envs.prompt_render import PromptRenderer


@dataclasses.dataclass(frozen=True)
class _PromptView:
    """What :class:`~posttrain.envs.prompt_render.PromptRenderer` reads of an example."""

    prompt: str
    messages: tuple[dict[str, str], ...] | None


@dataclasses.dataclass(frozen=True)
class EncodedPair:
    """One pair as ids: ``prompt`` (rendered), ``chosen`` / ``rejected`` (response + EOS); ``score_diff``
    (ODPO's offset input, None when the data has none); ``source`` names the pair in errors."""

    pair_id: str
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    score_diff: float | None
    source: str

    @property
    def tokens(self) -> int:
        """Tokens of both rows (prompt counted twice): the pair's micro-batch cost."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def response_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    """Ids of a response text as the engine would have sampled it: no special tokens, then EOS."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)


def encode_pair(pair: PreferencePair, renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase, *,
                max_length: int) -> EncodedPair:
    """``pair`` as ids; :class:`~posttrain.errors.UserError` naming the pair's source (file and row) when
    prompt + a response exceeds ``max_length`` tokens (``preference.max_length``) or a response is empty."""
    if isinstance(pair.prompt, str):
        view = _PromptView(prompt=pair.prompt, messages=None)
    else:
        msgs = tuple(dict(m) for m in pair.prompt)
        view = _PromptView(prompt=msgs[-1]["content"], messages=msgs)
    prompt = tuple(renderer.ids(view))
    source = str(pair.meta.get("source", pair.pair_id))
    rows = {}
    for side, text in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        ids = response_ids(tokenizer, text)
        if not ids:
            raise UserError(f"{source}: the {side} response encodes to no tokens")
        if len(prompt) + len(ids) > max_length:
            raise UserError(f"{source}: prompt + {side} response is {len(prompt) + len(ids)} tokens, over "
                            f"preference.max_length={max_length} (raise it, or drop the pair from the file)")
        rows[side] = ids
    score = pair.meta.get("score_diff")
    return EncodedPair(pair_id=pair.pair_id, prompt=prompt, chosen=rows["chosen"], rejected=rows["rejected"],
                       score_diff=None if score is None else float(score), source=source)


def _padded(rows: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], pad_id: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, response_mask)`` ``[N, T]`` of (prompt, response) rows, right-padded."""
    T = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    resp = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attn[i, :n] = 1
        resp[i, len(p):n] = True
    return ids, attn, resp


def sequence_logprobs(model: torch.nn.Module, rows: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], *,
                      pad_id: int) -> torch.Tensor:
    """``[N]`` sum of the response tokens' log-probs of each (prompt, response) row, in one forward under
    the caller's grad mode (temperature 1, the full softmax)."""
    ids, attn, resp = _padded(rows, pad_id)
    first = min(len(p) for p, _ in rows)
    lp, _ = forward_logprobs(model, ids, attn, first_position=max(first, 1))
    out: torch.Tensor = (lp * resp.to(lp.dtype)).sum(dim=1)
    return out


def pair_chunks(pairs: Sequence[EncodedPair], microbatch_tokens: int) -> list[list[int]]:
    """Indices of ``pairs`` cut into micro-batches of at most ``microbatch_tokens`` padded tokens (a pair
    costs its two rows at the longest of them; :func:`~posttrain.learner.microbatch.split_by_token_budget`)."""
    lengths = [2 * (len(p.prompt) + max(len(p.chosen), len(p.rejected))) for p in pairs]
    return split_by_token_budget(lengths, microbatch_tokens)


@torch.no_grad()
def pair_logprobs(model: torch.nn.Module, pairs: Sequence[EncodedPair], *, pad_id: int,
                  microbatch_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen [B], rejected [B])`` sequence log-probs of every pair, without grad, micro-batched."""
    chosen = torch.zeros(len(pairs), dtype=torch.float64)
    rejected = torch.zeros(len(pairs), dtype=torch.float64)
    for chunk in pair_chunks(pairs, microbatch_tokens):
        sub = [pairs[i] for i in chunk]
        lp = sequence_logprobs(model, [(p.prompt, p.chosen) for p in sub] + [(p.prompt, p.rejected) for p in sub],
                               pad_id=pad_id).to(torch.float64)
        idx = torch.tensor(chunk, dtype=torch.long)
        chosen[idx], rejected[idx] = lp[: len(sub)], lp[len(sub):]
    return chosen, rejected
