"""The policy learner: the owner of the actor's model and optimiser, and its primitives.

``forward_backward`` / ``optim_step`` / ``compute_logprobs`` / ``state_dict`` / ``weights_for_rollout``
(:mod:`posttrain.learner.primitives`, after Tinker's API) are what every trainer program calls; ``update``
is the RL one, a short program over them::

    for epoch in range(ppo_epochs):
        for rows in shuffled mini-batches:           # num_minibatches, seeded by batching.seed
            forward_backward(LossBatch(rows), policy objective)   # token-budget micro-batches
            optim_step()                              # clip, skip non-finite / zero gradients, AdamW + schedule

The loss is the composed policy objective of :mod:`posttrain.algos.policy_objective`
(``sum w (c l_pg + beta kl - alpha H)``: PPO, Schulman et al. 2017; KL in the loss, GRPO, Shao et al.
2024; DAPO's overlong filtering, Yu et al. 2025), reduced with *mini-batch* counts, so the update is
invariant to the micro-batch size (tests/learner/test_actor.py checks it in float64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Unpack

import torch

from posttrain.algos.policy_objective import PolicyObjective
from posttrain.learner.grad_sync import GradientSync, LocalSync
from posttrain.learner.logprobs import token_logprobs
from posttrain.learner.lora import is_peft_model, merged_state_dict
from posttrain.learner.microbatch import minibatch_rows
from posttrain.learner.optim_step import StepOutcome, StepTally
from posttrain.learner.policy_loss import (
    Correction,
    PolicyTokenLoss,
    fused_old_logprob,
    token_diag_keys,
    update_metrics,
    update_tensors,
    zero_at_zero_advantage,
)
from posttrain.learner.policy_setup import autocast_dtype, prepare_model, resolve_policy_loss
from posttrain.learner.primitives import (
    ForwardBackwardOutput,
    ForwardContext,
    ForwardSpec,
    LossBatch,
    TokenLoss,
    UpdateOutput,
    forward_backward,
    merge_metrics,
    train_mode_if,
)
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
from posttrain.learner.shared_prompt import check_shareable
from posttrain.learner.trainer import MinibatchLoss, Trainer
from posttrain.trajectory.collate import TrajectoryBatch


class TrainsItsDriverCopy:
    """The Learner protocol's driver-copy writes for a learner whose trained weights ARE the driver copy
    :attr:`model` (:class:`PolicyLearner`; learner ranks push theirs instead, :mod:`posttrain.learner.ranks`)."""

    model: torch.nn.Module

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write ``state`` (a state dict of :attr:`model`) into :attr:`model`, the weights this learner trains."""
        self.model.load_state_dict(state)

    def mark_driver_written(self) -> None:
        """Nothing to do: a write of :attr:`model` is a write of the weights this learner trains."""


