"""AdamW and the learning-rate schedule (warmup, then constant / linear / cosine decay).

Every learner (policy, critic, SFT) gets its optimizer from here through the
:class:`~posttrain.learner.trainer.Trainer`, so all read the same settings the same way. One
scheduler step per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(
    schedule: str, *, warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """``f(s)``: the factor applied to the base lr for optimizer step ``s = 0, 1, ...``.

    Warmup (Goyal et al. 2017, arXiv:1706.02677): ``f(s) = (s + 1) / warmup_steps`` for
    ``s < warmup_steps`` (the first step already moves, the last warmup step reaches 1).
    Afterwards, with ``p = clamp((s - warmup) / max(1, total - warmup), 0, 1)`` and
    ``m = min_lr_ratio``: ``constant`` -> 1; ``linear`` -> ``1 - (1 - m) p``;
    ``cosine`` (Loshchilov & Hutter 2017, arXiv:1608.03983) -> ``m + (1 - m)(1 + cos(pi p)) / 2``.
    ``linear`` and ``cosine`` need ``total_steps``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule != "constant" and (total_steps is None or total_steps < 1):
        raise ValueError(f"lr schedule {schedule!r} needs total_steps >= 1, got {total_steps}")

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        assert total_steps is not None  # checked above
        p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
        if schedule == "linear":
            return 1.0 - (1.0 - min_lr_ratio) * p
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return f


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101) over the trainable ``params``."""
    plist = [p for p in params if p.requires_grad]
    if not plist:
        raise ValueError("no trainable parameters (every parameter has requires_grad=False)")
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    return torch.optim.AdamW(plist, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str = "constant",
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_multiplier`; call ``.step()`` after each optimizer step."""
    f = lr_multiplier(schedule, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def load_schedule_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: Mapping[str, object]) -> None:
    """``scheduler.load_state_dict(state)`` (its step count), then the rate of the restored step from the
    schedule this scheduler was built with, not the one saved with the optimizer.

    Contract: call after the optimizer's ``load_state_dict``. Each group's ``lr`` becomes ``base * f(step)``
    with this scheduler's own base rates and :func:`lr_multiplier` ``f``; with the recipe the checkpoint
    was written by this is the saved rate again, bit for bit (``LambdaLR.step`` computes the same product).
    A resume forced through a changed ``steps`` (the horizon) or ``optim.lr`` thus follows the new schedule
    from its first resumed step; without this the first step took the saved rate and a changed ``optim.lr``
    never took effect (the base rates were the saved ones).
    """
    bases = list(scheduler.base_lrs)  # the recipe's rates (the optimizer was built with them)
    scheduler.load_state_dict(dict(state))
    scheduler.base_lrs = bases
    step = scheduler.last_epoch
    for group, base, f in zip(scheduler.optimizer.param_groups, bases, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * f(step)
    scheduler._last_lr = [float(g["lr"]) for g in scheduler.optimizer.param_groups]  # what get_last_lr() reports


@contextmanager
def recipe_hyperparameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around loading ``optimizer``'s saved state: afterwards its groups hold the hyper-parameters it was
    built with (``betas``, ``eps``, ``weight_decay``, ...: the recipe's), not the saved ones; the rate is
    :func:`load_schedule_state`'s. ``load_state_dict`` restores the saved groups' hyper-parameters, so a
    resume forced through a changed ``optim.weight_decay`` or ``optim.betas`` kept the old ones silently
    (with the recipe the checkpoint was written by they are equal)."""
    built = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    yield
    for group, hp in zip(optimizer.param_groups, built, strict=True):
        group.update(hp)
