"""The instruction_following task: deterministic prompts, splits disjoint by topic, combination and
wording (heldout_unseen) or by prompt (heldout), compatible constraint sets, readable references."""

from __future__ import annotations

import json

import pytest

from posttrain.envs import TASKS, Task, TaskExample, split_of
from posttrain.envs import instruction_following as inf
from posttrain.rewards.constraints import CHECKERS
from posttrain.rewards.instructions import InstructionsVerifier
from posttrain.trajectory import Status


@pytest.fixture(scope="module")
def task() -> inf.InstructionFollowingTask:
    return inf.InstructionFollowingTask()


@pytest.fixture(scope="module")
def splits(task: inf.InstructionFollowingTask) -> dict[str, list[TaskExample]]:
    return {s: task.examples(s, 300, seed=0) for s in ("train", *task.eval_splits)}


def _wordings(prompt_id: str) -> set[tuple[str, int]]:
    """(family, wording index) pairs of a prompt id ``name/tNN.rR/fam.wK+fam.wK/digest``; request = ``request``."""
    _, head, parts, _ = prompt_id.split("/")
    out = {("request", int(head.split(".r")[1]))}
    for part in parts.split("+"):
        fam, w = part.rsplit(".w", 1)
        out.add((fam, int(w)))
    return out


def test_catalogue_sizes_and_one_heldout_wording_each() -> None:
    assert len(inf.TOPICS) >= 40 and len(set(inf.TOPICS)) == len(inf.TOPICS)
    assert len(inf.FAMILIES) >= 12 and set(inf.FAMILIES) <= set(CHECKERS)
    assert len(inf.heldout_topics()) == len(inf.TOPICS) // 4
    for fam, spec in inf.FAMILIES.items():
        assert len(spec.wordings) >= 4, fam
        assert 0 <= inf.heldout_wording(fam) < len(spec.wordings)
    assert set(inf.KEYWORDS).isdisjoint(inf.FORBIDDEN)


def test_registered_and_a_task(task: inf.InstructionFollowingTask) -> None:
    assert isinstance(TASKS["instruction_following"](), inf.InstructionFollowingTask) and isinstance(task, Task)
    assert task.verifier.name == "instructions"
    assert task.eval_splits == ("heldout", "heldout_unseen")


def test_deterministic_and_distinct(task: inf.InstructionFollowingTask) -> None:
    a = task.examples("heldout_unseen", 40, seed=3)
    assert a == task.examples("heldout_unseen", 40, seed=3)
    assert a != task.examples("heldout_unseen", 40, seed=4)
    assert len({e.prompt_id for e in a}) == 40
    assert task.examples("train", 0, seed=0) == []


def test_heldout_is_in_distribution_but_never_trained(splits: dict[str, list[TaskExample]]) -> None:
    train, held = splits["train"], splits["heldout"]
    # (topic, constraints with parameters): never the same in train and heldout
    assert {(e.meta["topic"], e.reference) for e in train}.isdisjoint({(e.meta["topic"], e.reference) for e in held})
    for e in held:
        assert e.meta["topic"] not in inf.heldout_topics()
        assert all(w != inf.heldout_wording(f) for f, w in _wordings(e.prompt_id))


def test_unseen_holds_out_topics_combinations_and_wordings(splits: dict[str, list[TaskExample]]) -> None:
    seen = splits["train"] + splits["heldout"]
    unseen = splits["heldout_unseen"]
    assert {e.meta["topic"] for e in unseen} <= inf.heldout_topics()
    assert {e.meta["topic"] for e in unseen}.isdisjoint({e.meta["topic"] for e in seen})
    assert {e.meta["combo"] for e in unseen}.isdisjoint({e.meta["combo"] for e in seen})
    unseen_w = set().union(*(_wordings(e.prompt_id) for e in unseen))
    seen_w = set().union(*(_wordings(e.prompt_id) for e in seen))
    assert unseen_w.isdisjoint(seen_w)
    assert all(w == inf.heldout_wording(f) for f, w in unseen_w)
    # the unseen split still covers most families and all constraint counts
    fams = {f for e in unseen for f in str(e.meta["combo"]).split("+")}
    assert len(fams) >= 15 and {e.meta["n_constraints"] for e in unseen} == {1, 2, 3}


def test_prompts_compatible_readable_and_worded(task: inf.InstructionFollowingTask,
                                                splits: dict[str, list[TaskExample]]) -> None:
    for ex in (e for s in splits.values() for e in s):
        specs = json.loads(ex.reference)
        fams = [s["family"] for s in specs]
        assert inf.compatible(fams) and 1 <= len(fams) <= 3, ex.prompt_id
        assert InstructionsVerifier().check_reference(ex.reference) is None
        assert ex.meta["constraints"] == ex.reference and ex.meta["combo"] == inf.combo_key(fams)
        json.dumps(dict(ex.meta))
        assert str(ex.meta["topic"]) in ex.prompt
        for (fam, w), spec in zip(sorted(p for p in _wordings(ex.prompt_id) if p[0] != "request"),
                                  sorted(specs, key=lambda s: s["family"]), strict=True):
            assert inf._render(fam, spec, w) in ex.prompt


