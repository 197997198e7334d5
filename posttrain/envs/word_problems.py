"""``word_problems``: one-step procedural word problems (add, take away, equal groups) in plain English.

``"Mia has 12 stickers. Mia gets 7 more stickers. How many stickers does Mia have now?"`` -> ``19``.
Built for a small pretrained chat model answering in its own words (SmolLM2-135M-Instruct, the
``smollm2_word_problems`` recipe): the response is free-form reasoning, so a recipe reads the answer
with ``reward.extract: last_number`` and a response without a number is ``invalid``, not ``wrong``.

The held-out split is decided by the arithmetic (operation and operands), not by the surface (name,
item): a held-out problem is never seen in training under another name. Difficulty = the largest
operand of ``+`` and ``-`` (``*`` keeps single-digit factors).
"""

from __future__ import annotations

import dataclasses
import random

from posttrain.envs.task import TASKS, TaskExample, sample_split
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verifier import Verifier

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Noah", "Emma", "Leo", "Zoe")
ITEMS = ("apples", "books", "pencils", "cookies", "marbles", "stickers", "shells", "cards")
OPS = ("add", "sub", "mul")


def phrase(op: str, a: int, b: int, name: str, item: str) -> str:
    """The English problem for ``a op b`` (``sub`` needs ``a >= b``; ``mul`` reads ``a`` groups of ``b``)."""
    if op == "add":
        return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    if op == "sub":
        return f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?"
    if op == "mul":
        return (f"{name} has {a} boxes with {b} {item} in each box. "
                f"How many {item} does {name} have in total?")
    raise ValueError(f"word_problems: unknown op {op!r} (one of {', '.join(OPS)})")


@dataclasses.dataclass(frozen=True)
class WordProblemsTask:
    """Uniform over ``ops``; ``+`` / ``-`` operands in ``[2, max_operand]``, ``*`` factors in ``[2, 9]``.

    ``-`` orders its operands so the answer is >= 0. ``difficulty``, if given, sets ``max_operand``.
    """

    ops: tuple[str, ...] | list[str] | str = OPS
    max_operand: int = 20
    heldout_fraction: float = 0.2
    difficulty: int | None = None
    verifier: Verifier = dataclasses.field(default_factory=IntegerVerifier)
    name: str = "word_problems"

    def __post_init__(self) -> None:
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        object.__setattr__(self, "ops", ops)
        if self.difficulty is not None:
            object.__setattr__(self, "max_operand", int(self.difficulty))
        bad = [o for o in ops if o not in OPS]
        if not ops or bad:
            raise ValueError(f"word_problems: ops must be a non-empty subset of {list(OPS)}, got {list(ops)}")
        if not 3 <= self.max_operand <= 10_000:
            raise ValueError(f"word_problems: max_operand must be in 3..10000, got {self.max_operand}")

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        op = rng.choice(self.ops)
        hi = 9 if op == "mul" else self.max_operand
        a, b = rng.randint(2, hi), rng.randint(2, hi)
        if op == "sub" and b > a:
            a, b = b, a
        ans = {"add": a + b, "sub": a - b, "mul": a * b}[op]
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        key = f"{op}:{a}:{b}"
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=phrase(op, a, b, name, item), reference=ans,
                         meta={"answer": str(ans), "difficulty": self.max_operand, "op": op})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs."""
        return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction,
                            rng_tag=f"{','.join(self.ops)}:{self.max_operand}")


@TASKS.register("word_problems")
def word_problems(**kwargs: object) -> WordProblemsTask:
    """Factory of :class:`WordProblemsTask` (kwargs: ``ops``, ``max_operand`` or ``difficulty``, ``heldout_fraction``)."""
    return WordProblemsTask(**kwargs)  # type: ignore[arg-type]
