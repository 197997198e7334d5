"""A task with two held-out sets for the tests: ``chain_sum`` sums, and the same held-out sums written
another way (``"3 + 5="``: spaces never seen in training) as ``heldout_unseen``."""

from __future__ import annotations

import dataclasses

from posttrain.envs.chain_sum import ChainSumTask
from posttrain.envs.task import TaskExample
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verifier import Verifier


@dataclasses.dataclass(frozen=True)
class TwoSetsTask:
    """``chain_sum`` of ``terms`` digits; ``heldout_unseen`` holds its held-out problems with spaced operators."""

    terms: int = 2
    verifier: Verifier = dataclasses.field(default_factory=IntegerVerifier)
    name: str = "two_sets"
    eval_splits: tuple[str, ...] = ("heldout", "heldout_unseen")

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``train`` / ``heldout``: chain_sum's; ``heldout_unseen``: chain_sum's held-out, spaced."""
        inner = ChainSumTask(terms=self.terms)
        if split != "heldout_unseen":
            return inner.examples(split, n, seed)
        return [dataclasses.replace(ex, prompt_id=f"{ex.prompt_id}/spaced", prompt=ex.prompt.replace("+", " + "))
                for ex in inner.examples("heldout", n, seed + 1)]


def two_sets(**kwargs: object) -> TwoSetsTask:
    """Factory (``task.name=two_sets_task:two_sets``)."""
    return TwoSetsTask(**kwargs)  # type: ignore[arg-type]
