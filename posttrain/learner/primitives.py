"""The learner's primitives (after Thinking Machines' Tinker API), shared by every trainer program.

A trainer is a short program over them (``PolicyLearner.update``, the SFT warm-up, online preference)::

    for each mini-batch:
        out = learner.forward_backward(batch, loss)   # gradients accumulate; returns what it computed
        outcome = learner.optim_step()                # clip / skip / AdamW + schedule; zeroes the gradients

:func:`forward_backward` runs one mini-batch (:class:`LossBatch`: the rows and their loss-token count) in
token-budget micro-batches: each micro-batch's per-token log-probs (:class:`ForwardSpec`: the sampler's
temperature and truncation replayed, or the model's plain softmax) go to the :class:`TokenLoss`, whose
scalar is back-propagated. Because the loss reduces with the *mini-batch's* counts, the micro-batch losses
sum to the mini-batch loss however the rows are split. The result (:class:`ForwardBackwardOutput`: the
log-probs ``[B, T]`` of that forward, the loss value, the loss's metric sums) is returned, never parked.
Under data parallelism (:mod:`posttrain.learner.grad_sync`) each process runs its shard of the rows and
the gradients and metric sums are reduced over processes; a lockstep hook (FSDP2) pads a short process
with zero-weight passes so the collectives inside the passes pair up.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from posttrain.learner.chunked_head import chunk_tokens_for, chunked_token_logprobs, head_weight
from posttrain.learner.grad_sync import GradientSync
from posttrain.learner.logprobs import (
    HEAD_IS_LM_HEAD_OF_LAST_HIDDEN,
    LinearHead,
    first_scored_position,
    forward_logprobs,
    linear_head_of,
)
from posttrain.learner.lora import is_peft_model
from posttrain.learner.microbatch import Microbatch, RowTensors, microbatches
from posttrain.learner.optim_step import StepOutcome
from posttrain.learner.shared_prompt import shared_prompt_logprobs, shared_prompt_microbatches


@dataclasses.dataclass(frozen=True)
class ForwardSpec:
    """How :func:`forward_backward` forms a micro-batch's log-probs for a loss.

    ``sampler_replay``: ``log softmax(z / T)`` over the sampler's kept set (the learner's temperature,
    top-k, top-p; :func:`~posttrain.learner.logprobs.forward_logprobs`, cast to the compute dtype) — the
    RL losses; False: the model's own untruncated ``log_softmax(z)`` at temperature 1 over the whole
    vocabulary (:func:`plain_logprobs`: the SFT negative log-likelihood, the Tinker losses). ``with_entropy``
    / ``entropy_grad``: the token entropy too, with or without its graph (replay only). ``autocast``: run
    the forward under the learner's mixed precision. Plain only: ``targets``, the batch tensor ``[B, T]`` of
    the tokens scored at each position (a Tinker datum's target tokens are not its shifted input; ``None``:
    ``input_ids``); ``chunked_head``, the log-probs through the chunked LM head where the model allows
    (:func:`plain_logprobs`; False: the full logits, whose exact numbers the SFT warm-up's goldens hold). A
    batch that carries a ``position_ids`` tensor ``[B, T]`` holds packed rows (several sequences per row,
    position ids restarting at 0 at each): the plain forward runs them through the model's packed-sequence
    mask (:func:`plain_logits`); the sampler replay refuses them."""

    sampler_replay: bool = True
    with_entropy: bool = False
    entropy_grad: bool = False
    autocast: bool = True
    targets: str | None = None
    chunked_head: bool = False


@dataclasses.dataclass
class LossTerms:
    """One micro-batch's loss: ``loss`` the scalar to back-propagate (reduced with the mini-batch's counts);
    ``sums`` metric sums (added over micro-batches and processes); ``mins`` / ``maxs`` extrema."""

    loss: torch.Tensor
    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    mins: dict[str, float] = dataclasses.field(default_factory=dict)
    maxs: dict[str, float] = dataclasses.field(default_factory=dict)


class TokenLoss(Protocol):
    """A loss :func:`forward_backward` computes on each micro-batch's per-token log-probs."""

    spec: ForwardSpec

    def __call__(self, logprob: torch.Tensor, entropy: torch.Tensor | None, mb: Microbatch,
                 batch: LossBatch) -> LossTerms:
        """The loss terms of micro-batch ``mb`` (``logprob`` / ``entropy`` ``[b, t]``) of mini-batch ``batch``."""
        ...

    def metric_keys(self) -> tuple[list[str], list[str], list[str]]:
        """The names of ``(sums, mins, maxs)`` every call may report (the same on every process: a
        process that ran no row reduces zeros / identities under them)."""
        ...

    def rows_without_gradient(self, batch: LossBatch, rows: Sequence[int]) -> list[int]:
        """Rows of ``rows`` that add exactly 0 to the loss and its gradient: forwarded without a graph
        (their log-probs and metrics recorded), never back-propagated. ``[]`` for most losses."""
        ...


