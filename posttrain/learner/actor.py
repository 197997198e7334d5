"""The policy learner: log-prob recompute and the clipped-surrogate update of the actor.

One ``update`` call consumes one rollout batch: ``ppo_epochs`` passes, each shuffling the rows
into ``num_minibatches`` mini-batches (one optimizer step each), each mini-batch run as
token-budget micro-batches whose gradients accumulate. The loss of a mini-batch ``M`` is

    L(M) = sum_{b,t in M} w[b,t] * ( c[b,t] * l_pg[b,t] + beta * kl[b,t] - alpha * H[b,t] )

with ``l_pg`` from ``POLICY_LOSSES[policy_loss]`` (PPO: Schulman et al. 2017,
arXiv:1707.06347), ``c`` the behavior-correction weight (``CORRECTIONS``, 1 without one),
``kl`` from ``KL_ESTIMATORS`` against ``ref_logprob`` (KL in the loss, GRPO: Shao et al. 2024,
arXiv:2402.03300), ``H`` the token entropy, and ``w`` the reduction weights
``REDUCTIONS[reduction](mask_mb, num_sequences=|M|, num_tokens=N(M), max_len=...)`` computed
from *mini-batch* counts. Because ``w`` depends on a row only through that row and the global
counts, the micro-batch losses sum exactly to ``L(M)`` however ``M`` is split: the update is
invariant to the micro-batch size (tests/learner/test_actor.py checks it in float64).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Unpack

import torch

from posttrain.algos.policy_losses import PolicyLossInputs
from posttrain.algos.registry import CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, REDUCTIONS
from posttrain.learner.grad_sync import GradientSync, LocalSync
from posttrain.learner.logprobs import first_scored_position, forward_logprobs, token_logprobs
from posttrain.learner.lora import is_peft_model, merged_state_dict, wrap_lora
from posttrain.learner.microbatch import RowTensors, microbatches
from posttrain.learner.protocol import KLCoefficient
from posttrain.learner.settings import (
    BatchingSettings,
    ComputeSettings,
    FlatPolicyArgs,
    LoraSettings,
    OptimizerSettings,
    PolicyLossSettings,
    PolicySettings,
    SamplerReplay,
    policy_settings,
)
from posttrain.learner.trainer import Trainer, TrainTally
from posttrain.trajectory.collate import TrajectoryBatch
from posttrain.trajectory.enums import Finish

_AUTOCAST = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclasses.dataclass
class _Acc:
    """Running sums of one ``update`` (turned into metrics by :meth:`metrics`)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl_loss: float = 0.0
    entropy_loss: float = 0.0
    tokens: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    ratio_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    diag_sums: dict[str, float] = dataclasses.field(default_factory=dict)
    no_signal_rows: int = 0  # rows forwarded without a backward (see PolicyLearner.skip_no_signal_rows)

    # Token / loss sums that a data-parallel GradientSync adds over processes (ratio extrema apart).
    SUMMED = ("loss", "pg_loss", "kl_loss", "entropy_loss", "tokens", "kl_sum", "entropy_sum", "ratio_sum")


