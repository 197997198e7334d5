"""``arithmetic``: n-digit ``a op b`` with op in ``+ - *``; prompt ``"23+45="``, answer ``"68"``.

Built for a tiny character-level model: the prompt is the bare expression followed by ``=``
and the response is just the integer (then eos), checked by the ``integer`` verifier.
Difficulty = number of digits of each operand.
"""

from __future__ import annotations

import dataclasses
import random

from posttrain.envs.task import TASKS, TaskExample, sample_split
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verifier import Verifier

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """``a op b =`` with ``a, b`` uniform in ``[0, 10**digits)``.

    ``allow_negative=False`` orders the operands of ``-`` so the answer is >= 0 (a simpler target
    for a tiny model). ``difficulty``, if given, sets ``digits``.
    """

    digits: int = 2
    ops: str = "+-*"
    allow_negative: bool = False
    heldout_fraction: float = 0.1
    difficulty: int | None = None
    verifier: Verifier = dataclasses.field(default_factory=IntegerVerifier)
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if self.difficulty is not None:
            object.__setattr__(self, "digits", int(self.difficulty))
        if not 1 <= self.digits <= 9:
            raise ValueError(f"arithmetic: digits must be in 1..9, got {self.digits}")
        bad = set(self.ops) - set(_OPS)
        if not self.ops or bad:
            raise ValueError(f"arithmetic: ops must be a non-empty subset of '+-*', got {self.ops!r}")

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        hi = 10**self.digits
        a, b, op = rng.randrange(hi), rng.randrange(hi), rng.choice(self.ops)
        if op == "-" and not self.allow_negative and b > a:
            a, b = b, a
        key = f"{a}{op}{b}"
        ans = _OPS[op](a, b)
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=f"{key}=", reference=ans,
                         meta={"answer": str(ans), "difficulty": self.digits, "op": op})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs."""
        return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction,
                            rng_tag=f"{self.digits}:{self.ops}:{self.allow_negative}")


@TASKS.register("arithmetic")
def arithmetic(**kwargs: object) -> ArithmeticTask:
    """Factory of :class:`ArithmeticTask` (kwargs: ``digits``, ``ops``, ``difficulty``...)."""
    return build_with_typed_kwargs(ArithmeticTask, kwargs, what="task 'arithmetic'")
