"""The critic: a value head on a transformer backbone, and its clipped value-loss learner.

Alignment (the same as the log-probs and as ``ADVANTAGES['gae']`` expects): ``values[b, t] =
V(s_t)``, the value of the state *before* token ``t`` (the prefix ``tokens_<t``), computed as
``head(h[b, t-1])`` from the backbone's last hidden state at ``t - 1``. Position 0 and padding
hold 0. ``final_values[b] = head(h[b, L_b - 1])`` is the value of the state after the row's last
token: the bootstrap of a truncated row.

Two layouts (``shared_backbone``):
- ``False`` (default, PPO as in Ouyang et al. 2022, arXiv:2203.02155): the critic owns a deep
  copy of the actor's backbone and trains it with the head.
- ``True``: the critic reads the actor's backbone under ``no_grad`` and trains only the head
  (no value gradient reaches the actor; one backbone in memory, but an extra forward).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Unpack

import safetensors.torch
import torch

from posttrain.algos.registry import REDUCTIONS
from posttrain.algos.value import value_loss
from posttrain.learner.checkpoint import load_pretrained_weights
from posttrain.learner.lora import is_peft_model
from posttrain.learner.microbatch import microbatches
from posttrain.learner.settings import (
    BatchingSettings,
    FlatCriticArgs,
    OptimizerSettings,
    RegistryKwargs,
    critic_settings,
)
from posttrain.learner.trainer import Trainer
from posttrain.trajectory.collate import TrajectoryBatch

HEAD_FILE = "value_head.safetensors"
META_FILE = "value_model.json"


class ValueModel(torch.nn.Module):
    """``backbone`` (a ``transformers`` base model returning ``last_hidden_state``) + linear head.

    Build it with :meth:`from_actor`. ``forward(input_ids, attention_mask)`` returns
    ``(values [B, T], final_values [B])`` aligned as the module docstring says.
    """

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, *, shared_backbone: bool, seed: int = 0):
        super().__init__()
        self.shared_backbone = shared_backbone
        if shared_backbone:
            # Not registered as a submodule: the actor owns (and saves, and optimizes) it.
            object.__setattr__(self, "_shared", backbone)
        else:
            self.backbone = backbone
        dtype = next(backbone.parameters()).dtype
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
            # Small init: V starts near 0, the head learns the reward scale (OpenRLHF-style).
            torch.nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(hidden_size + 1))
            torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def from_actor(cls, lm: torch.nn.Module, *, shared_backbone: bool = False, seed: int = 0) -> ValueModel:
        """Critic over ``lm``'s backbone (``lm.base_model``): a copy, or the actor's own (shared)."""
        if is_peft_model(lm):
            raise ValueError("build the critic from the plain actor model, not its peft (LoRA) wrapper")
        base = getattr(lm, "base_model", None)
        if base is None or base is lm:
            raise ValueError(
                f"{type(lm).__name__} has no separate base_model backbone to put a value head on"
            )
        hidden = int(lm.config.hidden_size)  # type: ignore[union-attr,arg-type]
        backbone = base if shared_backbone else copy.deepcopy(base)
        return cls(backbone, hidden, shared_backbone=shared_backbone, seed=seed).train(False)

    @property
    def body(self) -> torch.nn.Module:
        """The backbone (owned copy or the actor's shared one)."""
        body = self._shared if self.shared_backbone else self.backbone
        assert isinstance(body, torch.nn.Module)
        return body

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``values [B, T]`` with ``values[:, t] = head(h[:, t-1])`` (0 at t=0 and on padding)
        and ``final_values [B] = head(h[b, L_b - 1])``."""
        ctx = torch.no_grad() if self.shared_backbone else contextlib.nullcontext()
        with ctx:
            h = self.body(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state
        v = self.head(h).squeeze(-1)  # v[:, t] = V(tokens_<=t) = V(s_{t+1})
        B = v.shape[0]
        mask = attention_mask[:, 1:].to(v.dtype)
        values = torch.cat([v.new_zeros(B, 1), v[:, :-1] * mask], dim=1)
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        final_values = v.gather(1, last[:, None]).squeeze(1)
        return values, final_values

    def save(self, directory: str | Path) -> None:
        """Write the head as safetensors and, unless shared, the backbone via ``save_pretrained``
        (loadable with ``AutoModel.from_pretrained(directory / 'backbone')``)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in self.head.state_dict().items()}, d / HEAD_FILE
        )
        if not self.shared_backbone:
            self.backbone.save_pretrained(d / "backbone")  # type: ignore[operator]
        (d / META_FILE).write_text(json.dumps({"shared_backbone": self.shared_backbone}))

    def load(self, directory: str | Path) -> None:
        """Load weights written by :meth:`save` into this (identically built) value model."""
        d = Path(directory)
        meta = json.loads((d / META_FILE).read_text())
        if bool(meta["shared_backbone"]) != self.shared_backbone:
            raise ValueError(
                f"{d}: critic saved with shared_backbone={meta['shared_backbone']}, this one differs"
            )
        self.head.load_state_dict(safetensors.torch.load_file(d / HEAD_FILE))
        if not self.shared_backbone:
            load_pretrained_weights(self.backbone, d / "backbone")


