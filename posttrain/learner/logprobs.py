"""Per-token log-probabilities (and entropies) of a causal LM on right-padded rows.

Alignment follows the trajectory contract: position ``t`` concerns token ``t``, so the value
at ``t`` comes from the logits at ``t - 1`` (the model's prediction of token ``t`` from the
prefix ``tokens_<t``). Position 0 has no prediction and padding is not a token: both are 0.

The temperature is applied exactly as the rollout sampler applies it, ``log_softmax(z / T)``,
so the recomputed ``old_logprob`` measures the same distribution as ``behavior_logprob``.
With truncated sampling (``top_k > 0`` or ``top_p < 1``) the sampler's distribution is the
softmax renormalised over the kept set; :func:`forward_logprobs` can replay that truncation
(the kept set recomputed from the learner's own logits, the sampled token always kept) so that
``pi_old`` and ``mu`` are the same distribution and ``kappa = pi_old / mu`` stays ~1 (see
docs/learner.md, "Truncated sampling").

Memory: when the model's LM head is a plain linear layer over the backbone's last hidden state
(:func:`linear_head_of`), the log-probs and entropies come from
:func:`posttrain.learner.chunked_head.chunked_token_logprobs`, which never holds the
``[tokens x vocab]`` logits of the whole micro-batch (docs/learner.md, "Memory: the chunked LM
head"); other models (and FSDP-sharded ones) run the full-logits path.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from posttrain.algos.entropy import entropy_from_logits
from posttrain.learner.chunked_head import chunk_tokens_for, chunked_token_logprobs
from posttrain.learner.kept_set import kept_set_mask
from posttrain.learner.lora import is_peft_model
from posttrain.learner.microbatch import split_by_token_budget

__all__ = [
    "FullLogits",
    "LinearHead",
    "accepts_logits_to_keep",
    "first_scored_position",
    "forward_logprobs",
    "kept_set_mask",
    "linear_head_of",
    "token_logprobs",
]

HEAD_IS_LM_HEAD_OF_LAST_HIDDEN = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""``config.model_type`` of the transformers causal LMs whose logits are exactly
``lm_head(model.model(...).last_hidden_state)`` (no soft-capping or logit scaling; read in their
``modeling_*.py``): the chunked head reproduces them. Any other model takes the full-logits path."""


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 logits -> float32 for the softmax; float32/float64 stay as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def first_scored_position(action_mask: torch.Tensor | None) -> int:
    """The first column ``t >= 1`` where any row of ``action_mask`` ``[B, T]`` is on (1 when none is, or
    no mask): the columns before it carry no action token, so no logits are needed for them."""
    if action_mask is None or action_mask.numel() == 0:
        return 1
    cols = torch.nonzero(action_mask[:, 1:].ne(0).any(dim=0))
    return int(cols[0]) + 1 if cols.numel() else 1


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model(...)`` takes ``logits_to_keep`` (transformers causal LMs: the LM head then runs on
    the last ``k`` positions only); looks through a peft wrapper to its base model."""
    m: object = model
    for _ in range(4):
        fwd = getattr(m, "forward", None)
        if fwd is not None:
            try:
                if "logits_to_keep" in inspect.signature(fwd).parameters:
                    return True
            except (TypeError, ValueError):
                return False
        base = getattr(m, "get_base_model", None)
        if base is None:
            return False
        nxt = base()
        if nxt is m:
            return False
        m = nxt
    return False


@dataclasses.dataclass(frozen=True)
class LinearHead:
    """A causal LM split at its LM head: ``logits = backbone(...).last_hidden_state @ weight^T``."""

    backbone: torch.nn.Module
    weight: torch.Tensor


class FullLogits(torch.nn.Module):
    """``model`` behind its own forward only, so :func:`forward_logprobs` takes the full-logits path.

    :func:`linear_head_of` finds no head in it (it has no ``config``), while ``logits_to_keep`` still
    reaches the model: the path every model took before the chunked head — the reference of its
    tests and the "before" arm of ``posttrain bench memory``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False,
                logits_to_keep: int = 0) -> object:
        """The inner model's output (``.logits`` ``[B, T or logits_to_keep, V]``)."""
        kw = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache, **kw)

    def gradient_checkpointing_enable(self) -> None:
        """The inner transformers model's activation checkpointing (``compute.gradient_checkpointing``)."""
        self.inner.gradient_checkpointing_enable()  # type: ignore[operator]


