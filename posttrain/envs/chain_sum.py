"""``chain_sum``: the sum of a short chain of single digits; prompt ``"3+5+2="``, answer ``"10"``.

The embedded demo's task: a tiny character-level model learns it from scratch in a few hundred
SFT steps, to an accuracy where RL has signal. Difficulty = number of terms (2..9).
"""

from __future__ import annotations

import dataclasses
import random

from posttrain.envs.task import TASKS, TaskExample, sample_split
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verifier import Verifier


@dataclasses.dataclass(frozen=True)
class ChainSumTask:
    """``d1+d2+...+dk=`` with ``k = terms`` digits uniform in 0..9; the answer is the integer sum.

    ``difficulty``, if given, sets ``terms``. With ``k`` terms there are ``10**k`` problems;
    ``heldout_fraction`` of them (by a hash of the problem) are held out.
    """

    terms: int = 3
    heldout_fraction: float = 0.2
    difficulty: int | None = None
    verifier: Verifier = dataclasses.field(default_factory=IntegerVerifier)
    name: str = "chain_sum"

    def __post_init__(self) -> None:
        if self.difficulty is not None:
            object.__setattr__(self, "terms", int(self.difficulty))
        if not 2 <= self.terms <= 9:
            raise ValueError(f"chain_sum: terms must be in 2..9, got {self.terms}")

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        digits = [rng.randrange(10) for _ in range(self.terms)]
        key = "+".join(map(str, digits))
        ans = sum(digits)
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=f"{key}=", reference=ans,
                         meta={"answer": str(ans), "difficulty": self.terms})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs."""
        return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction, rng_tag=str(self.terms))


@TASKS.register("chain_sum")
def chain_sum(**kwargs: object) -> ChainSumTask:
    """Factory of :class:`ChainSumTask` (kwargs: ``terms`` or ``difficulty``, ``heldout_fraction``)."""
    return build_with_typed_kwargs(ChainSumTask, kwargs, what="task 'chain_sum'")
