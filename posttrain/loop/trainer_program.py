"""What a trainer is to ``posttrain train``: a :class:`TrainerProgram` named by its registry entry.

Each entry of :data:`posttrain.config.trainers.TRAINERS` names its program by ``"module:attr"``
(``posttrain.loop.training_loop:PROGRAM`` for ``trainer: rl``); :func:`load_program` resolves it with the one
plug-in loader (:func:`posttrain.dotted.import_dotted`) and checks that it has the protocol's two callables.
The command then runs ``program.check(cfg)`` before anything is written and ``program.train(cfg, progress)``,
and prints the result's :meth:`TrainerResult.summary_lines`. A trainer module ends with its
``PROGRAM``, an object with those two methods (``training_loop.RLProgram``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from posttrain.config.trainers import trainer_entry
from posttrain.dotted import import_dotted

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.config import RunConfig

__all__ = ["TrainerProgram", "TrainerResult", "load_program"]


class TrainerResult(Protocol):
    """What a trainer's run returns: steps done, wall seconds and its closing lines."""

    @property
    def step(self) -> int:
        """The last step done."""
        ...

    @property
    def wall_seconds(self) -> float:
        """Wall-clock seconds of the run (resumed runs: all their sessions)."""
        ...

    def summary_lines(self) -> list[str]:
        """The lines ``posttrain train`` prints when the run ends; the first is the ``done: N steps ...`` line
        (the measured held-out rise follows it for an entry with ``heldout_rise``)."""
        ...


class TrainerProgram(Protocol):
    """One trainer: ``check(cfg)`` raises :class:`~posttrain.errors.UserError` (or a ``ValueError``; one line)
    for what would fail at its first step for a reason of the config or its inputs, and writes nothing;
    ``train(cfg, progress)`` runs the whole run (open / resume, steps, checkpoints, close) and returns its
    :class:`TrainerResult`."""

    def check(self, cfg: RunConfig) -> None:
        """Everything checked before the run directory is written."""
        ...

    def train(self, cfg: RunConfig, progress: Progress | None) -> TrainerResult:
        """Run the trainer on ``cfg`` (``progress``: rich progress bars, or None)."""
        ...


def _takes(fn: Callable[..., object], n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (by its signature)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except (TypeError, ValueError):
        return False
    return True


def load_program(name: str) -> TrainerProgram:
    """The program of trainer ``name``: its entry's ``program`` path imported
    (:func:`~posttrain.dotted.import_dotted`). ``ValueError`` (one line) for an unknown name (listing the known
    ones), a path that does not import, or an object whose ``check`` does not take ``(cfg)`` or whose ``train``
    does not take ``(cfg, progress)``."""
    entry = trainer_entry(name)
    what = f"trainer {name!r} program"
    program = import_dotted(entry.program, what=what, shape="package.module:PROGRAM")
    for method, args in (("check", ("cfg",)), ("train", ("cfg", "progress"))):
        fn = getattr(program, method, None)
        if not (callable(fn) and _takes(fn, len(args))):
            raise ValueError(f"{what}: {entry.program} has no method {method}({', '.join(args)}) (a TrainerProgram: "
                             "check(cfg) and train(cfg, progress))")
    checked: TrainerProgram = program
    return checked