def _is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a distributed tensor (an FSDP2-sharded parameter, gathered only in the model's
    own forward hooks, which the split forward would bypass)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def linear_head_of(model: torch.nn.Module) -> LinearHead | None:
    """The backbone and head weight of a transformers causal LM (through a peft wrapper), or ``None``.

    ``None`` (the caller runs the model's own forward) unless: the model's ``config.model_type`` is
    in :data:`HEAD_IS_LM_HEAD_OF_LAST_HIDDEN`, ``get_output_embeddings()`` is exactly a bias-free
    ``torch.nn.Linear`` (not a LoRA-adapted head) and its weight is not a sharded ``DTensor``. With
    LoRA the backbone is the base model's decoder, whose layers carry the adapters in place.
    """
    base: object = model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]
    cfg = getattr(base, "config", None)
    get_head, get_decoder = getattr(base, "get_output_embeddings", None), getattr(base, "get_decoder", None)
    if getattr(cfg, "model_type", None) not in HEAD_IS_LM_HEAD_OF_LAST_HIDDEN or not (
        callable(get_head) and callable(get_decoder)
    ):
        return None
    head, backbone = get_head(), get_decoder()
    if type(head) is not torch.nn.Linear or head.bias is not None or not isinstance(backbone, torch.nn.Module):
        return None
    if _is_sharded(head.weight):
        return None
    return LinearHead(backbone=backbone, weight=head.weight)


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    first_position: int = 1,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    entropy_chunk_size: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass: ``logprob[b, t] = log softmax(z[b, t-1] / T)[input_ids[b, t]]``.

    Shapes: ``input_ids``, ``attention_mask`` ``[B, T]`` (right padding, mask 1 on real
    tokens); returns ``logprob [B, T]`` and, if ``with_entropy``, ``entropy [B, T]`` with
    ``entropy[b, t] = H(softmax(z[b, t-1] / T))`` (the entropy of the distribution that
    token ``t`` was drawn from). Both are 0 at ``t = 0`` and on padding. The softmax runs in
    float32 for half-precision models and in the model's dtype otherwise (float64 stays exact).

    ``entropy_grad=False`` computes the entropy from detached logits (a metric, no graph).
    Runs under the caller's grad mode: use it inside the update (with grad) or through
    :func:`token_logprobs` (no grad, micro-batched). Temperature scaling of logits before the
    softmax as in Ackley, Hinton & Sejnowski 1985 / every LM sampler.

    ``top_k > 0`` / ``top_p < 1``: the softmax is taken over the kept set of the sampler's
    truncation instead (:func:`kept_set_mask`, the order of
    :func:`posttrain.rollout.sampling.behaviour_logprobs`: temperature, top-k, then top-p), i.e.
    ``log softmax(z' masked to K)`` where ``K`` is recomputed from these logits and always holds
    the token at ``t`` (a token the engine sampled can fall just outside a recomputed kept set when
    the two sides round differently, or once the weights moved; keeping it gives a finite ratio).
    Gradients flow through the kept logits only; the set itself is a constant. The entropy stays
    that of the untruncated ``softmax(z / T)``.

    ``first_position`` (``>= 1``): log-probs (and entropies) only from column ``first_position`` on;
    the columns before it are 0 and their logits are never formed (:func:`first_scored_position` of
    the action mask: the prompt's positions, whose predictions no loss reads). With a model that takes
    ``logits_to_keep`` the LM head runs on the kept positions only (as TRL does); otherwise the full
    logits are sliced. The values on the kept columns are the same either way.

    Where :func:`linear_head_of` splits the model, the backbone runs to hidden states and the head
    runs chunked (:func:`posttrain.learner.chunked_head.chunked_token_logprobs`) on the real tokens
    from ``first_position`` on only, at most ``entropy_chunk_size`` tokens per chunk when given:
    the same values up to the rounding of the chunked GEMMs, without ``[tokens x vocab]`` tensors.
    """
    f = _scored_from(input_ids, attention_mask, first_position, temperature)
    head = linear_head_of(model)
    if head is not None:
        return _chunked_head_logprobs(head, input_ids, attention_mask, f, temperature=temperature,
                                      with_entropy=with_entropy, entropy_grad=entropy_grad,
                                      chunk_cap=entropy_chunk_size, top_k=top_k, top_p=top_p)
    return _full_logits_logprobs(model, input_ids, attention_mask, f, temperature=temperature,
                                 with_entropy=with_entropy, entropy_grad=entropy_grad,
                                 entropy_chunk_size=entropy_chunk_size, top_k=top_k, top_p=top_p)


def _scored_from(input_ids: torch.Tensor, attention_mask: torch.Tensor, first_position: int,
                 temperature: float) -> int:
    """:func:`forward_logprobs`'s first scored column ``f``: ``first_position`` clamped to ``1 .. max(T - 1, 1)``,
    after checking the inputs (``ValueError``: shapes not one equal ``[B, T]``, a temperature not > 0)."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be equal [B, T]"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    T = input_ids.shape[1]
    return min(max(int(first_position), 1), max(T - 1, 1))


def _chunked_head_logprobs(
    head: LinearHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, f: int, *, temperature: float,
    with_entropy: bool, entropy_grad: bool, chunk_cap: int | None, top_k: int, top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_logprobs` through the split model: backbone, then the chunked head on the real
    tokens of columns ``f ..`` (their predictions sit at ``f - 1 .. T - 2``), scattered back to ``[B, T]``."""
    B, T = input_ids.shape
    out = head.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state[:, f - 1:-1, :]
    rows, cols = attention_mask[:, f:].ne(0).nonzero(as_tuple=True)
    lp, ent = chunked_token_logprobs(
        hidden[rows, cols], head.weight, input_ids[:, f:][rows, cols], temperature=temperature, top_k=top_k,
        top_p=top_p, with_entropy=with_entropy, entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens_for(head.weight.shape[0], chunk_cap),
    )
    cols = cols + f
    logprob = lp.new_zeros(B, T).index_put((rows, cols), lp)
    entropy = ent.new_zeros(B, T).index_put((rows, cols), ent) if ent is not None else None
    return logprob, entropy


def _full_logits_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, f: int, *, temperature: float,
    with_entropy: bool, entropy_grad: bool, entropy_chunk_size: int | None, top_k: int, top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_logprobs` through the model's own forward: full logits of columns ``f - 1 .. T - 2``."""
    B, T = input_ids.shape
    if f > 1 and accepts_logits_to_keep(model):
        # logits at positions f-1 .. T-1 (the last T-f+1); the prediction of token t is at t-1
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=T - f + 1)
        logits = _upcast(out.logits[:, :-1, :])
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = _upcast(out.logits[:, f - 1:-1, :])
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, f:].unsqueeze(-1)
    if top_k > 0 or top_p < 1.0:
        keep = kept_set_mask(logits.detach(), top_k=top_k, top_p=top_p)
        keep.scatter_(-1, targets, True)
        logp_all = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    else:
        logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, targets).squeeze(-1)
    mask = attention_mask[:, f:].to(picked.dtype)
    zero = picked.new_zeros(B, f)
    logprob = torch.cat([zero, picked * mask], dim=1)
    entropy = None
    if with_entropy:
        kw = {} if entropy_chunk_size is None else {"chunk_size": entropy_chunk_size}
        if entropy_grad:
            ent = entropy_from_logits(logits, **kw)
        else:
            with torch.no_grad():
                ent = entropy_from_logits(logits.detach(), **kw)
        entropy = torch.cat([zero.to(ent.dtype), ent * mask.to(ent.dtype)], dim=1)
    return logprob, entropy


