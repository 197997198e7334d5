"""Your own task and verifier in a few lines: reverse a short word ("abc>" -> "cba").

Try it (from the repository root)::

    PYTHONPATH=. posttrain inspect task examples.my_task:make_task --n 3

and train on it by naming the factory in a recipe: ``task: {name: "examples.my_task:make_task"}``.
A verifier is any object with ``name``, ``version`` and ``verify(response, reference) -> Verdict``;
a task is any object with ``name``, ``verifier`` and ``examples(split, n, seed)``.
"""

import dataclasses

from posttrain.envs.task import TaskExample, sample_split
from posttrain.rewards import Verdict
from posttrain.trajectory import Status


@dataclasses.dataclass(frozen=True)
class ReverseVerifier:
    name: str = "reverse"
    version: str = "1"  # bump when a verdict could change: the ledger records name@version

    def verify(self, response: str, reference: str, **context) -> Verdict:
        got = response.strip()
        if not got.isalpha():
            return Verdict(Status.INVALID, {"task": 0.0}, f"not a word: {got!r}")
        ok = got == reference
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)}, f"{got!r} vs {reference!r}")


@dataclasses.dataclass(frozen=True)
class ReverseTask:
    difficulty: int = 4  # longest word
    name: str = "reverse"
    verifier: ReverseVerifier = ReverseVerifier()

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        def draw(rng):
            w = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, self.difficulty)))
            return w, TaskExample(f"reverse/{w}", f"{w}>", w[::-1], {"answer": w[::-1]})

        # sample_split: deterministic by seed; train/heldout disjoint by a hash of the word
        return sample_split(self.name, split, n, seed, draw, heldout_fraction=0.1, rng_tag=str(self.difficulty))


def make_task(**kwargs) -> ReverseTask:
    return ReverseTask(**kwargs)
