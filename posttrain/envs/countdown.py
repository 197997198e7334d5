"""``countdown`` task: prompt ``"3 5 2>16:"`` (numbers, then the target), answer ``"(3+5)*2"``.

Each problem is generated from a random expression over the numbers, so a solution exists and
is stored as ``meta["answer"]`` (model-free reference). Difficulty = how many numbers (2..5);
numbers are in ``1..max_number``.
"""

from __future__ import annotations

import dataclasses
import random

from posttrain.envs.task import TASKS, TaskExample, sample_split
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.rewards.countdown import CountdownVerifier
from posttrain.rewards.verifier import Verifier


def _combine(rng: random.Random, nums: list[int]) -> tuple[str, int, bool]:
    """Fold ``nums`` left to right with random ops; returns (expr, value, top-level is +/-)."""
    expr, val, additive = str(nums[0]), nums[0], False
    for b in nums[1:]:
        ops = ["+", "*"] + (["-"] if val - b > 0 else []) + (["/"] if b > 1 and val % b == 0 else [])
        op = rng.choice(ops)
        left = f"({expr})" if op in "*/" and additive else expr
        expr = f"{left}{op}{b}"
        val = {"+": val + b, "-": val - b, "*": val * b, "/": val // b}[op]
        additive = op in "+-"
    return expr, val, additive


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Reach ``target`` with the given numbers (each at most once) and ``+ - * /``."""

    difficulty: int = 2
    max_number: int = 9
    max_target: int = 99
    heldout_fraction: float = 0.1
    verifier: Verifier = dataclasses.field(default_factory=CountdownVerifier)
    name: str = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.difficulty <= 5:
            raise ValueError(f"countdown: difficulty (number count) must be in 2..5, got {self.difficulty}")
        if self.max_number < 2:
            raise ValueError(f"countdown: max_number must be >= 2, got {self.max_number}")

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        while True:
            nums = [rng.randint(1, self.max_number) for _ in range(self.difficulty)]
            expr, target, _ = _combine(rng, nums)
            if 0 < target <= self.max_target:
                break
        shown = sorted(nums)
        key = f"{' '.join(map(str, shown))}>{target}"
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=f"{key}:",
                         reference={"numbers": shown, "target": target},
                         meta={"answer": expr, "difficulty": self.difficulty})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs."""
        return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction,
                            rng_tag=f"{self.difficulty}:{self.max_number}:{self.max_target}")


@TASKS.register("countdown")
def countdown(**kwargs: object) -> CountdownTask:
    """Factory of :class:`CountdownTask` (kwargs: ``difficulty``, ``max_number``, ``max_target``)."""
    return build_with_typed_kwargs(CountdownTask, kwargs, what="task 'countdown'")
