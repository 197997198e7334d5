"""reasoning-gym adapter: its datasets as tasks, its scorer as the verifier (offline)."""

from posttrain.envs import TASKS
from posttrain.trajectory import Status


def test_adapter_splits_and_scores_with_the_datasets_own_scorer():
    t = TASKS["reasoning_gym"](dataset="basic_arithmetic")
    train, held = t.examples("train", 12, 0), t.examples("heldout", 4, 0)
    assert t.examples("train", 12, 0) == train
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    e = train[0]
    assert t.verifier.verify(e.meta["answer"], e.reference).status is Status.CORRECT
    assert t.verifier.verify("not a number", e.reference).status is Status.WRONG
    assert t.verifier.verify("  ", e.reference).status is Status.INVALID