@dataclasses.dataclass(frozen=True)
class LossBatch:
    """One mini-batch: ``tensors`` the batch's ``[B, T]`` tensors on the device (``input_ids``,
    ``attention_mask``, ``action_mask`` and what the loss reads), ``rows`` the mini-batch's rows,
    ``num_tokens`` its loss-token count (the reductions' ``N``; ``num_sequences`` = ``len(rows)``)."""

    tensors: RowTensors
    rows: Sequence[int]
    num_tokens: float

    @property
    def num_sequences(self) -> int:
        """Rows of the mini-batch, each counted even without a loss token (the reductions' ``B``)."""
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)`` of the whole batch."""
        ids = self.tensors["input_ids"]
        assert ids is not None
        return int(ids.shape[0]), int(ids.shape[1])


@dataclasses.dataclass
class ForwardBackwardOutput:
    """What one :func:`forward_backward` computed: ``logprob`` ``[B, T]`` float64 CPU, the per-token log-probs
    of that forward (NaN on rows this process did not forward), ``loss`` the summed loss value, ``metrics``
    the loss's metric sums and extrema (global over processes) plus ``no_signal_rows`` (rows forwarded
    without a backward)."""

    logprob: torch.Tensor | None
    loss: float
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """The learner's side of a forward: model, sampler replay, micro-batch budget and modes."""

    model: torch.nn.Module
    temperature: float
    top_k: int
    top_p: float
    microbatch_tokens: int | None
    entropy_chunk_size: int | None
    compute_dtype: torch.dtype
    autocast: Callable[[], contextlib.AbstractContextManager[object]]
    grad_mode: Callable[[], contextlib.AbstractContextManager[object]]
    grad_sync: GradientSync
    params: Sequence[torch.nn.Parameter]
    share_prompts: bool = False
    """The sampler replay forwards each distinct prompt of a micro-batch once
    (:func:`~posttrain.learner.shared_prompt.shared_prompt_logprobs`; ``optim.share_prompts``)."""


def _plain_head(model: torch.nn.Module) -> LinearHead | None:
    """The backbone and head weight of ``model`` (through a peft wrapper) when its logits are ``last_hidden @ W^T``
    (:data:`~posttrain.learner.logprobs.HEAD_IS_LM_HEAD_OF_LAST_HIDDEN`), its head a bias-free linear layer or
    a LoRA-adapted one (:func:`~posttrain.learner.chunked_head.head_weight`: the folded weight), not an FSDP
    ``DTensor``; else ``None``."""
    base: object = model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]
    get_head, get_decoder = getattr(base, "get_output_embeddings", None), getattr(base, "get_decoder", None)
    if getattr(getattr(base, "config", None), "model_type", None) not in HEAD_IS_LM_HEAD_OF_LAST_HIDDEN or not (
            callable(get_head) and callable(get_decoder)):
        return None
    head, backbone = get_head(), get_decoder()
    w = head_weight(head) if isinstance(head, torch.nn.Module) else None
    if w is None or not isinstance(backbone, torch.nn.Module):
        return None
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(w, DTensor):  # sharded: gathered only in the model's own forward hooks
            return None
    return LinearHead(backbone=backbone, weight=w)


