"""``linear``: solve ``a*x+b=c`` for the integer ``x``; prompt ``"3x+5=20,x="``, answer ``"5"``.

One step of algebra (subtract, then divide) that a tiny character-level model can learn.
Difficulty 1: ``a`` in 1..3, ``x, b`` in 0..9; difficulty 2: ``a`` in 1..9, ``x`` in -9..9,
``b`` in -9..9; difficulty 3: ``a`` in 2..19, ``x, b`` in -99..99. ``a = 1`` is written ``x``.
"""

from __future__ import annotations

import dataclasses
import random

from posttrain.envs.task import TASKS, TaskExample, sample_split
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verifier import Verifier

_RANGES = {1: ((1, 3), (0, 9), (0, 9)), 2: ((1, 9), (-9, 9), (-9, 9)), 3: ((2, 19), (-99, 99), (-99, 99))}


def render(a: int, b: int, c: int) -> str:
    """``"3x+5=20"`` / ``"x-4=2"`` / ``"2x=8"``."""
    lhs = ("x" if a == 1 else f"{a}x") + ("" if b == 0 else f"{b:+d}")
    return f"{lhs}={c}"


@dataclasses.dataclass(frozen=True)
class LinearTask:
    """Solve ``a*x+b=c`` (answer: the integer ``x``)."""

    difficulty: int = 1
    heldout_fraction: float = 0.1
    verifier: Verifier = dataclasses.field(default_factory=IntegerVerifier)
    name: str = "linear"

    def __post_init__(self) -> None:
        if self.difficulty not in _RANGES:
            raise ValueError(f"linear: difficulty must be one of {sorted(_RANGES)}, got {self.difficulty}")

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        (a0, a1), (x0, x1), (b0, b1) = _RANGES[self.difficulty]
        a, x, b = rng.randint(a0, a1), rng.randint(x0, x1), rng.randint(b0, b1)
        key = render(a, b, a * x + b)
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=f"{key},x=", reference=x,
                         meta={"answer": str(x), "difficulty": self.difficulty})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs."""
        return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction,
                            rng_tag=str(self.difficulty))


@TASKS.register("linear")
def linear(**kwargs: object) -> LinearTask:
    """Factory of :class:`LinearTask` (kwargs: ``difficulty``)."""
    return build_with_typed_kwargs(LinearTask, kwargs, what="task 'linear'")
