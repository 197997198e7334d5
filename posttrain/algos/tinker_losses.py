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
    """``-(exp(lp - q) * A).sum()``."""
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    """``-min(ratio * A, clip(ratio, lo, hi) * A).sum()`` (PPO's clipped surrogate, token-wise)."""
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