def _model_inputs(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The mask arguments of a plain forward: ``attention_mask`` (padded rows), or packed rows' ``position_ids``
    with ``attention_mask=None`` (:func:`plain_logits`)."""
    if position_ids is None:
        return {"attention_mask": attention_mask}
    return {"attention_mask": None, "position_ids": position_ids}


def plain_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits ``[B, T, V]`` as the plain forward runs it.

    Padded rows (``position_ids`` None): ``model(input_ids, attention_mask)``. Packed rows: ``position_ids``
    ``[B, T]`` restarting at 0 at each sequence of a row, with ``attention_mask=None`` and no KV cache: then
    transformers (``masking_utils.find_packed_sequence_indices``, taken only with no attention mask and no
    cache) starts a new sequence wherever ``position_ids[t] != position_ids[t-1] + 1`` and builds a
    block-diagonal causal mask, so no sequence attends to another, and the rotary positions are each
    sequence's own: each sequence's logits are those it has alone. ``attention_mask`` then only marks the
    real tokens for the caller (a row's tail padding is one more sequence, positions from 0)."""
    if position_ids is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits  # type: ignore[no-any-return]
    out = model(input_ids=input_ids, use_cache=False, **_model_inputs(attention_mask, position_ids))
    return out.logits  # type: ignore[no-any-return]


def plain_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                   targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   chunked: bool = True, chunk_tokens: int | None = None) -> torch.Tensor:
    """``[B, T]``: 0 at ``t = 0``, then ``log_softmax(z[:, t-1])[targets[:, t]]`` (``targets``: ``input_ids``
    when ``None``): the model's own distribution at temperature 1, untruncated. ``position_ids``: packed rows
    (:func:`plain_logits`); 0 also at each sequence's first token (``position_ids == 0``: no context of its own).

    ``chunked`` and :func:`_plain_head` splits the model (a plain or LoRA-adapted linear head over the last
    hidden state): the backbone runs on columns ``0 .. T-2`` (the last column's logits are never read; packed:
    with their position ids, no attention mask) and its hidden states go through
    :func:`~posttrain.learner.chunked_head.chunked_token_logprobs` on the real tokens only (at most
    ``chunk_tokens`` per chunk when given): no ``[tokens x V]`` logits, the same values up to the rounding of
    the chunked GEMMs, 0 on padding, the softmax in float32 for float32 / half models (float64 stays exact).
    Otherwise the model's full logits, ``log_softmax(z.float())`` (padding not masked: the caller's mask does it).
    """
    tg = input_ids if targets is None else targets
    head = _plain_head(model) if chunked else None
    if head is None:
        logits = plain_logits(model, input_ids, attention_mask, position_ids)[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tg[:, 1:, None]).squeeze(-1)
        lp = torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)
        return lp if position_ids is None else lp.masked_fill(position_ids == 0, 0.0)
    b, t = input_ids.shape
    if t < 2:
        return torch.zeros(b, t, dtype=torch.float32, device=input_ids.device)
    pos = None if position_ids is None else position_ids[:, :-1]
    out = head.backbone(input_ids=input_ids[:, :-1], use_cache=False, **_model_inputs(attention_mask[:, :-1], pos))
    scored = attention_mask[:, 1:].ne(0)
    if position_ids is not None:
        scored &= position_ids[:, 1:].ne(0)
    rows, cols = scored.nonzero(as_tuple=True)
    lp, _ = chunked_token_logprobs(out.last_hidden_state[rows, cols], head.weight, tg[:, 1:][rows, cols],
                                   chunk_tokens=chunk_tokens_for(head.weight.shape[0], chunk_tokens))
    return lp.new_zeros(b, t).index_put((rows, cols + 1), lp)


def _positions(mb: Microbatch) -> torch.Tensor | None:
    """The micro-batch's ``position_ids`` (packed rows), or None when the batch has none."""
    try:
        return mb.optional("position_ids")
    except KeyError:
        return None


