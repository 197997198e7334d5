"""The Tinker API's built-in losses, per datum, as the Tinker documentation defines them
(https://tinker-docs.thinkingmachines.ai/losses); pure functions over tensors beside posttrain's other losses,
which ``posttrain serve --tinker`` computes. Every loss is a **sum** over the datum's tokens
(not a mean), and the batch loss is the sum over data, so a caller that wants a mean puts it in
``weights`` / ``advantages``.

With ``lp = log p_theta(target_tokens)`` (the learner's log-probs, one per position) and, for the
policy-gradient losses, ``q = logprobs`` (the sampler's) and ``A = advantages``,
``ratio = exp(lp - q)``:

- ``cross_entropy``: ``-(weights * lp).sum()`` (``weights`` default to 1);
- ``importance_sampling``: ``-(ratio * A).sum()`` (REINFORCE, Williams 1992, with a per-token
  importance weight);
- ``ppo``: ``-min(ratio * A, clip(ratio, lo, hi) * A).sum()`` (Schulman et al. 2017,
  arXiv:1707.06347), ``lo, hi`` = ``clip_low_threshold``, ``clip_high_threshold`` (0.8, 1.2);
- ``cispo``: ``-(sg(clip(ratio, lo, hi)) * lp * A).sum()`` (MiniMax-M1, arXiv:2506.13585), same
  defaults.

Which distributions: ``lp`` is always ``log softmax(z)`` of the trained model at temperature 1 over the
whole vocabulary (``forward`` and ``compute_logprobs`` return the same). ``q`` is whatever the caller
sends; ``posttrain serve``'s ``sample`` returns the log-probs of the distribution each token was drawn
from, ``log softmax(z / T)`` renormalised over the top-k / top-p kept set. At ``T = 1`` without
truncation the two agree on-policy (``ratio = 1`` up to rounding); at ``T != 1`` or with truncation they
do not, and ``ratio != 1`` even before any update: these losses then weight by ``pi_theta(T=1) / mu(T)``.
To train on-policy at another temperature, send ``compute_logprobs``' values (``T = 1``) as ``logprobs``.

Unknown losses (``dro``, ``gspo``, ``stable_reinforce``, ``custom`` server-side), unknown config keys
and missing or unknown inputs are :class:`~posttrain.errors.UserError` s: never an approximation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from posttrain.errors import UserError

_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A loss: its required and optional ``loss_fn_inputs`` (besides ``target_tokens``), its config
    keys with defaults, and ``fn(lp [N], inputs, config) -> scalar loss``."""

    required: frozenset[str]
    optional: frozenset[str]
    config: Mapping[str, float]
    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


def cross_entropy(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    """``-(weights * lp).sum()``; ``weights`` default to ones."""
    w = inputs.get("weights")
    return -(lp if w is None else w * lp).sum()


def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def importance_sampling(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    """``-(exp(lp - q) * A).sum()``: ``lp`` the learner's log-probs at temperature 1, ``q`` the sampler's of
    the distribution it drew from (temperature / truncation applied: see the module doc; ratio != 1
    on-policy when ``T != 1``)."""
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    """``-min(ratio * A, clip(ratio, lo, hi) * A).sum()`` (PPO's clipped surrogate, token-wise), ``ratio =
    exp(lp - q)`` with ``lp`` at temperature 1 and ``q`` the sampler's (temperature / truncation applied: at
    ``T != 1`` the ratio starts away from 1 and the clip acts from the first step; see the module doc)."""
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def cispo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    """``-(sg(clip(ratio, lo, hi)) * lp * A).sum()`` (CISPO: the clipped ratio is a stopped weight)."""
    w = _ratio(lp, inputs).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(w * lp * inputs["advantages"]).sum()


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(frozenset(), frozenset({"weights"}), {}, cross_entropy),
    "importance_sampling": LossSpec(frozenset({"logprobs", "advantages"}), frozenset(), {}, importance_sampling),
    "ppo": LossSpec(frozenset({"logprobs", "advantages"}), frozenset(), _CLIP_DEFAULTS, ppo),
    "cispo": LossSpec(frozenset({"logprobs", "advantages"}), frozenset(), _CLIP_DEFAULTS, cispo),
}
"""The Tinker losses by the SDK's ``loss_fn`` name (what ``posttrain serve --tinker`` computes)."""


def resolve_loss(name: str, config: Mapping[str, float | str]) -> tuple[LossSpec, dict[str, float]]:
    """The loss ``name`` and its full config (defaults filled); ``UserError`` for an unknown loss or key."""
    spec = LOSSES.get(name)
    if spec is None:
        raise UserError(f"loss_fn {name!r} is not implemented by posttrain serve (implemented: {sorted(LOSSES)})")
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        raise UserError(f"loss_fn {name!r}: unknown loss_fn_config keys {unknown} (accepted: {sorted(spec.config)})")
    full = dict(spec.config)
    for k, v in config.items():
        if isinstance(v, str):
            raise UserError(f"loss_fn {name!r}: loss_fn_config[{k!r}] must be a number, got {v!r}")
        full[k] = float(v)
    return spec, full


def datum_loss(spec: LossSpec, name: str, lp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
               config: Mapping[str, float], index: int) -> torch.Tensor:
    """The loss of datum ``index``: checks that its inputs are exactly those ``spec`` takes, each of ``lp``'s length."""
    given = set(inputs) - {"target_tokens"}
    missing = sorted(spec.required - given)
    unknown = sorted(given - spec.required - spec.optional)
    if missing or unknown:
        raise UserError(f"datum {index}: loss_fn {name!r} needs loss_fn_inputs {sorted(spec.required | {'target_tokens'})}"
                        f" (optional {sorted(spec.optional)}); missing {missing}, not accepted {unknown}")
    for k, t in inputs.items():
        if t.shape != lp.shape:
            raise UserError(f"datum {index}: loss_fn_inputs[{k!r}] has shape {list(t.shape)}, "
                            f"the model input has {lp.shape[0]} tokens")
    return spec.fn(lp, inputs, config)
