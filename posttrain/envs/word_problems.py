"""``word_problems``: one-step procedural word problems (add, take away, equal groups) in plain English.

``"Mia has 12 stickers. Mia gets 7 more stickers. How many stickers does Mia have now?"`` -> ``19``.
Built for a small pretrained chat model answering in its own words (SmolLM2-135M-Instruct, the
``smollm2_word_problems`` recipe): the response is free-form reasoning, so a recipe reads the answer
with ``reward.extract: last_number`` and a response without a number is ``invalid``, not ``wrong``.

The held-out split is decided by the arithmetic (operation and operands), not by the surface (name,
item): a held-out problem is never seen in training under another name. Difficulty = the largest
operand of ``+`` and ``-`` (``*`` keeps single-digit factors).

Two phrasings. ``"classic"`` (the default; the task of every run before issue 24, unchanged): one
sentence pattern per operation (:func:`phrase`). ``"families"``: 24 sentence patterns per operation
(:mod:`posttrain.envs.word_problem_families`), of which whole families are held out as well
(:func:`~posttrain.envs.word_problem_phrasings.heldout_families`), giving two held-out sets:
``heldout`` = training families x held-out arithmetic (in-distribution), ``heldout_unseen`` = held-out
families x held-out arithmetic (unseen phrasing); ``train`` = training families x training arithmetic.
The arithmetic split is the classic one (same pairs held out in both phrasings).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Literal

from posttrain.envs.task import TASKS, TaskExample, check_split, sample_split, sample_unique, split_of
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.envs.word_problem_families import Family
from posttrain.envs.word_problem_phrasings import answer, families_of, render
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verifier import Verifier

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Noah", "Emma", "Leo", "Zoe")
ITEMS = ("apples", "books", "pencils", "cookies", "marbles", "stickers", "shells", "cards")
OPS = ("add", "sub", "mul")
PHRASINGS = ("classic", "families")
DEFAULT_FAMILY_HELDOUT_FRACTION = 0.25


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
    ``phrasings``: ``"classic"`` (one pattern per operation) or ``"families"`` (see the module doc), whose
    knobs are ``distractor_rate`` (the chance of one irrelevant sentence with a number in a problem, in
    every split) and ``family_heldout_fraction`` (of each operation's families held out, default 0.25 =
    6 of 24); set with ``"classic"`` they are refused (they could not take effect).
    """

    ops: tuple[str, ...] | list[str] | str = OPS
    max_operand: int = 20
    heldout_fraction: float = 0.2
    difficulty: int | None = None
    phrasings: Literal["classic", "families"] = "classic"
    distractor_rate: float = 0.0
    family_heldout_fraction: float | None = None
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
        if self.phrasings not in PHRASINGS:
            raise ValueError(f"word_problems: phrasings must be one of {', '.join(PHRASINGS)}, got {self.phrasings!r}")
        if not 0.0 <= self.distractor_rate <= 1.0:
            raise ValueError(f"word_problems: distractor_rate must be in [0, 1], got {self.distractor_rate}")
        if self.phrasings == "classic":
            dead = [k for k, v in (("distractor_rate", self.distractor_rate != 0.0),
                                   ("family_heldout_fraction", self.family_heldout_fraction is not None)) if v]
            if dead:
                raise ValueError(f"word_problems: {', '.join(dead)} cannot take effect with phrasings='classic' "
                                 "(one sentence pattern per operation); set phrasings='families'")
            return
        if not 0.0 < self._family_fraction < 1.0:
            raise ValueError(f"word_problems: family_heldout_fraction must be in (0, 1), got {self._family_fraction}")

    @property
    def _family_fraction(self) -> float:
        f = self.family_heldout_fraction
        return DEFAULT_FAMILY_HELDOUT_FRACTION if f is None else f

    @property
    def eval_splits(self) -> tuple[str, ...]:
        """The held-out sets: ``heldout`` and, with phrasing families, ``heldout_unseen``."""
        return ("heldout", "heldout_unseen") if self.phrasings == "families" else ("heldout",)

    def _operands(self, op: str, rng: random.Random) -> tuple[int, int]:
        hi = 9 if op == "mul" else self.max_operand
        a, b = rng.randint(2, hi), rng.randint(2, hi)
        if op == "sub" and b > a:
            a, b = b, a
        return a, b

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        op = rng.choice(self.ops)
        a, b = self._operands(op, rng)
        ans = answer(op, a, b)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        key = f"{op}:{a}:{b}"
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=phrase(op, a, b, name, item), reference=ans,
                         meta={"answer": str(ans), "difficulty": self.max_operand, "op": op})
        return key, ex

    def _draw_family(self, rng: random.Random, pair_split: str,
                     families: dict[str, tuple[Family, ...]]) -> tuple[str, TaskExample] | None:
        """A problem of a family in ``families`` whose arithmetic is in ``pair_split``, else None."""
        op = rng.choice(self.ops)
        a, b = self._operands(op, rng)
        pair = f"{op}:{a}:{b}"
        if split_of(f"{self.name}|{pair}", self.heldout_fraction) != pair_split:
            return None
        fam = rng.choice(families[op])
        ans = answer(op, a, b)
        key = f"{pair}/{fam.id}"
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=render(fam, a, b, rng, self.distractor_rate),
                         reference=ans, meta={"answer": str(ans), "difficulty": self.max_operand, "op": op,
                                              "family": fam.id})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs.

        With phrasing families, problems are unique by (arithmetic, family) while the split has unseen
        ones; the prompt id is ``word_problems/<op>:<a>:<b>/<family>`` (e.g. ``word_problems/add:3:8/add07``).
        """
        if self.phrasings == "classic":
            return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction,
                                rng_tag=f"{','.join(self.ops)}:{self.max_operand}")
        check_split(split, self.name, self.eval_splits)
        fraction = self._family_fraction
        unseen = split == "heldout_unseen"
        families = {op: families_of(op, unseen, fraction) for op in self.ops}
        pair_split = "train" if split == "train" else "heldout"
        rng = random.Random(f"{self.name}|families:{','.join(self.ops)}:{self.max_operand}:{self.heldout_fraction}:"
                            f"{fraction}:{self.distractor_rate}|{split}|{seed}")
        return sample_unique(self.name, split, n, rng, lambda r: self._draw_family(r, pair_split, families))


@TASKS.register("word_problems")
def word_problems(**kwargs: object) -> WordProblemsTask:
    """Factory of :class:`WordProblemsTask` (kwargs: ``ops``, ``max_operand`` or ``difficulty``, ``heldout_fraction``,
    ``phrasings``, ``distractor_rate``, ``family_heldout_fraction``)."""
    return build_with_typed_kwargs(WordProblemsTask, kwargs, what="task 'word_problems'")