def _forward(ctx: ForwardContext, mb: Microbatch, spec: ForwardSpec,
             needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    no_grad = contextlib.nullcontext() if needs_grad else torch.no_grad()
    amp = ctx.autocast() if spec.autocast else contextlib.nullcontext()
    with amp, ctx.grad_mode(), no_grad:
        if not spec.sampler_replay:
            targets = mb[spec.targets] if spec.targets is not None else None
            return plain_logprobs(ctx.model, mb["input_ids"], mb["attention_mask"], targets=targets,
                                  position_ids=_positions(mb), chunked=spec.chunked_head,
                                  chunk_tokens=ctx.entropy_chunk_size), None
        if _positions(mb) is not None:
            raise ValueError("packed rows (a position_ids tensor) go through the plain forward only "
                             "(ForwardSpec(sampler_replay=False))")
        if ctx.share_prompts:
            return _shared_prompt_forward(ctx, mb, spec)
        lp, ent = forward_logprobs(
            ctx.model, mb["input_ids"], mb["attention_mask"], first_position=first_scored_position(mb["action_mask"]),
            temperature=ctx.temperature, top_k=ctx.top_k, top_p=ctx.top_p, with_entropy=spec.with_entropy,
            entropy_grad=spec.entropy_grad, entropy_chunk_size=ctx.entropy_chunk_size)
    return lp.to(ctx.compute_dtype), ent


def _shared_prompt_forward(ctx: ForwardContext, mb: Microbatch,
                           spec: ForwardSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampler replay of ``mb`` through :func:`~posttrain.learner.shared_prompt.shared_prompt_logprobs`
    (under the caller's modes); ``ValueError`` when the model has no linear LM head to split at."""
    head = linear_head_of(ctx.model)
    if head is None:
        raise ValueError("optim.share_prompts needs a model split at a plain linear LM head (model types "
                         f"{sorted(HEAD_IS_LM_HEAD_OF_LAST_HIDDEN)}, the head not sharded); this one has none")
    lp, ent = shared_prompt_logprobs(
        head, mb["input_ids"], mb["attention_mask"], mb["action_mask"], temperature=ctx.temperature,
        top_k=ctx.top_k, top_p=ctx.top_p, with_entropy=spec.with_entropy, entropy_grad=spec.entropy_grad,
        chunk_cap=ctx.entropy_chunk_size)
    return lp.to(ctx.compute_dtype), ent


def _idle_pass(ctx: ForwardContext, mb: Microbatch) -> None:
    """A forward/backward whose loss is 0 * (log-probs): no gradient, but every collective a sharded model
    runs inside its passes (FSDP2's all-gather / reduce-scatter) runs here too."""
    with ctx.autocast(), ctx.grad_mode():
        lp, _ = forward_logprobs(ctx.model, mb["input_ids"], mb["attention_mask"], temperature=ctx.temperature,
                                 with_entropy=False, entropy_grad=False, entropy_chunk_size=ctx.entropy_chunk_size)
    with ctx.grad_mode():
        torch.autograd.backward((lp * 0.0).sum())


class _Tally:
    """Metric sums and extrema of one forward_backward."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add(self, terms: LossTerms) -> None:
        self.loss += float(terms.loss.detach())
        for k, v in terms.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in terms.mins.items():
            self.mins[k] = min(self.mins.get(k, v), v)
        for k, v in terms.maxs.items():
            self.maxs[k] = max(self.maxs.get(k, v), v)

    def reduce(self, sync: GradientSync, keys: tuple[list[str], list[str], list[str]]) -> None:
        """SUM the loss and sums over processes, MIN / MAX the extrema (keys sorted: the same order everywhere)."""
        sums, mins, maxs = (sorted(k) for k in keys)
        vec = sync.reduce_sums(torch.tensor([self.loss] + [self.sums.get(k, 0.0) for k in sums], dtype=torch.float64))
        self.loss, self.sums = float(vec[0]), {k: float(vec[1 + i]) for i, k in enumerate(sums)}
        ext = sync.reduce_min(torch.tensor([self.mins.get(k, float("inf")) for k in mins]
                                           + [-self.maxs.get(k, float("-inf")) for k in maxs], dtype=torch.float64))
        self.mins = {k: float(ext[i]) for i, k in enumerate(mins)}
        self.maxs = {k: -float(ext[len(mins) + i]) for i, k in enumerate(maxs)}

    def metrics(self) -> dict[str, float]:
        return {**self.sums, **{f"min/{k}": v for k, v in self.mins.items()},
                **{f"max/{k}": v for k, v in self.maxs.items()}}


def forward_backward(ctx: ForwardContext, batch: LossBatch, loss: TokenLoss) -> ForwardBackwardOutput:
    """Forward + backward of mini-batch ``batch`` with ``loss`` (module docstring); gradients accumulate in
    ``.grad`` (nothing is zeroed). Only this process's ``grad_sync.shard`` of the rows runs here; with more
    than one process the gradients and metrics are then reduced over them. Metrics: the loss's ``sums``
    under their names, extrema as ``min/<k>`` / ``max/<k>``, and ``no_signal_rows``."""
    sync = ctx.grad_sync
    am = batch.tensors["attention_mask"]
    assert am is not None
    rows = list(batch.rows)
    mine = sync.shard(rows, lengths=am[rows].sum(dim=1).tolist())  # token-balanced when the hook splits
    lockstep = bool(getattr(sync, "lockstep", False))
    quiet = loss.rows_without_gradient(batch, mine) if mine and not lockstep and sync.world_size == 1 else []
    loud = [r for r in mine if r not in set(quiet)]
    split = shared_prompt_microbatches if ctx.share_prompts and loss.spec.sampler_replay else microbatches
    mbs = [(mb, True) for mb in split(batch.tensors, loud, ctx.microbatch_tokens)]
    mbs += [(mb, False) for mb in split(batch.tensors, quiet, ctx.microbatch_tokens)]
    if lockstep:  # every process runs as many passes as the busiest one
        n_max = -int(sync.reduce_min(torch.tensor([-float(len(mbs))], dtype=torch.float64))[0])
        for _ in range(n_max - len(mbs)):
            _idle_pass(ctx, microbatches(batch.tensors, rows[:1], ctx.microbatch_tokens)[0])
    logprob = torch.full(batch.shape, float("nan"), dtype=torch.float64)
    tally = _Tally()
    for mb, needs_grad in mbs:
        lp, ent = _forward(ctx, mb, loss.spec, needs_grad)
        logprob[mb.row_index, : lp.shape[1]] = lp.detach().to("cpu", torch.float64)
        terms = loss(lp, ent, mb, batch)
        if needs_grad:
            with ctx.grad_mode():  # checkpointed layers recompute in the same mode
                terms.loss.backward()  # type: ignore[no-untyped-call]
        tally.add(terms)
    if sync.world_size > 1:
        sync.reduce_gradients(ctx.params)
        tally.reduce(sync, loss.metric_keys())
    return ForwardBackwardOutput(logprob=logprob, loss=tally.loss,
                                 metrics={**tally.metrics(), "no_signal_rows": float(len(quiet))})


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateOutput(Mapping[str, float]):
    """What one ``update`` (a whole RL update: every optimiser step of one rollout batch) returns.

    ``metrics``: the update's metrics (``PolicyLearner.update`` lists them); ``old_logprob``: pi_old ``[B, T]``
    float64 CPU (0 off the action mask) when it was fused (taken from the update's own forward), else None;
    ``current_logprob``: ``[B, T]`` float64 CPU, each row's log-probs from the forward of the last optimiser
    step that included it (0 off the action mask; NaN on the action tokens of a row this process never
    forwarded), or None (learner ranks: not gathered). The output also reads as its ``metrics`` mapping
    (``out["loss"]``, ``dict(out)``), the form ``update`` returned before the primitives."""

    metrics: dict[str, float]
    old_logprob: torch.Tensor | None = None
    current_logprob: torch.Tensor | None = None

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)


def merge_metrics(acc: dict[str, float], new: Mapping[str, float]) -> None:
    """Add one :class:`ForwardBackwardOutput`'s ``metrics`` into ``acc``: sums add, ``min/<k>`` / ``max/<k>``
    keep the extremum."""
    for k, v in new.items():
        if k not in acc:
            acc[k] = v
        elif k.startswith("min/"):
            acc[k] = min(acc[k], v)
        elif k.startswith("max/"):
            acc[k] = max(acc[k], v)
        else:
            acc[k] += v


@contextlib.contextmanager
def train_mode_if(model: torch.nn.Module, flag: bool) -> Iterator[None]:
    """Train mode around a block when ``flag`` (then eval mode again); a no-op otherwise."""
    if not flag:
        yield
        return
    model.train()
    try:
        yield
    finally:
        model.eval()


__all__ = ["ForwardBackwardOutput", "ForwardContext", "ForwardSpec", "LossBatch", "LossTerms", "StepOutcome",
           "TokenLoss", "UpdateOutput", "forward_backward", "merge_metrics", "plain_logits", "plain_logprobs",
           "train_mode_if"]

