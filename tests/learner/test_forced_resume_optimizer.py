"""A trainer restored from a checkpoint takes its AdamW hyper-parameters and its learning rate from the
settings it was built with (the recipe), not from the saved optimizer: a resume forced through a changed
``optim.weight_decay`` / ``betas`` / ``lr`` used to keep the saved ones silently (``load_state_dict``
restores the saved groups). With the settings the checkpoint was written by, the restored groups are the
saved ones."""

from __future__ import annotations

import torch

from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import Trainer

SAVED = OptimizerSettings(lr=0.1, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=None, lr_schedule="linear",
                          total_steps=4)


def _stepped(settings: OptimizerSettings) -> Trainer:
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    t = Trainer([x], settings, BatchingSettings())
    (x ** 2).sum().backward()
    t.optimizer.step()
    t.scheduler.step()
    return t


def _groups(t: Trainer) -> list[dict[str, object]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups]


def test_the_same_settings_restore_the_saved_groups() -> None:
    saved = _stepped(SAVED)
    again = Trainer([torch.nn.Parameter(torch.zeros(2))], SAVED, BatchingSettings())
    again.load_state_dict(saved.state_dict(), owner="test")
    assert _groups(again) == _groups(saved)
    assert again.current_lr() == 0.1 * (1 - 1 / 4)  # linear over 4 optimizer steps, at step 1


def test_changed_settings_take_effect_at_the_restored_step() -> None:
    saved = _stepped(SAVED)
    forced = OptimizerSettings(lr=0.2, betas=(0.8, 0.99), weight_decay=0.5, max_grad_norm=None,
                               lr_schedule="linear", total_steps=8)
    t = Trainer([torch.nn.Parameter(torch.zeros(2))], forced, BatchingSettings())
    t.load_state_dict(saved.state_dict(), owner="test")
    (g,) = t.optimizer.param_groups
    assert (g["betas"], g["weight_decay"]) == ((0.8, 0.99), 0.5)
    assert t.current_lr() == 0.2 * (1 - 1 / 8)  # the new rate and horizon, at the restored step 1
    assert t.optimizer.state[g["params"][0]]["step"] == 1  # AdamW's moments are the saved ones
