"""Rendering the phrasing families of ``word_problems`` and holding whole families out.

:func:`render` writes one family's sentences for ``(a, b)`` with a drawn person, second person and
item, and with probability ``distractor_rate`` one irrelevant sentence (:data:`DISTRACTORS`: a
number that is not part of the arithmetic, never equal to an operand or the answer) inserted before
one of the family's sentences. :func:`heldout_families` decides which families are held out: per
operation, the ``ceil(fraction * n)`` families with the smallest SHA-256 of their id (at least one
held out and one kept), the same in every run and process. The families themselves:
:mod:`posttrain.envs.word_problem_families`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random

from posttrain.envs.word_problem_families import FAMILIES, Family


@dataclasses.dataclass(frozen=True)
class Person:
    """A name and its pronouns (subject, object, possessive)."""

    name: str
    he: str
    him: str
    his: str


def _people(names: str, he: str, him: str, his: str) -> tuple[Person, ...]:
    return tuple(Person(n, he, him, his) for n in names.split())


PEOPLE = (_people("Tom Sam Ben Noah Leo Omar Raj Diego Kenji Lucas", "he", "him", "his")
          + _people("Anna Lily Mia Emma Zoe Sofia Aisha Mei Grace Nora", "she", "her", "her"))

DISTRACTORS: tuple[tuple[str, str], ...] = (
    ("{name} is {d} years old.", "years"),
    ("It was {d} degrees outside that day.", "degrees"),
    ("{name} lives on floor {d} of a tall building.", "floor"),
    ("The house next door has {d} windows.", "windows"),
    ("{name}'s school is {d} blocks away.", "blocks"),
    ("{name}'s favorite number is {d}.", "favorite"),
    ("There are {d} lamp posts on the street.", "lamp posts"),
)
"""Irrelevant sentences with their number ``{d}``, each with a word that no family uses (a test checks),
so it cannot be read as part of the problem."""

DISTRACTOR_RANGE = (2, 20)
"""``{d}`` is drawn from this range (inclusive), other than the operands and the answer."""


def answer(op: str, a: int, b: int) -> int:
    """``a + b``, ``a - b`` or ``a * b`` for ``op`` = ``add`` / ``sub`` / ``mul``."""
    return {"add": a + b, "sub": a - b, "mul": a * b}[op]


def fill(family: Family, a: int, b: int, person: Person, other: Person, item: str = "") -> list[str]:
    """``family``'s sentences for ``a op b`` about ``person`` (and ``other``, the second person) and ``item``
    (one of ``family.items``; ignored by a family without items)."""
    fields = {"a": a, "b": b, "name": person.name, "he": person.he, "He": person.he.capitalize(),
              "him": person.him, "his": person.his, "name2": other.name, "item": item}
    return [s.format(**fields) for s in family.sentences]


def render(family: Family, a: int, b: int, rng: random.Random, distractor_rate: float = 0.0) -> str:
    """The problem ``a op b`` in ``family``'s words; people, item and distractor drawn from ``rng``.

    Deterministic in ``rng``'s state. The distractor (drawn iff ``rng.random() < distractor_rate``) goes
    before one of the family's sentences, never after the last, so a question that ends the problem
    still ends it.
    """
    person, other = rng.sample(PEOPLE, 2)
    sentences = fill(family, a, b, person, other, rng.choice(family.items) if family.items else "")
    if rng.random() < distractor_rate:
        taken = {a, b, answer(family.op, a, b)}
        d = rng.choice([x for x in range(DISTRACTOR_RANGE[0], DISTRACTOR_RANGE[1] + 1) if x not in taken])
        template, _ = rng.choice(DISTRACTORS)
        sentences.insert(rng.randrange(len(sentences)), template.format(name=person.name, d=d))
    return " ".join(sentences)


def family_hash(family_id: str) -> int:
    """A process-independent hash of a family id (SHA-256), the order in which families are held out."""
    return int.from_bytes(hashlib.sha256(f"word_problems/family|{family_id}".encode()).digest()[:8], "big")


def heldout_families(op: str, fraction: float) -> frozenset[str]:
    """Ids of ``op``'s held-out families: the ``ceil(fraction * n)`` of its ``n`` families with the smallest
    :func:`family_hash`, at least 1 and at most ``n - 1``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"word_problems: family_heldout_fraction must be in (0, 1), got {fraction}")
    fams = sorted(FAMILIES[op], key=lambda f: family_hash(f.id))
    k = min(max(1, math.ceil(fraction * len(fams))), len(fams) - 1)
    return frozenset(f.id for f in fams[:k])


def families_of(op: str, heldout: bool, fraction: float) -> tuple[Family, ...]:
    """``op``'s held-out families (``heldout=True``) or its training families, in id order."""
    out = heldout_families(op, fraction)
    return tuple(f for f in FAMILIES[op] if (f.id in out) == heldout)