class PolicyLearner:
    """Actor update for online RL (see the module docstring for the loss).

    Settings are typed (:mod:`posttrain.learner.settings`; the flat keyword form of
    :class:`~posttrain.learner.settings.FlatPolicyArgs` overrides their fields). ``optim``: AdamW and its
    schedule, one step per mini-batch, ``max_grad_norm`` clipping the global L2 norm. ``batching``:
    epochs x mini-batches (shuffled by a generator seeded with ``seed``, saved by :meth:`state_dict`) x
    micro-batches of at most ``microbatch_tokens`` padded tokens — the
    :class:`~posttrain.learner.trainer.Trainer` skeleton runs them. ``loss``: registry names with their
    keyword arguments (``seq_mean_token_sum_norm`` needs ``reduction_kwargs={"max_len": L_max}``, the
    generation budget), validated at construction by each function's typed model
    (``Registry.validate_kwargs``), whose typed values the functions then get; ``compute_entropy``
    reports the token entropy (same logits, no extra forward) even when ``entropy_coef == 0``.
    ``sampler``: the temperature (equal to the sampler's) and the replayed truncation. ``compute``: ``autocast_dtype`` (``"bfloat16"``) turns on mixed precision where the device
    supports it (``None``, the CPU default: the model's dtype). ``lora.rank > 0`` wraps the model with
    peft LoRA adapters (then :attr:`model` is the peft model). ``kl_coef`` is a float or a controller
    with ``.value`` (the loop calls ``controller.update`` with the reported ``kl``); without a KL
    estimator it is only held (checkpointed, logged as ``kl_coef``) for a loop that applies it in the
    reward (``credit.kl_in_reward``).
    ``skip_no_signal_rows``: a row whose advantage is 0 on every action token contributes exactly 0 to
    the loss and to every gradient when the policy loss vanishes at ``A = 0`` (probed once per loss,
    :meth:`no_signal_rows_skippable`), there is no KL term and ``entropy_coef == 0`` — e.g. a GRPO group
    whose samples all got the same reward. Such rows are forwarded without grad (their log-probs,
    ratios and diagnostics are recorded as before) and never enter a backward pass; the gradient is
    that of the other rows, equal up to float rounding of the differently shaped micro-batches.
    ``grad_sync`` (:mod:`posttrain.learner.grad_sync`) is the data-parallel hook: which rows of a
    mini-batch this process computes and how gradients and metric sums are reduced over processes
    (default :class:`~posttrain.learner.grad_sync.LocalSync`: one process).
    Optimiser steps go through the trainer's :class:`~posttrain.learner.optim_step.OptimizerStepper`
    (clip, skip non-finite and exactly-zero gradients), as the critic's and the SFT warm-up's do.
    The model is kept in eval mode (dropout off) so pi_theta equals pi_old before the first step;
    ``compute.gradient_checkpointing`` (transformers checkpoints only in train mode) switches to train
    mode for the gradient forward and therefore refuses a model with dropout.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        optim: OptimizerSettings | None = None,
        batching: BatchingSettings | None = None,
        loss: PolicyLossSettings | None = None,
        sampler: SamplerReplay | None = None,
        compute: ComputeSettings | None = None,
        lora: LoraSettings | None = None,
        kl_coef: float | KLCoefficient = 0.0,
        grad_sync: GradientSync | None = None,
        **flat: Unpack[FlatPolicyArgs],
    ) -> None:
        s = policy_settings(
            PolicySettings(
                optim=optim or OptimizerSettings(), batching=batching or BatchingSettings(),
                loss=loss or PolicyLossSettings(), sampler=sampler or SamplerReplay(),
                compute=compute or ComputeSettings(), lora=lora or LoraSettings(),
            ),
            flat,
        )
        self.settings = s
        ls, cs = s.loss, s.compute
        if cs.autocast_dtype is not None and cs.autocast_dtype not in _AUTOCAST:
            raise ValueError(
                f"unknown autocast_dtype {cs.autocast_dtype!r}; valid: {', '.join(_AUTOCAST)} or None"
            )
        # Resolve names once: an unknown name fails here, listing the valid ones.
        self._policy_loss = POLICY_LOSSES[ls.policy_loss]
        self._reduction = REDUCTIONS[ls.reduction]
        self._kl = KL_ESTIMATORS[ls.kl_estimator] if ls.kl_estimator is not None else None
        self._correction = CORRECTIONS[ls.correction] if ls.correction is not None else None
        # The functions get their kwargs as typed by their models (Registry.validate_kwargs: an int for
        # a float parameter is a float); a wrong key or type fails here, not mid-update.
        self.policy_loss_kwargs = POLICY_LOSSES.validate_kwargs(ls.policy_loss, ls.policy_loss_kwargs,
                                                                key="policy_loss_kwargs")
        self.reduction_kwargs = REDUCTIONS.validate_kwargs(ls.reduction, ls.reduction_kwargs,
                                                           key="reduction_kwargs")
        self.correction_kwargs = (CORRECTIONS.validate_kwargs(ls.correction, ls.correction_kwargs,
                                                              key="correction_kwargs")
                                  if ls.correction is not None else {})
        # Fail at construction, not mid-update, on bad reduction values (e.g. a missing max_len).
        self._reduction(torch.ones(1, 1), num_sequences=1, num_tokens=1.0, **self.reduction_kwargs)
        self.kl_estimator_name = ls.kl_estimator
        self.kl_coef = kl_coef
        self.entropy_coef = float(ls.entropy_coef)
        self.temperature = float(s.sampler.temperature)
        # Truncated sampling replayed on the learner side (posttrain.learner.logprobs.kept_set_mask):
        # pi_theta / pi_old are the sampler's renormalised distribution, so kappa = pi_old / mu ~ 1.
        self.top_k, self.top_p = int(s.sampler.top_k), float(s.sampler.top_p)
        self.microbatch_tokens = s.batching.microbatch_tokens
        self.autocast_dtype = _AUTOCAST[cs.autocast_dtype] if cs.autocast_dtype is not None else None
        self.entropy_chunk_size = cs.entropy_chunk_size
        self.compute_entropy = ls.compute_entropy
        self.skip_no_signal_rows = bool(ls.skip_no_signal_rows)
        self.mask_truncated = bool(ls.mask_truncated)
        self._zero_at_zero_adv: bool | None = None  # probed lazily (no_signal_rows_skippable)

        if s.lora.rank > 0:
            model = wrap_lora(
                model,
                rank=s.lora.rank,
                alpha=s.lora.alpha,
                target_modules=s.lora.target_modules,
                dropout=s.lora.dropout,
            )
        self.gradient_checkpointing = cs.gradient_checkpointing
        if cs.gradient_checkpointing:
            # transformers checkpoints layers only in train mode; the learner enters train mode
            # for the gradient forward, which is only exact when the model has no dropout.
            dropout = _dropout_rates(model)
            if dropout:
                raise ValueError(
                    f"gradient_checkpointing needs a model without dropout (pi_theta must equal pi_old); "
                    f"found {dropout[:3]}"
                )
            model.gradient_checkpointing_enable()  # type: ignore[operator]
        self.model = model.eval()
        self.trainer = Trainer(list(model.parameters()), s.optim, s.batching)
        self.params = self.trainer.params
        self.grad_sync: GradientSync = grad_sync if grad_sync is not None else LocalSync()
        self.version = 0
        self.last_old_logprob: torch.Tensor | None = None  # pi_old of the last fused update (see update)
        self._fused_old: torch.Tensor | None = None
        self.last_current_logprob: torch.Tensor | None = None  # pi_theta the last update saw (see update)
        self._current: torch.Tensor | None = None

    # ------------------------------------------------------------------ trainer state
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The trainer's AdamW (the learner ranks save and restore it directly)."""
        return self.trainer.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        """The trainer's learning-rate schedule."""
        return self.trainer.scheduler

    @property
    def generator(self) -> torch.Generator:
        """The trainer's mini-batch shuffle generator."""
        return self.trainer.generator

    @property
    def optimizer_steps(self) -> int:
        """Optimiser steps taken so far (checkpointed; the learner ranks restore it)."""
        return self.trainer.optimizer_steps

    @optimizer_steps.setter
    def optimizer_steps(self, steps: int) -> None:
        self.trainer.optimizer_steps = steps

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        """Device of the model's parameters (batches are moved there)."""
        return next(self.model.parameters()).device

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of log-probs and losses: float64 for a float64 model, else float32."""
        return torch.float64 if next(self.model.parameters()).dtype == torch.float64 else torch.float32

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    @contextlib.contextmanager
    def grad_mode(self) -> Iterator[None]:
        """Train mode around a gradient forward (and its backward) when checkpointing: transformers'
        activation checkpointing acts only in train mode, exact because the model has no dropout (checked
        at construction). A no-op without ``compute.gradient_checkpointing``. Any loss on :attr:`model`
        that trains through :attr:`trainer` (the online preference step too) runs under it."""
        if not self.gradient_checkpointing:
            yield
            return
        self.model.train()
        try:
            yield
        finally:
            self.model.eval()

    def current_kl_coef(self) -> float:
        """beta: the float ``kl_coef`` or the controller's current ``.value``."""
        return float(self.kl_coef) if isinstance(self.kl_coef, (int, float)) else float(self.kl_coef.value)

    def current_lr(self) -> float:
        """Learning rate the next optimizer step will use."""
        return self.trainer.current_lr()

    def can_fuse_old_logprob(self) -> bool:
        """True when ``update(..., fuse_old=True)`` may take pi_old from the update's own forward.

        Exactly one optimizer step per update (``ppo_epochs == 1`` and ``num_minibatches == 1``):
        its forward runs under the weights pi_old is defined by, so ``lp.detach()`` *is* pi_old and a
        separate no-grad forward is redundant. Not with a behaviour correction (its kept-token mask
        enters the reduction counts before the forward) nor across processes (one process here)."""
        b = self.settings.batching
        return (b.epochs == 1 and b.num_minibatches == 1 and self._correction is None
                and self.grad_sync.world_size == 1)

    # ------------------------------------------------------------------ log-probs
    def compute_logprobs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """Frozen log-probs ``[B, T]`` (float64, CPU) of ``batch`` under the current weights.

        ``logprob[b, t] = log softmax(z[b, t-1] / temperature)[token[b, t]]`` on action tokens,
        0 elsewhere; no grad, micro-batched by ``microbatch_tokens``. Call it before
        :meth:`update` for ``old_logprob`` (pi_old) and on the reference model's learner for
        ``ref_logprob``; attach with ``batch.freeze('old' | 'ref', logprob, version)``.
        """
        sync = self.grad_sync
        if sync.world_size > 1 and batch.size >= sync.world_size and not getattr(sync, "lockstep", False):
            # Rows are independent in a forward pass: each process computes its shard, a SUM of the
            # zero-padded shards assembles the batch. (A lockstep hook's processes each compute the
            # whole batch: the same micro-batches everywhere keep their collectives paired.)
            mine = sync.shard(range(batch.size))
            lp_mine, _ = self._frozen(batch.select_rows(mine), with_entropy=False)
            full = torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float64)
            full[mine, : lp_mine.shape[1]] = lp_mine
            return sync.reduce_sums(full)
        lp, _ = self._frozen(batch, with_entropy=False)
        return lp

    def _frozen(
        self, batch: TrajectoryBatch, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev = self.device
        with self._autocast():
            lp, ent = token_logprobs(
                self.model,
                batch.input_ids.to(dev),
                batch.attention_mask.to(dev),
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                microbatch_tokens=self.microbatch_tokens,
                action_mask=batch.action_mask.to(dev),
                with_entropy=with_entropy,
                entropy_chunk_size=self.entropy_chunk_size,
            )
        mask = batch.action_mask.to(torch.float64)
        lp = lp.detach().to("cpu", torch.float64) * mask
        return lp, (ent.detach().to("cpu", torch.float64) * mask if ent is not None else None)

    # ------------------------------------------------------------------ update
    def _prepare(
        self, batch: TrajectoryBatch, advantages: torch.Tensor | None, old_logprob: torch.Tensor | None,
        fuse_old: bool = False,
    ) -> tuple[dict[str, torch.Tensor | None], dict[str, float]]:
        """Move the batch to the device, apply the behavior correction, check shapes.

        ``advantages`` / ``old_logprob`` default to the batch's own (``batch.advantages``,
        ``batch.old_logprob``). ``fuse_old``: ``t["old_logprob"]`` stays ``None`` and each
        micro-batch takes its own detached log-probs as pi_old (``can_fuse_old_logprob``);
        log-kappa metrics come later."""
        B, T = batch.input_ids.shape
        if advantages is None:
            advantages = batch.advantages
        if advantages is None:
            raise ValueError("no advantages: pass them or attach them with batch.with_targets(advantages=...)")
        if advantages.dim() == 1:
            if advantages.shape[0] != B:
                raise ValueError(f"advantages have shape {tuple(advantages.shape)}, batch has {B} rows")
            advantages = advantages[:, None].expand(B, T)  # a sequence-level advantage per token
        if tuple(advantages.shape) != (B, T):
            raise ValueError(f"advantages have shape {tuple(advantages.shape)}, batch is {(B, T)}")
        if old_logprob is None and not fuse_old:
            old_logprob = batch.old_logprob
        if old_logprob is None and not fuse_old:
            # On-policy: pi_old is the current policy; freeze it now (before any step).
            old_logprob = self.compute_logprobs(batch)
        if old_logprob is not None and tuple(old_logprob.shape) != (B, T):
            raise ValueError(f"old_logprob has shape {tuple(old_logprob.shape)}, batch is {(B, T)}")
        if self._kl is not None and batch.ref_logprob is None:
            raise ValueError(
                f"kl_estimator={self.kl_estimator_name!r} needs ref_logprob: freeze it with "
                "batch.freeze('ref', ...) before the update"
            )
        if not torch.isfinite(advantages[batch.action_mask > 0]).all():
            raise ValueError("advantages are not finite on some action token")
        dev, dt = self.device, self.compute_dtype
        action_mask = batch.action_mask.to(dev, dt)
        t: dict[str, torch.Tensor | None] = {
            "input_ids": batch.input_ids.to(dev),
            "attention_mask": batch.attention_mask.to(dev),
            "old_logprob": old_logprob.to(dev, dt) * action_mask if old_logprob is not None else None,
            "behavior_logprob": batch.behavior_logprob.to(dev, dt) * action_mask,
            "ref_logprob": batch.ref_logprob.to(dev, dt) * action_mask
            if batch.ref_logprob is not None
            else None,
            "advantages": advantages.to(dev, dt) * action_mask,
        }
        info: dict[str, float] = {}
        weights, keep = torch.ones_like(action_mask), torch.ones_like(action_mask)
        if self._correction is not None:
            kw = dict(self.correction_kwargs)
            params = inspect.signature(self._correction).parameters
            # Staleness-type corrections read versions; pass them only to functions that take them.
            if "behavior_version" in params:
                kw.setdefault("behavior_version", batch.behavior_version.to(dev))
            if "current_version" in params:
                kw.setdefault("current_version", self.version)
            out = self._correction(t["behavior_logprob"], t["old_logprob"], action_mask, **kw)
            weights, keep = out.weights.to(dt).detach(), out.keep.to(dt).detach()
            for k, v in out.diagnostics.items():
                v = torch.as_tensor(v, dtype=dt, device=dev)
                info[f"correction/{k}"] = float(
                    (v * action_mask).sum() / action_mask.sum().clamp(min=1)
                    if v.shape == action_mask.shape
                    else v.mean()
                )
            info["correction/kept_token_frac"] = float(
                (keep * action_mask).sum() / action_mask.sum().clamp(min=1)
            )
        loss_mask = action_mask * keep
        if self.mask_truncated:
            # DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, sec. 3.4): a row cut before its end
            # gets no loss token; its reward already entered its group's advantages. Every row still counts in
            # the reduction's B (reductions contract), like a row the correction drops whole.
            cut = torch.tensor([tr.finish is Finish.TRUNCATED for tr in batch.trajectories], device=dev)
            loss_mask = loss_mask * (~cut).to(dt)[:, None]
            info["truncated_rows_masked"] = float(cut.sum())
        t["loss_mask"] = loss_mask
        t["action_mask"] = action_mask  # where log-probs are recorded (ledger), a superset of the loss mask
        t["correction_weight"] = weights
        if t["old_logprob"] is not None:
            info.update(_logkappa_metrics(t["behavior_logprob"], t["old_logprob"], action_mask,  # type: ignore[arg-type]
                                          batch.behavior_version.to(dev), self.version))
        return t, info

    def _reduction_weights(self, mask: torch.Tensor, num_sequences: int, num_tokens: float) -> torch.Tensor:
        # num_sequences / num_tokens are the MINI-BATCH's counts, never a micro-batch's or a shard's:
        # that is what makes any split of the rows sum to the same loss and gradient.
        w: torch.Tensor = self._reduction(
            mask, num_sequences=num_sequences, num_tokens=num_tokens, **self.reduction_kwargs
        )
        return w

    def _accumulate(self, t: RowTensors, rows: Sequence[int], acc: _Acc, num_tokens: float) -> None:
        """Forward + backward of mini-batch ``rows`` (``num_tokens`` loss tokens) in micro-batches.

        Counts come from the whole mini-batch (the batch is replicated on every process); only the
        ``grad_sync.shard`` of the rows is computed here, then gradients and metric sums are reduced
        over processes by the hook (identities for one process)."""
        # Every row of the mini-batch counts in B, even one with no loss token (reductions contract).
        num_sequences = len(rows)
        sync = self.grad_sync
        am = t["attention_mask"]
        assert am is not None
        lengths = am[list(rows)].sum(dim=1).tolist()
        mine = sync.shard(rows, lengths=lengths)  # token-balanced across processes when the hook splits
        before = [getattr(acc, k) for k in _Acc.SUMMED] if sync.world_size > 1 else None
        diag_before = dict(acc.diag_sums)
        lockstep = bool(getattr(sync, "lockstep", False))
        if mine or lockstep:
            self._accumulate_rows(t, mine, acc, num_sequences, num_tokens,
                                  filler=list(rows[:1]) if lockstep else None)
        if before is not None:
            sync.reduce_gradients(self.params)
            self._reduce_acc(acc, before, diag_before)

    def _reduce_acc(self, acc: _Acc, before: list[float], diag_before: dict[str, float]) -> None:
        """Make this mini-batch's metric sums global (SUM over processes; ratio extrema MIN/MAX)."""
        sync = self.grad_sync
        # Diagnostics keys are fixed by the policy loss (same on every process), sorted for the order.
        # A process that ran no row of this mini-batch has no diagnostics yet: take the loss's own keys.
        diag_keys = sorted(set(acc.diag_sums) | self._token_diag_keys())
        vec = torch.tensor(
            [getattr(acc, k) - b for k, b in zip(_Acc.SUMMED, before, strict=True)]
            + [acc.diag_sums.get(k, 0.0) - diag_before.get(k, 0.0) for k in diag_keys],
            dtype=torch.float64,
        )
        vec = sync.reduce_sums(vec)
        for i, (k, b) in enumerate(zip(_Acc.SUMMED, before, strict=True)):
            setattr(acc, k, b + float(vec[i]))
        for j, k in enumerate(diag_keys):
            acc.diag_sums[k] = diag_before.get(k, 0.0) + float(vec[len(_Acc.SUMMED) + j])
        ext = sync.reduce_min(torch.tensor([acc.ratio_min, -acc.ratio_max], dtype=torch.float64))
        acc.ratio_min, acc.ratio_max = float(ext[0]), -float(ext[1])

    def _accumulate_rows(self, t: Mapping[str, torch.Tensor | None], rows: Sequence[int], acc: _Acc,
                         num_sequences: int, num_tokens: float, filler: Sequence[int] | None = None) -> None:
        """Forward + backward of ``rows`` in micro-batches with the given mini-batch counts.

        ``filler`` (a lockstep hook): after its own micro-batches this process runs zero-weight
        passes over ``filler`` until it has run as many passes as the busiest process."""
        beta = self.current_kl_coef() if self._kl is not None else 0.0
        entropy_grad = self.entropy_coef != 0.0
        quiet: list[int] = []
        if rows and filler is None and self.grad_sync.world_size == 1 and self.no_signal_rows_skippable():
            adv = t["advantages"]
            assert adv is not None
            signal = (adv[list(rows)] != 0).any(dim=1).tolist()
            quiet = [r for r, s in zip(rows, signal, strict=True) if not s]
            rows = [r for r, s in zip(rows, signal, strict=True) if s]
            acc.no_signal_rows += len(quiet)
        mbs = [(mb, True) for mb in microbatches(t, rows, self.microbatch_tokens)]
        mbs += [(mb, False) for mb in microbatches(t, quiet, self.microbatch_tokens)]
        if filler is not None:
            n_max = -int(self.grad_sync.reduce_min(torch.tensor([-float(len(mbs))], dtype=torch.float64))[0])
            for _ in range(n_max - len(mbs)):
                self._idle_pass(t, filler)
        for mb, needs_grad in mbs:
            mask = mb["loss_mask"]
            # A no-signal micro-batch: the same forward, metrics and records, without a graph or backward.
            no_grad = contextlib.nullcontext() if needs_grad else torch.no_grad()
            with self._autocast(), self.grad_mode(), no_grad:
                lp, ent = forward_logprobs(
                    self.model,
                    mb["input_ids"],
                    mb["attention_mask"],
                    first_position=first_scored_position(mb["action_mask"]),
                    temperature=self.temperature,
                    top_k=self.top_k,
                    top_p=self.top_p,
                    with_entropy=entropy_grad or self.compute_entropy,
                    entropy_grad=entropy_grad,
                    entropy_chunk_size=self.entropy_chunk_size,
                )
            lp = lp.to(self.compute_dtype)
            if self._current is not None:  # rewritten each epoch: the last optimiser step's forward wins
                self._current[mb.row_index, : lp.shape[1]] = lp.detach().to("cpu", torch.float64)
            if mb.optional("old_logprob") is None:  # fused: this forward runs under pi_old's weights
                fused_old = lp.detach() * mask
                mb["old_logprob"] = fused_old
                assert self._fused_old is not None
                self._fused_old[mb.row_index, : lp.shape[1]] = fused_old.to("cpu", torch.float64)
            out = self._policy_loss(
                PolicyLossInputs(
                    logprob=lp,
                    old_logprob=mb["old_logprob"],
                    advantages=mb["advantages"],
                    action_mask=mask,
                    behavior_logprob=mb["behavior_logprob"],
                ),
                **self.policy_loss_kwargs,
            )
            w = self._reduction_weights(mask, num_sequences, num_tokens)
            pg = (out.loss * mb["correction_weight"] * w).sum()
            total = pg
            kl_tok = None
            if self._kl is not None:
                kl_tok = self._kl(lp, mb["ref_logprob"]) * mask
                kl_term = (kl_tok * w).sum()
                total = total + beta * kl_term
                acc.kl_loss += float(kl_term.detach())
            if ent is not None:
                ent = ent.to(self.compute_dtype) * mask
                if entropy_grad:
                    ent_term = (ent * w).sum()
                    total = total - self.entropy_coef * ent_term
                    acc.entropy_loss += float(ent_term.detach())
            if needs_grad:
                with self.grad_mode():  # checkpointed layers recompute in the same mode
                    total.backward()
            # Diagnostics (no grad): token sums over the loss mask.
            with torch.no_grad():
                if ent is not None:
                    acc.entropy_sum += float(ent.detach().sum())
                lpd = lp.detach()
                on = mask > 0
                ratio = torch.exp(lpd - mb["old_logprob"])
                acc.loss += float(total.detach())
                acc.pg_loss += float(pg.detach())
                acc.tokens += float(mask.sum())
                if kl_tok is not None:
                    acc.kl_sum += float(kl_tok.detach().sum())
                if on.any():
                    acc.ratio_sum += float((ratio * mask).sum())
                    acc.ratio_min = min(acc.ratio_min, float(ratio[on].min()))
                    acc.ratio_max = max(acc.ratio_max, float(ratio[on].max()))
                for k, v in out.diagnostics.items():
                    v = torch.as_tensor(v).detach()
                    if v.shape == mask.shape:
                        acc.diag_sums[k] = acc.diag_sums.get(k, 0.0) + float((v.to(mask.dtype) * mask).sum())

    def no_signal_rows_skippable(self) -> bool:
        """True when a row with ``A = 0`` on every token adds exactly 0 to the loss and its gradient:
        ``skip_no_signal_rows`` is on, no KL term, ``entropy_coef == 0``, and the policy loss is exactly 0
        with a zero gradient at ``A = 0`` (probed once on random log-probs, ratios far inside and outside
        any clip range, with and without a behaviour log-prob gap)."""
        if not self.skip_no_signal_rows or self._kl is not None or self.entropy_coef != 0.0:
            return False
        if self._zero_at_zero_adv is None:
            g = torch.Generator().manual_seed(0)
            shape = (4, 8)
            lp = (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0).requires_grad_(True)
            old = lp.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 2.0
            beh = old + torch.randn(shape, generator=g, dtype=torch.float64)
            mask = (torch.rand(shape, generator=g) > 0.2).to(torch.float64)
            mask[:, 0] = 1.0
            try:
                out = self._policy_loss(PolicyLossInputs(logprob=lp, old_logprob=old, advantages=torch.zeros(shape,
                                        dtype=torch.float64), action_mask=mask, behavior_logprob=beh),
                                        **self.policy_loss_kwargs)
                loss = torch.as_tensor(out.loss)
                (grad,) = torch.autograd.grad(loss.sum(), lp, allow_unused=True)
                self._zero_at_zero_adv = bool((loss == 0).all()) and (grad is None or bool((grad == 0).all()))
            except Exception:  # noqa: BLE001 - a loss that cannot be probed this way is simply not skipped
                self._zero_at_zero_adv = False
        return self._zero_at_zero_adv

    def _token_diag_keys(self) -> set[str]:
        """Names of the policy loss's per-token diagnostics (probed once on a 1x1 input): the keys
        every process must reduce, whether or not it ran a row."""
        if getattr(self, "_diag_key_cache", None) is None:
            z = torch.zeros(1, 1, dtype=torch.float64)
            out = self._policy_loss(PolicyLossInputs(logprob=z, old_logprob=z, advantages=z + 1.0,
                                                     action_mask=z + 1.0, behavior_logprob=z),
                                    **self.policy_loss_kwargs)
            self._diag_key_cache = {k for k, v in out.diagnostics.items() if torch.as_tensor(v).shape == z.shape}
        return set(self._diag_key_cache)

    def _idle_pass(self, t: Mapping[str, torch.Tensor | None], rows: Sequence[int]) -> None:
        """A forward/backward whose loss is 0 * (log-probs): no gradient, but every collective a
        sharded model runs inside its passes (FSDP2's all-gather / reduce-scatter) runs here too."""
        mb = microbatches(t, rows, self.microbatch_tokens)[0]
        with self._autocast(), self.grad_mode():
            lp, _ = forward_logprobs(self.model, mb["input_ids"], mb["attention_mask"], temperature=self.temperature,
                                     with_entropy=False, entropy_grad=False,
                                     entropy_chunk_size=self.entropy_chunk_size)
        zero = (lp * 0.0).sum()
        with self.grad_mode():
            torch.autograd.backward(zero)

    def compute_gradients(
        self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
        old_logprob: torch.Tensor | None = None,
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """Loss and gradients of the whole batch as ONE mini-batch, without an optimizer step.

        Returns ``(L(batch), {param_name: dL/dparam})`` (copies; ``.grad`` is cleared again).
        Micro-batched exactly like :meth:`update`; the shuffle generator is not touched. Used by
        the split-invariance test and ``posttrain check``.
        """
        t, _ = self._prepare(batch, advantages, old_logprob)
        acc = _Acc()
        self.trainer.accumulate(list(range(batch.size)), _PolicyObjective(self, t, acc))
        grads = {
            n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }
        self.optimizer.zero_grad(set_to_none=True)
        return acc.loss, grads

    def update(
        self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
        old_logprob: torch.Tensor | None = None, fuse_old: bool = False,
    ) -> dict[str, float]:
        """Train on one rollout batch; increments :attr:`version` by one. Returns metrics.

        ``fuse_old=True`` (only when :meth:`can_fuse_old_logprob`; ``old_logprob`` must be None):
        pi_old is not computed by a separate no-grad forward but taken, detached, from the update's
        own forward — the same weights, the same micro-batches — and left in
        :attr:`last_old_logprob` (``[B, T]`` float64 CPU, 0 off the action mask) for the ledger.
        :attr:`last_current_logprob` (``[B, T]`` float64 CPU, 0 off the action mask) holds, for every
        update, each row's log-probs from the forward of the last optimiser step that included it,
        taken before that step (so ``exp(current - old)`` is the ratio that step clipped); NaN on the
        action tokens of a row this process never forwarded (empty mini-batch, another rank's shard).

        ``advantages``: ``[B, T]`` per token (or ``[B]``, broadcast over the row's tokens), by default
        ``batch.advantages`` (the loop attaches them with ``batch.with_targets``); only
        action tokens count. ``old_logprob`` defaults to ``batch.old_logprob``, and when that is
        absent it is recomputed here before the first step (on-policy). A mini-batch with no loss
        token is skipped (counted in ``empty_minibatches``); a step whose gradient norm is not
        finite is skipped, its gradient dropped (counted in ``nonfinite_steps``); a step whose
        gradient is exactly zero is skipped too (``zero_grad_steps``): AdamW's momentum and weight
        decay would otherwise move the weights on a batch that carries no signal.

        Metrics: ``loss`` / ``pg_loss`` / ``kl_loss`` / ``entropy_loss`` — mean over optimizer
        steps of the reduced mini-batch terms; ``kl`` / ``entropy`` / ``ratio_mean`` — token means
        over loss tokens of all epochs; ``ratio_min`` / ``ratio_max``; ``clip_frac_low`` /
        ``clip_frac_high`` and ``pg/<name>`` — token means of the policy loss diagnostics;
        ``grad_norm`` (mean, before clipping) and ``grad_norm_max``; ``lr`` (of the last step);
        ``tokens_trained`` (loss tokens x epochs); ``optimizer_steps``; ``logkappa_abs_mean`` /
        ``logkappa_abs_max`` = |behavior - old| over action tokens; ``version`` (after the update).
        """
        if fuse_old:
            if not self.can_fuse_old_logprob() or old_logprob is not None:
                raise ValueError("fuse_old needs ppo_epochs=1, num_minibatches=1, no correction, one process "
                                 "and no old_logprob given")
            self._fused_old = torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float64)
        self._current = torch.full(tuple(batch.input_ids.shape), float("nan"), dtype=torch.float64)
        t, info = self._prepare(batch, advantages, old_logprob, fuse_old=fuse_old)
        acc = _Acc()
        tally = self.trainer.train(batch.size, _PolicyObjective(self, t, acc))
        cur_mask = batch.action_mask.to(torch.float64) > 0
        self.last_current_logprob = torch.where(cur_mask, self._current, torch.zeros_like(self._current))
        self._current = None
        if fuse_old:
            assert self._fused_old is not None
            old = self._fused_old * batch.action_mask.to(torch.float64)
            self.last_old_logprob, self._fused_old = old, None
            dt = self.compute_dtype
            am = batch.action_mask.to(self.device, dt)
            info.update(_logkappa_metrics(batch.behavior_logprob.to(self.device, dt) * am, old.to(self.device, dt), am,
                                          batch.behavior_version.to(self.device), self.version))
        self.version += 1
        return {**self._metrics(acc, tally), **info}

    def _metrics(self, acc: _Acc, tally: TrainTally) -> dict[str, float]:
        n_mb = max(1, tally.trained)
        n_tok = max(1.0, acc.tokens)
        m: dict[str, float] = {
            "loss": acc.loss / n_mb,
            "pg_loss": acc.pg_loss / n_mb,
            "kl_loss": acc.kl_loss / n_mb,
            "entropy_loss": acc.entropy_loss / n_mb,
            "kl": acc.kl_sum / n_tok,
            "entropy": acc.entropy_sum / n_tok,
            "ratio_mean": acc.ratio_sum / n_tok if acc.tokens else 1.0,
            "ratio_min": acc.ratio_min if acc.tokens else 1.0,
            "ratio_max": acc.ratio_max if acc.tokens else 1.0,
            **tally.steps.metrics(),
            "lr": tally.steps.lr if tally.steps.lr is not None else self.current_lr(),
            "tokens_trained": acc.tokens,
            "empty_minibatches": float(tally.empty),
            "no_signal_rows": float(acc.no_signal_rows),
            "kl_coef": self.current_kl_coef(),
            "version": float(self.version),
        }
        for k, s in acc.diag_sums.items():
            m[f"pg/{k}"] = s / n_tok
            # The clipped-surrogate losses flag clipped tokens as ``clipped_low`` / ``clipped_high``.
        m["clip_frac_low"] = m.get("pg/clipped_low", 0.0)
        m["clip_frac_high"] = m.get("pg/clipped_high", 0.0)
        return m

    # ------------------------------------------------------------------ weights and state
    def close(self) -> None:
        """Nothing to release: the learner lives in this process (the :class:`~posttrain.learner.protocol.Learner`
        contract; learner ranks stop their processes here)."""

    def weights_for_rollout(self) -> Mapping[str, torch.Tensor]:
        """Weights for the rollout engine under the plain model's parameter names.

        Without LoRA: ``model.state_dict()`` itself (live tensors, no copy — the engine must
        copy or load them before the next :meth:`update`). With LoRA: new tensors
        ``W + (alpha / r) B A`` for adapted layers (``W`` untouched), live tensors elsewhere. Pair with :attr:`version` (incremented by each update).
        """
        if is_peft_model(self.model):
            return merged_state_dict(self.model)
        return self.model.state_dict()

    def state_dict(self) -> dict[str, object]:
        """The trainer's state (:data:`~posttrain.learner.trainer.TRAINER_STATE_KEYS`), the weight
        ``version`` and the KL controller's state (``kl_controller``, if any)."""
        s = {**self.trainer.state_dict(), "version": self.version}
        if not isinstance(self.kl_coef, (int, float)):
            s["kl_controller"] = self.kl_coef.state_dict()
        return s

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Inverse of :meth:`state_dict` (model weights are loaded separately)."""
        self.trainer.load_state_dict(state, owner="policy learner", also_needs=("version",))
        self.version = int(state["version"])  # type: ignore[call-overload]
        if "kl_controller" in state:
            if isinstance(self.kl_coef, (int, float)):
                raise ValueError("state holds a KL controller but this learner has a fixed kl_coef")
            controller_state = state["kl_controller"]
            assert isinstance(controller_state, Mapping)
            self.kl_coef.load_state_dict(controller_state)


def _logkappa_metrics(behavior: torch.Tensor, old: torch.Tensor, action_mask: torch.Tensor,
                      behavior_version: torch.Tensor, version: int) -> dict[str, float]:
    """|log mu - log pi_old| over action tokens, split by what it measures.

    Tokens sampled under the learner's own weights (``behavior_version == version``): engine
    mismatch only, ``logkappa_abs_mean`` / ``logkappa_abs_max`` (absent when the batch has no such
    token, e.g. every sample lags in one_step_off; ``logkappa/tokens`` counts them); the
    train/rollout mismatch guard reads these. Tokens sampled under older weights: engine mismatch
    plus policy lag, ``lag/logratio_abs_mean`` / ``lag/logratio_abs_max`` (absent when none) and
    ``lag/tokens``.
    """
    log_kappa = (behavior - old).abs() * action_mask
    live = action_mask > 0
    same = live & (behavior_version == version)
    stale = live & ~same
    out: dict[str, float] = {"logkappa/tokens": float(same.sum()), "lag/tokens": float(stale.sum())}
    for prefix, sel in (("logkappa_abs", same), ("lag/logratio_abs", stale)):
        n = int(sel.sum())
        if n:
            out[f"{prefix}_mean"] = float(log_kappa[sel].sum() / n)
            out[f"{prefix}_max"] = float(log_kappa[sel].max())
    return out


def _dropout_rates(model: torch.nn.Module) -> list[str]:
    """``name=p`` of every ``nn.Dropout`` with p > 0 and every ``*dropout`` config value > 0."""
    found = [f"{n}={m.p}" for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for k, v in cfg.to_dict().items():
            if "dropout" in k and isinstance(v, (int, float)) and v > 0:
                found.append(f"config.{k}={v}")
    return found



class _PolicyObjective:
    """The policy learner's :class:`~posttrain.learner.trainer.MinibatchLoss` over one update's prepared
    tensors ``t`` (:meth:`PolicyLearner._prepare`), summing its metrics into ``acc``."""

    def __init__(self, learner: PolicyLearner, t: RowTensors, acc: _Acc) -> None:
        self.learner, self.t, self.acc = learner, t, acc

    def normaliser(self, rows: Sequence[int]) -> float:
        """Loss tokens of the mini-batch (the loss mask: action tokens kept by the correction)."""
        mask = self.t["loss_mask"]
        assert mask is not None
        return float(mask[list(rows)].sum())

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """The mini-batch loss of the module docstring, accumulated (:meth:`PolicyLearner._accumulate`)."""
        self.learner._accumulate(self.t, rows, self.acc, normaliser)
