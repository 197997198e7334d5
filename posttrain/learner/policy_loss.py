"""The policy objective (:mod:`posttrain.algos.policy_objective`) as a loss the learner's
:func:`~posttrain.learner.primitives.forward_backward` runs: the batch's tensors on the device
(:func:`policy_tensors`), and :class:`PolicyTokenLoss`, which hands each micro-batch's log-probs to the
pure objective and reports its metric sums."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from posttrain.algos.policy_losses import PolicyLossInputs
from posttrain.algos.policy_objective import (
    PolicyObjective,
    PolicyObjectiveInputs,
    PolicyObjectiveOutput,
    logkappa_metrics,
    loss_mask,
    policy_objective,
)
from posttrain.learner.microbatch import Microbatch
from posttrain.learner.optim_step import StepTally
from posttrain.learner.primitives import ForwardSpec, LossBatch, LossTerms
from posttrain.trajectory.collate import TrajectoryBatch
from posttrain.trajectory.enums import Finish

#: The metric sums of :class:`PolicyTokenLoss` (besides ``diag/<k>``, the policy loss's token diagnostics).
POLICY_SUMS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "tokens", "kl_sum", "entropy_sum", "ratio_sum")


@dataclasses.dataclass(frozen=True)
class Correction:
    """A behaviour correction (a ``CORRECTIONS`` function and its validated kwargs) and DAPO's overlong
    filtering (``mask_truncated``), as :func:`policy_tensors` applies them."""

    fn: Callable[..., Any] | None = None
    kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    mask_truncated: bool = False


def check_advantages(batch: TrajectoryBatch, advantages: torch.Tensor | None) -> torch.Tensor:
    """``advantages`` (default ``batch.advantages``) as ``[B, T]`` (a ``[B]`` one broadcast over its row's
    tokens), finite on every action token; ``ValueError`` naming the shape otherwise."""
    B, T = batch.input_ids.shape
    adv = batch.advantages if advantages is None else advantages
    if adv is None:
        raise ValueError("no advantages: pass them or attach them with batch.with_targets(advantages=...)")
    if adv.dim() == 1:
        if adv.shape[0] != B:
            raise ValueError(f"advantages have shape {tuple(adv.shape)}, batch has {B} rows")
        adv = adv[:, None].expand(B, T)  # a sequence-level advantage per token
    if tuple(adv.shape) != (B, T):
        raise ValueError(f"advantages have shape {tuple(adv.shape)}, batch is {(B, T)}")
    if not torch.isfinite(adv[batch.action_mask > 0]).all():
        raise ValueError("advantages are not finite on some action token")
    return adv


def policy_tensors(batch: TrajectoryBatch, advantages: torch.Tensor, old_logprob: torch.Tensor | None, *,
                   device: torch.device, dtype: torch.dtype, correction: Correction,
                   version: int) -> tuple[dict[str, torch.Tensor | None], dict[str, float]]:
    """The update's ``[B, T]`` tensors on ``device`` in ``dtype`` (0 off the action mask) and the metrics
    of preparing them: ``loss_mask`` / ``correction_weight`` (:func:`~posttrain.algos.policy_objective.loss_mask`),
    ``old_logprob`` (None: fused, each forward's own), log-kappa (:func:`logkappa_metrics`, when pi_old is known)."""
    am = batch.action_mask.to(device, dtype)
    t: dict[str, torch.Tensor | None] = {
        "input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device),
        "old_logprob": old_logprob.to(device, dtype) * am if old_logprob is not None else None,
        "behavior_logprob": batch.behavior_logprob.to(device, dtype) * am,
        "ref_logprob": batch.ref_logprob.to(device, dtype) * am if batch.ref_logprob is not None else None,
        "advantages": advantages.to(device, dtype) * am,
    }
    cut = (torch.tensor([tr.finish is Finish.TRUNCATED for tr in batch.trajectories], device=device)
           if correction.mask_truncated else None)
    lm = loss_mask(am, t["behavior_logprob"], t["old_logprob"], correction=correction.fn,  # type: ignore[arg-type]
                   correction_kwargs=correction.kwargs, behavior_version=batch.behavior_version.to(device),
                   current_version=version, truncated=cut)
    t.update(loss_mask=lm.mask, action_mask=am, correction_weight=lm.weight)  # action_mask: where log-probs go
    info = dict(lm.info)
    if t["old_logprob"] is not None:
        info.update(logkappa_metrics(t["behavior_logprob"], t["old_logprob"], am,  # type: ignore[arg-type]
                                     batch.behavior_version.to(device), version))
    return t, info


def update_tensors(batch: TrajectoryBatch, advantages: torch.Tensor | None, old_logprob: torch.Tensor | None, *,
                   frozen: Callable[[TrajectoryBatch], torch.Tensor] | None, kl_estimator: str | None,
                   device: torch.device, dtype: torch.dtype, correction: Correction,
                   version: int) -> tuple[dict[str, torch.Tensor | None], dict[str, float]]:
    """The RL update's :func:`policy_tensors` after checking its inputs: advantages by :func:`check_advantages`;
    pi_old is ``old_logprob``, else ``batch.old_logprob``, else ``frozen(batch)`` (recomputed now, on-policy),
    or None when ``frozen`` is None (fused: each forward's own); its shape must be the batch's; a KL term
    (``kl_estimator`` not None) needs the batch's frozen ``ref_logprob``. ``ValueError`` naming what is wrong."""
    adv = check_advantages(batch, advantages)
    if old_logprob is None and frozen is not None:
        old_logprob = batch.old_logprob if batch.old_logprob is not None else frozen(batch)
    shape = tuple(batch.input_ids.shape)
    if old_logprob is not None and tuple(old_logprob.shape) != shape:
        raise ValueError(f"old_logprob has shape {tuple(old_logprob.shape)}, batch is {shape}")
    if kl_estimator is not None and batch.ref_logprob is None:
        raise ValueError(f"kl_estimator={kl_estimator!r} needs ref_logprob: freeze it with "
                         "batch.freeze('ref', ...) before the update")
    return policy_tensors(batch, adv, old_logprob, device=device, dtype=dtype, correction=correction,
                          version=version)


def fused_old_logprob(batch: TrajectoryBatch, current: torch.Tensor, loss_mask: torch.Tensor, *,
                      device: torch.device, dtype: torch.dtype, version: int) -> tuple[torch.Tensor, dict[str, float]]:
    """pi_old of a fused update: the update's own forward ``current`` ``[B, T]`` (NaN where no forward ran,
    taken as 0), times the loss mask and the action mask (float64, CPU); and its log-kappa metrics against the
    behaviour log-probs mu (:func:`~posttrain.algos.policy_objective.logkappa_metrics`, in ``dtype`` on
    ``device``)."""
    am = batch.action_mask.to(torch.float64)
    old = torch.where(torch.isnan(current), 0.0, current) * loss_mask.to("cpu", torch.float64) * am
    m = batch.action_mask.to(device, dtype)
    return old, logkappa_metrics(batch.behavior_logprob.to(device, dtype) * m, old.to(device, dtype), m,
                                 batch.behavior_version.to(device), version)


class PolicyTokenLoss:
    """The :class:`~posttrain.learner.primitives.TokenLoss` of the RL update: ``objective`` over each
    micro-batch (its ``mb[...]`` tensors from :func:`policy_tensors`). Without ``old_logprob`` (fused) pi_old
    is the forward's own detached log-probs. ``skip_no_signal``: rows whose advantage is 0 everywhere run
    without a backward (:func:`zero_at_zero_advantage` holds for the objective). ``diag_keys``: the policy
    loss's per-token diagnostics (:func:`token_diag_keys`), reported as ``diag/<k>`` token sums."""

    def __init__(self, objective: PolicyObjective, spec: ForwardSpec, *, skip_no_signal: bool,
                 diag_keys: Sequence[str]) -> None:
        self.objective, self.spec = objective, spec
        self.skip_no_signal, self.diag_keys = skip_no_signal, sorted(diag_keys)

    def normaliser(self, batch: Mapping[str, torch.Tensor | None], rows: Sequence[int]) -> float:
        """Loss tokens of mini-batch ``rows`` (the loss mask: action tokens the correction kept)."""
        mask = batch["loss_mask"]
        assert mask is not None
        return float(mask[list(rows)].sum())

    def metric_keys(self) -> tuple[list[str], list[str], list[str]]:
        """``POLICY_SUMS`` and ``diag/<k>``; ``ratio`` min and max."""
        return [*POLICY_SUMS, *(f"diag/{k}" for k in self.diag_keys)], ["ratio"], ["ratio"]

    def rows_without_gradient(self, batch: LossBatch, rows: Sequence[int]) -> list[int]:
        """Rows whose advantage is 0 on every token, when ``skip_no_signal``."""
        if not self.skip_no_signal or not rows:
            return []
        adv = batch.tensors["advantages"]
        assert adv is not None
        signal = (adv[list(rows)] != 0).any(dim=1).tolist()
        return [r for r, s in zip(rows, signal, strict=True) if not s]

    def __call__(self, logprob: torch.Tensor, entropy: torch.Tensor | None, mb: Microbatch,
                 batch: LossBatch) -> LossTerms:
        """The objective of ``mb`` and its metric sums (token sums over the loss mask)."""
        mask = mb["loss_mask"]
        old = mb.optional("old_logprob")
        if old is None:  # fused: this forward runs under pi_old's weights
            old = logprob.detach() * mask
        out = policy_objective(PolicyObjectiveInputs(
            logprob=logprob, old_logprob=old, behavior_logprob=mb["behavior_logprob"], advantages=mb["advantages"],
            loss_mask=mask, correction_weight=mb["correction_weight"], num_sequences=batch.num_sequences,
            num_tokens=batch.num_tokens, ref_logprob=mb.optional("ref_logprob"), entropy=entropy), self.objective)
        return _terms(out, logprob, old, mask)


def _terms(out: PolicyObjectiveOutput, logprob: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> LossTerms:
    with torch.no_grad():
        sums = {"loss": float(out.loss.detach()), "pg_loss": float(out.pg.detach()), "tokens": float(mask.sum()),
                "kl_loss": float(out.kl.detach()) if out.kl is not None else 0.0,
                "entropy_loss": float(out.entropy.detach()) if out.entropy is not None else 0.0,
                "kl_sum": float(out.kl_token.detach().sum()) if out.kl_token is not None else 0.0,
                "entropy_sum": float(out.entropy_token.detach().sum()) if out.entropy_token is not None else 0.0}
        on = mask > 0
        ratio = torch.exp(logprob.detach() - old)
        sums["ratio_sum"] = float((ratio * mask).sum()) if on.any() else 0.0
        mins, maxs = ({"ratio": float(ratio[on].min())}, {"ratio": float(ratio[on].max())}) if on.any() else ({}, {})
        for k, v in out.diagnostics.items():
            v = torch.as_tensor(v).detach()
            if v.shape == mask.shape:
                sums[f"diag/{k}"] = float((v.to(mask.dtype) * mask).sum())
    return LossTerms(loss=out.loss, sums=sums, mins=mins, maxs=maxs)


def update_metrics(sums: Mapping[str, float], steps: StepTally, *, trained: int, empty: int, lr: float,
                   kl_coef: float, version: int) -> dict[str, float]:
    """The RL update's metrics from its summed :class:`PolicyTokenLoss` metrics (``sums``) and optimiser steps.

    ``loss`` / ``pg_loss`` / ``kl_loss`` / ``entropy_loss``: means over the ``trained`` mini-batches of the
    reduced terms; ``kl`` / ``entropy`` / ``ratio_mean``: token means over the loss tokens of all epochs;
    ``ratio_min`` / ``ratio_max`` (1 without a token); ``pg/<k>`` the policy loss's token diagnostics
    (``clip_frac_low`` / ``clip_frac_high`` from its ``clipped_low`` / ``clipped_high``); ``grad_norm``
    (mean, before clipping), ``grad_norm_max``, ``optimizer_steps``, ``nonfinite_steps``, ``zero_grad_steps``
    (:meth:`StepTally.metrics`); ``lr``; ``tokens_trained`` (loss tokens x epochs); ``empty_minibatches``;
    ``no_signal_rows``; ``kl_coef``; ``version`` (after the update)."""
    n_mb = max(1, trained)
    tokens = sums.get("tokens", 0.0)
    n_tok = max(1.0, tokens)
    m: dict[str, float] = {
        **{k: sums.get(k, 0.0) / n_mb for k in ("loss", "pg_loss", "kl_loss", "entropy_loss")},
        "kl": sums.get("kl_sum", 0.0) / n_tok, "entropy": sums.get("entropy_sum", 0.0) / n_tok,
        "ratio_mean": sums.get("ratio_sum", 0.0) / n_tok if tokens else 1.0,
        "ratio_min": sums.get("min/ratio", 1.0) if tokens else 1.0,
        "ratio_max": sums.get("max/ratio", 1.0) if tokens else 1.0,
        **steps.metrics(), "lr": lr, "tokens_trained": tokens, "empty_minibatches": float(empty),
        "no_signal_rows": sums.get("no_signal_rows", 0.0), "kl_coef": kl_coef, "version": float(version),
    }
    for k, v in sums.items():
        if k.startswith("diag/"):
            m[f"pg/{k[len('diag/'):]}"] = v / n_tok
    m["clip_frac_low"] = m.get("pg/clipped_low", 0.0)
    m["clip_frac_high"] = m.get("pg/clipped_high", 0.0)
    return m


def zero_at_zero_advantage(policy_loss: Callable[..., Any], kwargs: Mapping[str, object]) -> bool:
    """True when ``policy_loss`` is exactly 0 with a zero gradient at ``A = 0`` (probed on random log-probs,
    ratios far inside and outside any clip range, with and without a behaviour log-prob gap)."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 8)
    lp = (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0).requires_grad_(True)
    old = lp.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 2.0
    beh = old + torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) > 0.2).to(torch.float64)
    mask[:, 0] = 1.0
    try:
        out = policy_loss(PolicyLossInputs(logprob=lp, old_logprob=old, advantages=torch.zeros(shape, dtype=torch.float64),
                                           action_mask=mask, behavior_logprob=beh), **kwargs)
        loss = torch.as_tensor(out.loss)
        (grad,) = torch.autograd.grad(loss.sum(), lp, allow_unused=True)
        return bool((loss == 0).all()) and (grad is None or bool((grad == 0).all()))
    except Exception:  # noqa: BLE001 - a loss that cannot be probed this way is simply not skipped
        return False


def token_diag_keys(policy_loss: Callable[..., Any], kwargs: Mapping[str, object]) -> list[str]:
    """Names of ``policy_loss``'s per-token diagnostics (probed on a 1x1 input): the keys every process
    must reduce, whether or not it ran a row."""
    z = torch.zeros(1, 1, dtype=torch.float64)
    out = policy_loss(PolicyLossInputs(logprob=z, old_logprob=z, advantages=z + 1.0, action_mask=z + 1.0,
                                       behavior_logprob=z), **kwargs)
    return sorted(k for k, v in out.diagnostics.items() if torch.as_tensor(v).shape == z.shape)


__all__ = ["POLICY_SUMS", "Correction", "PolicyTokenLoss", "check_advantages", "fused_old_logprob", "policy_tensors",
           "token_diag_keys", "update_metrics", "update_tensors", "zero_at_zero_advantage"]
