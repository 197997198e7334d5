"""Which held-out sets a task declares, and each set's examples fetched once."""

import dataclasses
import types

import pytest

from posttrain.config.monitoring import EvalConfig
from posttrain.loop.heldout import eval_splits, split_examples


@dataclasses.dataclass
class Declares:
    eval_splits: tuple[str, ...]
    name: str = "decl"
    fetched: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)

    def examples(self, split: str, n: int, seed: int) -> list[str]:
        self.fetched.append((split, n, seed))
        return [f"{split}:{seed}:{i}" for i in range(n)]


def test_a_task_without_eval_splits_has_the_one_heldout_set():
    assert eval_splits(object()) == ("heldout",)
    assert eval_splits(Declares(("heldout", "heldout_unseen"))) == ("heldout", "heldout_unseen")


@pytest.mark.parametrize("bad", [(), ("heldout_unseen",), ("heldout_unseen", "heldout"), ("heldout", "unseen"),
                                 ("heldout", "heldout_x", "heldout_x"), ("heldout", "heldout_x_sampled"),
                                 ("heldout", "heldout_notool")])
def test_declarations_that_would_break_the_keys_or_promotion_are_refused(bad):
    with pytest.raises(ValueError, match="task 'decl': eval_splits"):
        eval_splits(Declares(bad))


def test_each_further_set_is_fetched_once_per_size_and_seed():
    task = Declares(("heldout", "heldout_unseen"))
    run = types.SimpleNamespace(task=task, heldout=["h"], cfg=types.SimpleNamespace(eval=EvalConfig(size=3), seed=5))
    assert split_examples(run, "heldout") == ["h"]  # the run's own held-out list
    first = split_examples(run, "heldout_unseen")
    assert first == ["heldout_unseen:5:0", "heldout_unseen:5:1", "heldout_unseen:5:2"]
    assert split_examples(run, "heldout_unseen") is first and task.fetched == [("heldout_unseen", 3, 5)]
    run.cfg.eval.size = 2
    assert len(split_examples(run, "heldout_unseen")) == 2 and len(task.fetched) == 2
    run.cfg.eval.heldout_seed = 0  # a set fixed across seeds: drawn with it, cached under it
    assert split_examples(run, "heldout_unseen") == ["heldout_unseen:0:0", "heldout_unseen:0:1"]
    assert task.fetched[-1] == ("heldout_unseen", 2, 0)