@torch.no_grad()
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    microbatch_tokens: int | None = None,
    with_entropy: bool = False,
    entropy_chunk_size: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    action_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_logprobs` without grad, micro-batched over rows by a token budget.

    Rows are grouped by :func:`split_by_token_budget` on their real lengths so each forward
    sees at most ``microbatch_tokens`` padded tokens (a single longer row runs alone), and each
    group's columns are trimmed to its own longest row. ``None`` means one forward for all rows.
    Used to freeze ``old_logprob`` (pi_old, before the update) and ``ref_logprob`` (pi_ref).
    ``action_mask`` ``[B, T]`` (optional): each group's logits start at its
    :func:`first_scored_position` (columns before it are 0; callers mask with the action mask anyway).
    Returns tensors ``[B, T]`` on ``input_ids.device``, 0 at ``t = 0`` and on padding.
    """
    B, T = input_ids.shape
    if B == 0:
        raise ValueError("token_logprobs: empty batch (0 rows)")
    lengths = attention_mask.sum(dim=1).tolist()
    groups = (
        [list(range(B))] if microbatch_tokens is None else split_by_token_budget(lengths, microbatch_tokens)
    )
    logprob: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    for rows in groups:
        idx = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
        width = max(1, int(max(lengths[r] for r in rows)))
        lp, ent = forward_logprobs(
            model,
            input_ids[idx, :width],
            attention_mask[idx, :width],
            first_position=first_scored_position(action_mask[idx, :width] if action_mask is not None else None),
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_chunk_size=entropy_chunk_size,
            top_k=top_k,
            top_p=top_p,
        )
        if logprob is None:
            logprob = lp.new_zeros(B, T)
        logprob[idx, :width] = lp
        if ent is not None:
            if entropy is None:
                entropy = ent.new_zeros(B, T)
            entropy[idx, :width] = ent
    if logprob is None:  # unreachable for B >= 1; keeps the type checker honest
        raise ValueError("token_logprobs: no micro-batch ran")
    return logprob, entropy
