"""The ``pairs_load`` check the pair trainers' ``posttrain check`` lists start with (offline ``preference``,
``reward_model``): the pairs of ``preference.data`` load, validated, and both splits are non-empty."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from posttrain.commands.check_result import CheckResult
from posttrain.config import RunConfig
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.envs.preference_data import PreferencePair


def pairs_load(cfg: RunConfig, config_check: Callable[[RunConfig], None] | None = None
               ) -> tuple[CheckResult, list[PreferencePair]]:
    """``(result, training pairs)`` of the ``pairs_load`` check on ``cfg``: ``config_check(cfg)`` first (the
    trainer's own config check, if any), then
    :func:`~posttrain.loop.preference_training.load_pairs`. A :class:`~posttrain.errors.UserError` of
    either fails the check with the error as its detail (naming the file, row or split) and no pairs: the
    caller's list ends there."""
    from posttrain.loop.preference_training import load_pairs

    try:
        if config_check is not None:
            config_check(cfg)
        train, held = load_pairs(cfg)
    except UserError as e:
        return ("pairs_load", False, str(e)), []
    return ("pairs_load", True, f"{len(train)} training and {len(held)} held-out pairs of {cfg.preference.data}"), train