class PolicyLearner(TrainsItsDriverCopy):
    """The actor's model, optimiser and primitives (module docstring).

    Settings are typed (:mod:`posttrain.learner.settings`; the flat keyword form of
    :class:`~posttrain.learner.settings.FlatPolicyArgs` overrides their fields): ``optim`` (AdamW, schedule,
    ``max_grad_norm``), ``batching`` (epochs x mini-batches x ``microbatch_tokens``; the shuffle generator
    seeded with ``seed``), ``loss`` (registry names and keyword arguments, validated here), ``sampler`` (the
    temperature and truncation the log-probs replay), ``compute`` (autocast, gradient checkpointing — train
    mode around a gradient forward, so a model with dropout is refused — entropy chunks), ``lora`` (peft
    adapters: then :attr:`model` is the peft model). ``kl_coef``: a float or a controller with ``.value``.
    ``skip_no_signal_rows``: a row with ``A = 0`` everywhere runs without a backward when that is exact
    (:meth:`no_signal_rows_skippable`). ``grad_sync``: the data-parallel hook
    (:mod:`posttrain.learner.grad_sync`; default one process). The model is kept in eval mode (dropout
    off) so pi_theta equals pi_old before the first step.
    """

    def __init__(self, model: torch.nn.Module, *, optim: OptimizerSettings | None = None,
                 batching: BatchingSettings | None = None, loss: PolicyLossSettings | None = None,
                 sampler: SamplerReplay | None = None, compute: ComputeSettings | None = None,
                 lora: LoraSettings | None = None, kl_coef: float | KLCoefficient = 0.0,
                 grad_sync: GradientSync | None = None, **flat: Unpack[FlatPolicyArgs]) -> None:
        s = policy_settings(PolicySettings(
            optim=optim or OptimizerSettings(), batching=batching or BatchingSettings(),
            loss=loss or PolicyLossSettings(), sampler=sampler or SamplerReplay(),
            compute=compute or ComputeSettings(), lora=lora or LoraSettings()), flat)
        self.settings = s
        ls, cs = s.loss, s.compute
        self.autocast_dtype = autocast_dtype(cs.autocast_dtype)
        r = resolve_policy_loss(ls)  # names resolved once: a wrong name, key or type fails here, not mid-update
        self._policy_loss, self._reduction, self._kl, self._correction = r.policy_loss, r.reduction, r.kl, r.correction
        self.policy_loss_kwargs, self.reduction_kwargs = r.policy_loss_kwargs, r.reduction_kwargs
        self.correction_kwargs = r.correction_kwargs
        self.kl_estimator_name, self.kl_coef = ls.kl_estimator, kl_coef
        self.entropy_coef = float(ls.entropy_coef)
        self.temperature = float(s.sampler.temperature)
        self.top_k, self.top_p = int(s.sampler.top_k), float(s.sampler.top_p)  # truncated sampling, replayed
        self.microbatch_tokens = s.batching.microbatch_tokens
        self.entropy_chunk_size, self.compute_entropy = cs.entropy_chunk_size, ls.compute_entropy
        self.skip_no_signal_rows, self.mask_truncated = bool(ls.skip_no_signal_rows), bool(ls.mask_truncated)
        self._zero_at_zero_adv: bool | None = None  # probed lazily (no_signal_rows_skippable)
        self._diag_keys: list[str] | None = None
        self.gradient_checkpointing = cs.gradient_checkpointing
        model = prepare_model(model, s.lora, cs)  # LoRA adapters; checkpointing (refused with dropout)
        self.share_prompts = bool(cs.share_prompts) and check_shareable(model)
        self.model = model.eval()
        self.trainer = Trainer(list(model.parameters()), s.optim, s.batching)
        self.params = self.trainer.params
        self.grad_sync: GradientSync = grad_sync if grad_sync is not None else LocalSync()
        self.version = 0

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

    def grad_mode(self) -> contextlib.AbstractContextManager[None]:
        """Train mode around a gradient forward (and its backward) when checkpointing (transformers
        checkpoints activations only in train mode; exact without dropout, checked at construction)."""
        return train_mode_if(self.model, self.gradient_checkpointing)

    def current_kl_coef(self) -> float:
        """beta: the float ``kl_coef`` or the controller's current ``.value``."""
        return float(self.kl_coef) if isinstance(self.kl_coef, (int, float)) else float(self.kl_coef.value)

    def current_lr(self) -> float:
        """Learning rate the next optimizer step will use."""
        return self.trainer.current_lr()

    def can_fuse_old_logprob(self) -> bool:
        """True when ``update(..., fuse_old=True)`` may take pi_old from the update's own forward: exactly one
        optimiser step per update (``ppo_epochs == 1``, ``num_minibatches == 1``), no behaviour correction (its
        kept-token mask enters the counts before the forward) and one process."""
        b = self.settings.batching
        return (b.epochs == 1 and b.num_minibatches == 1 and self._correction is None
                and self.grad_sync.world_size == 1)

    # ------------------------------------------------------------------ primitives
    def compute_logprobs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """Frozen log-probs ``[B, T]`` (float64, CPU, 0 off the action mask) of ``batch`` under the current
        weights: ``log softmax(z[b, t-1] / temperature)[token[b, t]]`` over the replayed kept set, no grad,
        micro-batched by ``microbatch_tokens``. Across processes each computes its shard and a SUM of the
        zero-padded shards assembles the batch (a lockstep hook's processes each compute all of it)."""
        sync = self.grad_sync
        if sync.world_size > 1 and batch.size >= sync.world_size and not getattr(sync, "lockstep", False):
            mine = sync.shard(range(batch.size))
            lp_mine = self._frozen(batch.select_rows(mine))
            full = torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float64)
            full[mine, : lp_mine.shape[1]] = lp_mine
            return sync.reduce_sums(full)
        return self._frozen(batch)

    def _frozen(self, batch: TrajectoryBatch) -> torch.Tensor:
        dev = self.device
        with self._autocast():
            lp, _ = token_logprobs(self.model, batch.input_ids.to(dev), batch.attention_mask.to(dev),
                                   temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                   microbatch_tokens=self.microbatch_tokens, action_mask=batch.action_mask.to(dev),
                                   entropy_chunk_size=self.entropy_chunk_size)
        return lp.detach().to("cpu", torch.float64) * batch.action_mask.to(torch.float64)

    def forward_context(self) -> ForwardContext:
        """This learner's side of :func:`~posttrain.learner.primitives.forward_backward`."""
        return ForwardContext(model=self.model, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              microbatch_tokens=self.microbatch_tokens, entropy_chunk_size=self.entropy_chunk_size,
                              compute_dtype=self.compute_dtype, autocast=self._autocast, grad_mode=self.grad_mode,
                              grad_sync=self.grad_sync, params=self.params, share_prompts=self.share_prompts)

    def forward_backward(self, batch: LossBatch, loss: TokenLoss) -> ForwardBackwardOutput:
        """Forward + backward of one mini-batch with ``loss``; gradients accumulate until :meth:`optim_step`.
        Returns the forward's per-token log-probs, the loss and its metrics
        (:func:`~posttrain.learner.primitives.forward_backward`)."""
        return forward_backward(self.forward_context(), batch, loss)

    #: The driver copy's context (the Learner protocol): here :attr:`model` itself, as :meth:`forward_context`.
    driver_context = forward_context

    def forward_backward_custom(self, rows: list[int], loss: MinibatchLoss) -> ForwardBackwardOutput:
        """Forward + backward of a loss that runs its own forward (a pair loss over sequence log-probs, after
        Tinker's ``forward_backward_custom``): ``loss.backward(rows, loss.normaliser(rows))`` under
        :meth:`grad_mode`; the output has no token log-probs, and the loss's ``metrics`` when it has them."""
        with self.grad_mode():
            loss.backward(rows, loss.normaliser(rows))
        metrics = dict(getattr(loss, "metrics", {}))
        return ForwardBackwardOutput(logprob=None, loss=float(metrics.get("loss", 0.0)), metrics=metrics)

    def optim_step(self, *, ends_update: bool = True) -> StepOutcome:
        """One optimiser step over the accumulated gradients (clip to ``max_grad_norm``; a non-finite or exactly
        zero gradient is skipped; AdamW then the schedule), then the gradients are zeroed. ``ends_update``:
        :attr:`version` + 1 (the weights the engine loads next are a new policy), applied or not."""
        outcome = self.trainer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if ends_update:
            self.version += 1
        return outcome

    def minibatch_plan(self, num_rows: int) -> list[list[int]]:
        """The mini-batches of one update over rows ``0..num_rows-1``: ``epochs`` x ``num_minibatches`` parts of
        a shuffle (:func:`~posttrain.learner.microbatch.minibatch_rows`, one generator draw per epoch)."""
        b = self.settings.batching
        return [rows for _ in range(b.epochs) for rows in minibatch_rows(num_rows, b.num_minibatches, self.generator)]

    def no_signal_rows_skippable(self) -> bool:
        """True when a row with ``A = 0`` on every token adds exactly 0 to the loss and its gradient:
        ``skip_no_signal_rows`` is on, no KL term, ``entropy_coef == 0`` and the policy loss vanishes with
        its gradient at ``A = 0`` (:func:`~posttrain.learner.policy_loss.zero_at_zero_advantage`)."""
        if not self.skip_no_signal_rows or self._kl is not None or self.entropy_coef != 0.0:
            return False
        if self._zero_at_zero_adv is None:
            self._zero_at_zero_adv = zero_at_zero_advantage(self._policy_loss, self.policy_loss_kwargs)
        return self._zero_at_zero_adv

    def policy_loss(self) -> PolicyTokenLoss:
        """The policy objective of this update (beta read now) as a token loss for :meth:`forward_backward`."""
        if self._diag_keys is None:
            self._diag_keys = token_diag_keys(self._policy_loss, self.policy_loss_kwargs)
        obj = PolicyObjective(policy_loss=self._policy_loss, reduction=self._reduction,
                              policy_loss_kwargs=self.policy_loss_kwargs, reduction_kwargs=self.reduction_kwargs,
                              kl=self._kl, beta=self.current_kl_coef() if self._kl is not None else 0.0,
                              entropy_coef=self.entropy_coef)
        grad_ent = self.entropy_coef != 0.0
        spec = ForwardSpec(with_entropy=grad_ent or self.compute_entropy, entropy_grad=grad_ent)
        return PolicyTokenLoss(obj, spec, skip_no_signal=self.grad_sync.world_size == 1
                               and self.no_signal_rows_skippable(), diag_keys=self._diag_keys)

    # ------------------------------------------------------------------ the RL program
    def _prepare(self, batch: TrajectoryBatch, advantages: torch.Tensor | None, old_logprob: torch.Tensor | None,
                 fuse_old: bool) -> tuple[dict[str, torch.Tensor | None], dict[str, float]]:
        """The batch's tensors (:func:`~posttrain.learner.policy_loss.update_tensors`; pi_old recomputed if absent)."""
        return update_tensors(batch, advantages, old_logprob, frozen=None if fuse_old else self.compute_logprobs,
                              kl_estimator=self.kl_estimator_name, device=self.device, dtype=self.compute_dtype,
                              correction=Correction(self._correction, self.correction_kwargs, self.mask_truncated),
                              version=self.version)

    def compute_gradients(self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
                          old_logprob: torch.Tensor | None = None) -> tuple[float, dict[str, torch.Tensor]]:
        """Loss and gradients of the whole batch as ONE mini-batch, without an optimizer step:
        ``(L(batch), {param_name: dL/dparam})`` (copies; ``.grad`` is cleared again). Micro-batched exactly like
        :meth:`update`; the shuffle generator is not touched. Used by the split-invariance tests and
        ``posttrain check``."""
        t, _ = self._prepare(batch, advantages, old_logprob, fuse_old=False)
        loss = self.policy_loss()
        self.optimizer.zero_grad(set_to_none=True)
        rows = list(range(batch.size))
        n = loss.normaliser(t, rows)
        value = self.forward_backward(LossBatch(t, rows, n), loss).loss if n else 0.0
        grads = {n_: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for n_, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer.zero_grad(set_to_none=True)
        return value, grads

    def update(self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
               old_logprob: torch.Tensor | None = None, fuse_old: bool = False) -> UpdateOutput:
        """Train on one rollout batch (module docstring); :attr:`version` + 1.

        ``advantages`` ``[B, T]`` (or ``[B]``, broadcast) default to ``batch.advantages``; ``old_logprob`` to
        ``batch.old_logprob``, recomputed before the first step when absent (on-policy). ``fuse_old=True``
        (only when :meth:`can_fuse_old_logprob`, without ``old_logprob``): pi_old is the update's own forward,
        detached, returned as :attr:`UpdateOutput.old_logprob`. A mini-batch with no loss token is skipped
        (``empty_minibatches``); a step with a non-finite or zero gradient too (``nonfinite_steps`` /
        ``zero_grad_steps``). Metrics: :func:`~posttrain.learner.policy_loss.update_metrics`."""
        if fuse_old and (not self.can_fuse_old_logprob() or old_logprob is not None):
            raise ValueError("fuse_old needs ppo_epochs=1, num_minibatches=1, no correction, one process "
                             "and no old_logprob given")
        t, info = self._prepare(batch, advantages, old_logprob, fuse_old)
        loss = self.policy_loss()
        current = torch.full(tuple(batch.input_ids.shape), float("nan"), dtype=torch.float64)
        sums: dict[str, float] = {}
        steps, minibatches, empty = StepTally(), 0, 0
        self.optimizer.zero_grad(set_to_none=True)
        for rows in self.minibatch_plan(batch.size):
            minibatches += 1
            n = loss.normaliser(t, rows)
            if n == 0:
                empty += 1
                continue
            out = self.forward_backward(LossBatch(t, rows, n), loss)
            assert out.logprob is not None
            seen = ~torch.isnan(out.logprob)  # rewritten each epoch: the last optimiser step's forward wins
            current[seen] = out.logprob[seen]
            merge_metrics(sums, out.metrics)
            steps.record(self.optim_step(ends_update=False))
        am, old, loss_mask = batch.action_mask.to(torch.float64), None, t["loss_mask"]
        if fuse_old:
            assert loss_mask is not None
            old, kappa = fused_old_logprob(batch, current, loss_mask, device=self.device, dtype=self.compute_dtype,
                                           version=self.version)
            info.update(kappa)
        self.version += 1
        metrics = update_metrics(sums, steps, trained=minibatches - empty, empty=empty,
                                 lr=steps.lr if steps.lr is not None else self.current_lr(),
                                 kl_coef=self.current_kl_coef(), version=self.version)
        return UpdateOutput({**metrics, **info}, old_logprob=old,
                            current_logprob=torch.where(am > 0, current, torch.zeros_like(current)))

    # ------------------------------------------------------------------ weights and state
    def close(self) -> None:
        """Nothing to release: the learner lives in this process (learner ranks stop their processes here)."""

    def weights_for_rollout(self) -> Mapping[str, torch.Tensor]:
        """Weights for the rollout engine under the plain model's parameter names, paired with :attr:`version`:
        without LoRA ``model.state_dict()`` itself (live tensors: the engine copies them before the next
        update); with LoRA new tensors ``W + (alpha / r) B A`` for adapted layers, live tensors elsewhere."""
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


__all__ = ["PolicyLearner", "TrainsItsDriverCopy", "UpdateOutput"]