class CriticLearner:
    """Value-function regression with PPO's clipped value loss (``posttrain.algos.value``).

    Loss of a mini-batch ``M``: ``sum_{b,t} w[b,t] * value_loss(V, V_old, R, clip_eps)[b,t]`` with
    ``w = REDUCTIONS[reduction]`` over the loss mask using mini-batch counts (split-invariant, as in
    the policy learner). Trained by its own :class:`~posttrain.learner.trainer.Trainer` (AdamW +
    schedule from ``optim``; ``batching.epochs`` x ``batching.num_minibatches`` steps per update).
    The flat keyword arguments of :class:`~posttrain.learner.settings.FlatCriticArgs` (``lr=``,
    ``epochs=`` ...) override fields of ``optim`` / ``batching``; ``optim`` defaults to lr 1e-5.
    """

    def __init__(
        self,
        value_model: ValueModel,
        *,
        optim: OptimizerSettings | None = None,
        batching: BatchingSettings | None = None,
        clip_eps: float | None = None,
        reduction: str = "token_mean",
        reduction_kwargs: RegistryKwargs | None = None,
        **flat: Unpack[FlatCriticArgs],
    ) -> None:
        optim, batching = critic_settings(optim or OptimizerSettings(lr=1e-5), batching or BatchingSettings(), flat)
        self.model = value_model
        self._reduction = REDUCTIONS[reduction]
        self.reduction_kwargs = REDUCTIONS.validate_kwargs(reduction, dict(reduction_kwargs or {}), key="reduction_kwargs")
        self.clip_eps = clip_eps
        self.trainer = Trainer(list(value_model.parameters()), optim, batching)

    @property
    def device(self) -> torch.device:
        """Device of the value head."""
        return self.model.head.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 for a float64 critic, else float32."""
        return torch.float64 if self.model.head.weight.dtype == torch.float64 else torch.float32

    @torch.no_grad()
    def compute_values(self, batch: TrajectoryBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen ``(values [B, T], final_values [B])`` float64 on CPU; values 0 off the action mask.

        Feed ``values`` (and ``final_values`` as the truncated rows' bootstrap) to GAE, and pass
        ``values`` again as ``old_values`` to :meth:`update` for value clipping.
        """
        dev = self.device
        ids, am = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        values = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
        final = torch.zeros(batch.size, dtype=torch.float64)
        tensors = {"input_ids": ids, "attention_mask": am}
        for mb in microbatches(tensors, range(batch.size), self.trainer.microbatch_tokens):
            v, f = self.model(mb["input_ids"], mb["attention_mask"])
            idx = mb.row_index
            values[idx, : v.shape[1]] = v.to("cpu", torch.float64)
            final[idx] = f.to("cpu", torch.float64)
        return values * batch.action_mask.to(torch.float64), final

    def update(
        self,
        batch: TrajectoryBatch,
        returns: torch.Tensor | None = None,
        *,
        old_values: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Regress ``values`` onto ``returns [B, T]`` on action tokens (times ``loss_mask`` if given).

        ``returns`` defaults to ``batch.returns`` and ``old_values`` (needed when ``clip_eps`` is
        set) to ``batch.values`` — the targets and frozen values the loop attached to the batch
        (``batch.with_targets``) — and, when the batch has none, to :meth:`compute_values` now.
        Metrics: ``value_loss`` (mean over steps), ``value_clip_frac``, ``value_error_abs`` (token
        mean |V - R|), ``explained_variance`` = 1 - Var(R - V_old) / Var(R) on the loss tokens,
        ``grad_norm`` / ``grad_norm_max``, ``lr``, ``optimizer_steps``, and — from the optimiser
        step shared with the actor (:mod:`posttrain.learner.optim_step`) — ``nonfinite_steps``
        (NaN/inf gradient: dropped, no step) and ``zero_grad_steps`` (exactly zero: no step, so AdamW
        momentum and decay do not move a critic that got no signal).
        """
        B, T = batch.input_ids.shape
        if returns is None:
            returns = batch.returns
        if returns is None:
            raise ValueError("no returns: pass them or attach them with batch.with_targets(returns=...)")
        if tuple(returns.shape) != (B, T):
            raise ValueError(f"returns have shape {tuple(returns.shape)}, batch is {(B, T)}")
        if old_values is None:
            old_values = batch.values if batch.values is not None else self.compute_values(batch)[0]
        dev, dt = self.device, self.compute_dtype
        mask = batch.action_mask.to(dev, dt)
        if loss_mask is not None:
            mask = mask * loss_mask.to(dev, dt)
        regression = _ValueRegression(self, {
            "input_ids": batch.input_ids.to(dev),
            "attention_mask": batch.attention_mask.to(dev),
            "returns": returns.to(dev, dt) * mask,
            "old_values": old_values.to(dev, dt) * mask,
            "mask": mask,
        })
        on = mask > 0
        r_on, v_on = regression.tensors["returns"][on], regression.tensors["old_values"][on]
        var_r = float(r_on.var()) if r_on.numel() > 1 else 0.0
        ev = 1.0 - float((r_on - v_on).var()) / var_r if var_r > 0 else 0.0
        tally = self.trainer.train(B, regression)
        tokens = max(1.0, regression.tokens)
        return {
            "value_loss": regression.loss_sum / max(1, tally.trained),
            "value_clip_frac": regression.clip_sum / tokens,
            "value_error_abs": regression.err_sum / tokens,
            "explained_variance": ev,
            **tally.steps.metrics(),
            "lr": tally.steps.lr if tally.steps.lr is not None else self.trainer.current_lr(),
        }

    def save(self, directory: str | Path) -> None:
        """Write the value model's weights (:meth:`ValueModel.save`); lets ``save_checkpoint``
        take the learner itself as ``critic=``."""
        self.model.save(directory)

    def load(self, directory: str | Path) -> None:
        """Load weights written by :meth:`save` (``CheckpointState.critic_dir``)."""
        self.model.load(directory)

    def state_dict(self) -> dict[str, object]:
        """The trainer's state: optimizer, scheduler, shuffle generator, step counter (weights: :meth:`save`)."""
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.trainer.load_state_dict(state, owner="critic learner")


class _ValueRegression:
    """The critic's :class:`~posttrain.learner.trainer.MinibatchLoss` over one update's device tensors
    (``input_ids``, ``attention_mask``, ``returns``, ``old_values``, ``mask``), with its metric sums."""

    def __init__(self, critic: CriticLearner, tensors: dict[str, torch.Tensor]) -> None:
        self.critic, self.tensors = critic, tensors
        self.loss_sum = self.clip_sum = self.err_sum = self.tokens = 0.0

    def normaliser(self, rows: Sequence[int]) -> float:
        """Loss tokens of the mini-batch."""
        return float(self.tensors["mask"][list(rows)].sum())

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """Clipped value loss of each micro-batch, reduced with the mini-batch counts; backward."""
        c = self.critic
        for mb in microbatches(self.tensors, rows, c.trainer.microbatch_tokens):
            v, _ = c.model(mb["input_ids"], mb["attention_mask"])
            v = v.to(c.compute_dtype)
            per_tok, diag = value_loss(v, mb["old_values"], mb["returns"], mb["mask"], c.clip_eps)
            w = c._reduction(mb["mask"], num_sequences=len(rows), num_tokens=normaliser, **c.reduction_kwargs)
            loss = (per_tok * w).sum()
            loss.backward()
            self.loss_sum += float(loss.detach())
            self.clip_sum += float((diag["clipped"] * mb["mask"]).sum())
            self.err_sum += float((diag["value_error"].abs() * mb["mask"]).sum())
            self.tokens += float(mb["mask"].sum())