def test_compatible_hand_cases() -> None:
    assert inf.compatible(["all_lowercase", "no_commas", "words_at_most"])
    assert not inf.compatible(["all_lowercase", "all_capitals"])
    assert not inf.compatible(["json_keys", "bullet_list"])
    assert not inf.compatible(["words_at_most", "words_between"])
    assert not inf.compatible(["quoted", "start_with"]) and not inf.compatible(["json_keys", "no_commas"])
    assert not inf.compatible(["title", "title"])


def test_a_hand_written_answer_is_correct_and_a_partial_one_wrong() -> None:
    task = TASKS["instruction_following"](families=["all_lowercase", "no_commas"], min_constraints=2)
    unseen = split_of("instruction_following|combo|all_lowercase+no_commas", task.combo_heldout_fraction)
    (ex,) = task.examples("heldout_unseen" if unseen == "heldout" else "train", 1, seed=0)
    assert ex.meta["combo"] == "all_lowercase+no_commas"
    ok = task.verifier.verify("bees visit flowers and bring nectar home. they dry it into honey.", ex.reference)
    assert ok.status is Status.CORRECT and ok.components["task"] == 1.0
    half = task.verifier.verify("Bees visit flowers and bring nectar home. they dry it into honey.", ex.reference)
    assert half.status is Status.WRONG and half.components["ifc_mean"] == 0.5
    assert half.components["ifc/all_lowercase"] == 0.0 and half.components["ifc/no_commas"] == 1.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown split 'test'"):
        TASKS["instruction_following"]().examples("test", 1, seed=0)
    with pytest.raises(ValueError, match="families"):
        TASKS["instruction_following"](families=["haiku"])
    with pytest.raises(ValueError, match="eval_splits"):
        TASKS["instruction_following"](eval_splits=["heldout", "test"])
    only = TASKS["instruction_following"](eval_splits=["heldout_unseen"])
    assert only.eval_splits == ("heldout_unseen",) and len(only.examples("heldout_unseen", 2, seed=0)) == 2
    with pytest.raises(ValueError, match="unknown split 'heldout'"):
        only.examples("heldout", 1, seed=0)
    with pytest.raises(ValueError, match="max_constraints"):
        TASKS["instruction_following"](max_constraints=4)
    with pytest.raises(ValueError, match="only 0 distinct prompts"):  # no combination of 2 in the unseen split
        TASKS["instruction_following"](families=["all_lowercase", "all_capitals"], min_constraints=2).examples(
            "heldout_unseen", 1, seed=0)


def test_train_max_constraints_caps_the_train_split_alone() -> None:
    base = TASKS["instruction_following"]()
    capped = TASKS["instruction_following"](train_max_constraints=1)
    train = capped.examples("train", 200, seed=3)
    assert {ex.meta["n_constraints"] for ex in train} == {1}
    assert {ex.meta["n_constraints"] for ex in base.examples("train", 200, seed=3)} == {1, 2, 3}
    # the held-out splits are the very prompts they are without the cap: runs stay comparable
    for split in ("heldout", "heldout_unseen"):
        assert [ex.prompt_id for ex in capped.examples(split, 50, seed=0)] == [
            ex.prompt_id for ex in base.examples(split, 50, seed=0)]
    # the cap's train prompts are still training prompts: no held-out topic and no held-out combination
    held = inf.heldout_topics()
    for ex in train:
        assert ex.meta["topic"] not in held
        assert split_of(f"instruction_following|combo|{ex.meta['combo']}", capped.combo_heldout_fraction) == "train"
    with pytest.raises(ValueError, match="train_max_constraints"):
        TASKS["instruction_following"](train_max_constraints=3, max_constraints=2)
    with pytest.raises(ValueError, match="train_max_constraints"):
        TASKS["instruction_following"](train_max_constraints=1, min_constraints=2)


def test_on_topic_adds_the_request_as_a_constraint_and_keeps_the_prompts() -> None:
    assert set(inf.TOPIC_WORDS) == set(inf.TOPICS)
    for topic, words in inf.TOPIC_WORDS.items():  # the topic names its own subject
        assert CHECKERS["mentions_any"](topic, words), topic
    base = TASKS["instruction_following"]()
    strict = TASKS["instruction_following"](on_topic=True)
    for split in ("train", "heldout", "heldout_unseen"):
        plain, topical = base.examples(split, 30, seed=1), strict.examples(split, 30, seed=1)
        assert [(e.prompt_id, e.prompt) for e in plain] == [(e.prompt_id, e.prompt) for e in topical]
        for e, t in zip(plain, topical, strict=True):
            specs = json.loads(t.reference)
            assert specs[:-1] == json.loads(e.reference)
            assert specs[-1] == {"family": "mentions_any", "words": list(inf.TOPIC_WORDS[e.meta["topic"]])}
    # the verifier hole it closes: an off-topic one-liner meets the explicit constraints only
    ref = json.dumps([{"family": "no_commas"}])
    topical_ref = json.dumps([{"family": "no_commas"},
                              {"family": "mentions_any", "words": list(inf.TOPIC_WORDS["a summer festival"])}])
    assert base.verifier.verify("Sabotage.", ref).status is Status.CORRECT
    off = base.verifier.verify("Sabotage.", topical_ref)
    assert off.status is Status.WRONG and off.components["ifc/mentions_any"] == 0.0
    assert base.verifier.verify("The summer festival had music all night.", topical_ref).status is Status.CORRECT
