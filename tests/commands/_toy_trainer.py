"""A trainer defined outside posttrain, for tests/commands/test_trainer_plugin.py: one module ending with its
``PROGRAM`` (:class:`posttrain.loop.trainer_program.TrainerProgram`), which a registry entry names by
``"tests.commands._toy_trainer:PROGRAM"``. Its "training" counts ``cfg.steps`` steps and writes one line per
step to ``toy.log`` in the run directory."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from posttrain.errors import UserError

LOG = "toy.log"
"""The file the toy writes in the run directory."""


@dataclasses.dataclass(frozen=True)
class ToyResult:
    """A :class:`~posttrain.loop.trainer_program.TrainerResult`: the last step, wall seconds, the run directory."""

    step: int
    wall_seconds: float
    run_dir: Path

    def summary_lines(self) -> list[str]:
        """The ``done: N steps`` line, then where the log is."""
        return [f"done: {self.step} steps (toy)", f"toy log: {self.run_dir / LOG}"]


class ToyProgram:
    """``check(cfg)``: refuses ``steps < 1`` (one line, writing nothing); ``train(cfg, progress)``: writes
    ``step <k>`` for k = 1..``cfg.steps`` to ``<run_dir>/toy.log``."""

    def check(self, cfg: Any) -> None:
        if cfg.steps < 1:
            raise UserError(f"trainer=toy needs steps >= 1, got steps={cfg.steps}")

    def train(self, cfg: Any, progress: Any) -> ToyResult:
        from posttrain.loop.lifecycle import run_dir_of

        start = time.monotonic()
        run_dir = run_dir_of(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / LOG).write_text("".join(f"step {k}\n" for k in range(1, cfg.steps + 1)))
        return ToyResult(step=cfg.steps, wall_seconds=time.monotonic() - start, run_dir=run_dir)


PROGRAM = ToyProgram()

__all__ = ["LOG", "PROGRAM", "ToyProgram", "ToyResult"]
